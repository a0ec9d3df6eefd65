"""Spark glue: session defaults, barrier slot checks, RDD/DataFrame → per-partition training rows.

Nothing here trains; it only gets data and slots ready for the barrier stage (docs/design.md, "Spark").
pyspark is imported inside functions so that `import gradshare` stays light.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
from pyspark.sql import SparkSession

from gradshare.batches import InputLayout, is_multi, row_inputs, stack_inputs
from gradshare.spill import SpilledPartition, SpillWriter

# The directory that holds the `gradshare` package the driver imported. Executors put it on their
# PYTHONPATH so that they run the same code as the driver (an editable install elsewhere, or none).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _executor_pythonpath() -> str:
    parts = [PACKAGE_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))  # dedupe, keep order


def session_builder(master: str, app_name: str = "gradshare", extra_conf: dict[str, str] | None = None):
    """A SparkSession builder with gradshare's defaults for `master`.

    Local masters (``local[...]``, ``local-cluster[...]``) run Python workers with the driver's own
    interpreter (else executors may not find torch), stay on loopback and keep the UI off.
    """
    local = master.startswith("local")
    if local:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    conf = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.executorEnv.PYTHONPATH": _executor_pythonpath(),
    }
    if local:
        conf.update({
            "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
            "spark.driver.memory": "1g",
            "spark.driver.host": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
            "spark.driver.bindAddress": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
        })
    conf.update(extra_conf or {})
    for k, v in conf.items():
        builder = builder.config(k, v)
    return builder


def get_or_create_session(num_workers: int | None = None, master: str | None = None):
    """The active SparkSession, or an embedded ``local[N]`` one (N = num_workers, default 2).

    Returns ``(session, created)``; whoever created it stops it.
    """
    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        return active, False
    if master is None:
        n = num_workers or 2
        if n < 1:
            raise ValueError(f"num_workers must be >= 1, got {n}")
        master = f"local[{n}]"
    session = session_builder(master).getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session, True


def total_slots(sc) -> int:
    """How many tasks of the default resource profile can run at once (what barrier stages need)."""
    jsc = sc._jsc.sc()
    try:  # the scheduler's own count, the same one Spark's barrier check uses
        rp = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(rp))
    except Exception:  # noqa: BLE001 - private API moved: fall back to cores / task.cpus
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        return sc.defaultParallelism // max(cpus, 1)


def busy_slots(sc) -> int:
    tracker = sc.statusTracker()
    busy = 0
    for sid in tracker.getActiveStageIds():
        info = tracker.getStageInfo(sid)
        if info is not None:
            busy += info.numActiveTasks
    return busy


def check_barrier_slots(sc, needed: int, wait: float | None = None) -> None:
    """Raise a clear error when fewer than `needed` task slots are free for a barrier stage.

    Without this, Spark keeps re-checking for minutes before failing. Cluster masters get `wait`
    seconds (default 30; local: 0) for executors to register first.
    """
    if needed < 1:
        raise ValueError(f"a barrier stage needs at least 1 slot, got needed={needed}")
    master = sc.master
    if wait is None:
        wait = 0.0 if master.startswith("local[") or master == "local" else 30.0
    deadline = time.monotonic() + wait
    while True:
        total, busy = total_slots(sc), busy_slots(sc)
        if total - busy >= needed:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"not enough task slots for the barrier stage: {needed} workers need {needed} free slots, "
                f"but master {master!r} has {total} slots ({busy} busy, {max(total - busy, 0)} free); "
                f"use fewer partitions (num_workers) or more executor cores"
            )
        time.sleep(0.5)


# --------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class PartitionSummary:
    """What the pre-pass learns about one partition; `error` is None when the rows are valid."""

    index: int
    rows: int
    features: InputLayout | None  # dtype and shape of every input (gradshare/batches.py)
    label_kind: str | None  # "int" | "float"
    label_shape: tuple[int, ...] | None
    error: str | None = None
    error_type: str = "ValueError"  # "TypeError" for labels/features of the wrong type
    labels_whole: bool = True  # every label is a whole number >= 0 (class indices as doubles: StringIndexer)
    sample: tuple | None = None  # the first row as (inputs, label) arrays: the driver's one-row probe
    label_range: tuple[int, int] | None = None  # lowest and highest scalar int (or whole) label

    @property
    def feature_shape(self):
        """The features' shape; a tuple of shapes for multi-input rows."""
        if self.features is None:
            return None
        return self.features.shapes if self.features.multi else self.features.shapes[0]


def _label_kind(label: Any) -> tuple[str, tuple[int, ...]]:
    if isinstance(label, (bool, np.bool_)):
        raise TypeError(f"label {label!r} is a bool; use an int class index or a float")
    if isinstance(label, (int, np.integer)):
        return "int", ()
    if isinstance(label, (float, np.floating)):
        return "float", ()
    if hasattr(label, "toArray"):  # pyspark.ml.linalg vectors
        label = label.toArray()
    if isinstance(label, (list, tuple, np.ndarray)):
        arr = np.asarray(label)
        if arr.dtype.kind in "iu" and arr.size > 0:
            return "int", tuple(arr.shape)  # int labels of any shape stay int64 (per-token classes)
        if arr.dtype.kind == "f" and arr.size > 0:
            return "float", tuple(arr.shape)
    raise TypeError(f"label {label!r} of type {type(label).__name__} is not an int, a float or a numeric array")


def _label_value(label: Any) -> Any:
    return label.toArray() if hasattr(label, "toArray") else label


def _whole(label: Any) -> bool:
    """A scalar label that can be a class index: finite, whole, >= 0."""
    return np.ndim(label) == 0 and bool(np.isfinite(label)) and float(label).is_integer() and label >= 0


def split_row(row: Any) -> tuple[Any, Any]:
    """A (features, label) pair from a tuple/list row or a pyspark Row of two fields."""
    try:
        x, y = row
    except (TypeError, ValueError):
        raise TypeError(f"a row must be a (features, label) pair, got {type(row).__name__}") from None
    return x, y


def summarise_partition(index: int, rows: Iterable[Any]) -> PartitionSummary:
    """Validate one partition's rows; errors are returned (not raised) so the driver reports them."""
    n, layout, kind, lshape, whole, sample = 0, None, None, None, True, None
    low, high = np.inf, -np.inf  # of scalar labels that can be class indices
    try:
        for n, row in enumerate(rows):
            x, y = split_row(row)
            arrays = row_inputs(x)
            here = InputLayout.of(arrays, is_multi(x))
            k, ls = _label_kind(y)
            if layout is None:
                layout, kind, lshape = here, k, ls
                sample = (arrays, np.asarray(_label_value(y)))
            elif (diff := layout.difference(here)) is not None:
                raise (ValueError if "shape" in diff[0] else TypeError)(
                    f"{diff[0]} {diff[1]} differ from the first row's {diff[2]}")
            elif (k, ls) != (kind, lshape) and not (ls == lshape == () and {k, kind} == {"int", "float"}):
                raise TypeError(f"label kind {k}{list(ls)} differs from the first row's {kind}{list(lshape)}")
            elif k == "float":
                kind = "float"  # ints mixed with floats: the labels are floats
            whole = whole and ls == () and _whole(y)
            if ls == () and k == "int" or whole:
                low, high = min(low, y), max(high, y)
        else:
            if layout is None:
                return PartitionSummary(index, 0, None, None, None, f"partition {index} is empty")
        return PartitionSummary(index, n + 1, layout, kind, lshape, labels_whole=whole, sample=sample,
                                label_range=(int(low), int(high)) if low <= high else None)
    except (TypeError, ValueError) as e:
        return PartitionSummary(index, n, layout, kind, lshape, f"partition {index} row {n}: {e}", type(e).__name__)


def check_summaries(summaries: list[PartitionSummary]) -> PartitionSummary:
    """Raise the first partition's error, or a cross-partition mismatch; return the common layout
    (with partition 0's first row as the sample)."""
    summaries = sorted(summaries, key=lambda s: s.index)
    for s in summaries:
        if s.error is not None:
            raise (TypeError if s.error_type == "TypeError" else ValueError)(f"bad training data: {s.error}")
    first = summaries[0]
    for s in summaries[1:]:
        diff = first.features.difference(s.features)
        if diff is not None:  # each partition agrees with its own row 0, so row 0 is where it differs
            raise (ValueError if "shape" in diff[0] else TypeError)(
                f"bad training data: partition {s.index} has {diff[0]} {diff[1]}, partition {first.index} has "
                f"{diff[2]} (row 0 of each)")
        if s.label_shape != first.label_shape or (s.label_kind != first.label_kind and s.label_shape != ()):
            raise TypeError(
                f"bad training data: partition {s.index} has labels {s.label_kind}{list(s.label_shape)}, "
                f"partition {first.index} has {first.label_kind}{list(first.label_shape)} (row 0 of each)"
            )
    kind = "float" if any(s.label_kind == "float" for s in summaries) else "int"
    ranges = [s.label_range for s in summaries if s.label_range is not None]
    span = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None
    return PartitionSummary(-1, sum(s.rows for s in summaries), first.features, kind, first.label_shape,
                            labels_whole=all(s.labels_whole for s in summaries), sample=first.sample,
                            label_range=span)


def is_dataframe(data: object) -> bool:
    """A pyspark DataFrame, classic or Spark Connect (both subclass pyspark.sql.DataFrame; a Connect
    DataFrame's `.rdd` raises, so no duck typing on it)."""
    from pyspark.sql import DataFrame

    return isinstance(data, DataFrame)


def is_connect(data: object) -> bool:
    """A Spark Connect DataFrame or session: no SparkContext, no RDDs."""
    return type(data).__module__.startswith("pyspark.sql.connect")


def feature_columns(df, features_col, label_col) -> list[str]:
    """features_col as a list of column names, every named column checked against the DataFrame's."""
    cols = [features_col] if isinstance(features_col, str) else list(features_col)
    if not cols or not all(isinstance(c, str) for c in cols):
        raise ValueError(f"features_col must be a column name or a non-empty list of them, got {features_col!r}")
    missing = [c for c in (*cols, label_col) if c not in df.columns]
    if missing:
        raise ValueError(f"DataFrame has no column(s) {missing}; its columns are {df.columns}")
    return cols


def dataframe_to_rdd(df, features_col: str | list[str] | tuple[str, ...], label_col: str):
    """(features, label) rows from DataFrame columns (ML vectors, arrays or numbers; numeric labels).
    A list of feature columns gives multi-input rows ``((a, b, ...), label)``: model(a, b, ...)."""
    cols = feature_columns(df, features_col, label_col)
    selected = df.select(*cols, label_col).rdd
    if isinstance(features_col, str):
        return selected.map(tuple)
    # an array column arrives as a list, which `is_multi` counts as an input; a number column becomes
    # a 0-d array so that the tuple is still read as inputs (a (B,) tensor each)
    return selected.map(lambda r: (tuple(np.asarray(_label_value(v)) for v in r[:-1]), r[-1]))


# --------------------------------------------------------------------------------------- materialise
# Rows are stacked into arrays a chunk at a time; a chunk holds at most this many bytes of rows, a quarter
# of `spill_bytes` and `chunk_rows` rows, so that wide rows do not make a chunk (its Python row objects,
# the stacked arrays and the spill records: three copies at once) a memory spike beyond the budget.
CHUNK_BYTES = 4 << 20


class PartitionData:
    """One partition in memory: one array per input plus the labels. A partition past `spill_bytes` is
    a `spill.SpilledPartition` instead, streamed from a local spill file with bounded memory;
    `from_rows` returns whichever fits.

    The rows are read from Spark once (docs/design.md: "materialises its partition once") and then iterated
    every epoch in a seeded shuffled order (`epoch_order`). `features` is one array, or a tuple of them for
    multi-input rows (then `inputs` is the same tuple; for one input, `inputs` is ``(features,)``).
    """

    spilled = False
    spill_path = None

    def __init__(self, features, labels: np.ndarray):
        self.multi = isinstance(features, tuple)
        self.inputs = features if self.multi else (features,)
        self.labels = labels

    @property
    def features(self):
        return self.inputs if self.multi else self.inputs[0]

    def __len__(self) -> int:
        return len(self.labels)

    def close(self) -> None:
        """Nothing to release (a `SpilledPartition` removes its file)."""

    def read(self, start: int, stop: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """Rows start..stop-1 as (inputs, labels): the sequential read `SpilledPartition.read` also has."""
        return tuple(a[start:stop] for a in self.inputs), self.labels[start:stop]

    @classmethod
    def from_rows(cls, rows: Iterator[Any], label_dtype: str, *, spill_bytes: int = 256 << 20,
                  spill_dir: str | None = None, chunk_rows: int = 4096,
                  index: int = 0) -> PartitionData | SpilledPartition:
        """Materialise a partition's (features, label) rows: a `PartitionData` while they take at most
        `spill_bytes`, else a `spill.SpilledPartition` in `spill_dir`. While the rows stream in, memory
        stays within about `spill_bytes` plus one chunk: the rows held so far go to the file when they
        pass the limit, and every later chunk goes there as soon as it is stacked (an in-memory
        partition then joins its chunks: twice its size for a moment, as before)."""
        if isinstance(spill_bytes, bool) or not isinstance(spill_bytes, (int, np.integer)) or spill_bytes < 1:
            raise ValueError(f"spill_bytes must be a positive number of bytes, got {spill_bytes!r}")
        chunks: list[tuple[tuple[np.ndarray, ...], np.ndarray]] = []  # held in memory until the limit
        held = 0
        writer: SpillWriter | None = None
        layout = None
        xs: list[tuple[np.ndarray, ...]] = []
        ys: list[Any] = []
        n = 0
        limit = chunk_rows

        def flush() -> None:
            nonlocal held, writer
            if not xs:
                return
            cx = stack_inputs(xs, len(layout.dtypes))
            cy = np.asarray(ys, dtype=label_dtype)
            xs.clear()
            ys.clear()
            if writer is not None:
                writer.write(cx, cy)
                return
            held += sum(c.nbytes for c in cx) + cy.nbytes
            chunks.append((cx, cy))
            if held > spill_bytes:  # from now on every row goes to the file, labels too
                writer = SpillWriter(spill_dir, index, layout, label_dtype, cy.shape[1:])
                while chunks:
                    writer.write(*chunks.pop(0))

        try:
            for row in rows:
                x, y = split_row(row)
                arrays = row_inputs(x)
                here = InputLayout.of(arrays, is_multi(x))
                if layout is None:
                    layout = here
                    row_bytes = sum(a.nbytes for a in arrays) + np.asarray(_label_value(y)).nbytes
                    limit = max(1, min(chunk_rows, min(CHUNK_BYTES, spill_bytes // 4) // max(row_bytes, 1)))
                elif (diff := layout.difference(here)) is not None:
                    raise ValueError(f"partition {index} row {n}: {diff[0]} {diff[1]}, first row {diff[2]}")
                xs.append(arrays)
                ys.append(_label_value(y))
                n += 1
                if len(xs) >= limit:
                    flush()
            flush()
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        if n == 0:
            raise ValueError(f"partition {index} is empty")
        if writer is not None:
            return writer.finish(window_bytes=spill_bytes)
        labels = np.concatenate([c[1] for c in chunks])
        inputs = tuple(np.concatenate([c[0][i] for c in chunks]) for i in range(len(layout.dtypes)))
        return cls(inputs if layout.multi else inputs[0], labels)


def epoch_order(n: int, seed: int, rank: int, epoch: int) -> np.ndarray:
    """Row order of one epoch: seeded by (seed, rank, epoch) so a resumed attempt replays it exactly."""
    return np.random.default_rng([seed, rank, epoch]).permutation(n)
