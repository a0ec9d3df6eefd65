"""Spark glue: session defaults, barrier slot checks, RDD/DataFrame → per-partition training rows.

Nothing here trains; it only gets data and slots ready for the barrier stage (DESIGN.md, "Spark").
pyspark is imported inside functions so that `import gradshare` stays light.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

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
    from pyspark.sql import SparkSession

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
    from pyspark.sql import SparkSession

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
    feature_shape: tuple[int, ...] | None
    label_kind: str | None  # "int" | "float"
    label_shape: tuple[int, ...] | None
    error: str | None = None
    error_type: str = "ValueError"  # "TypeError" for labels/features of the wrong type


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
        if arr.dtype.kind in "iuf" and arr.size > 0:
            return "float", tuple(arr.shape)
    raise TypeError(f"label {label!r} of type {type(label).__name__} is not an int, a float or a numeric array")


def _features(x: Any) -> np.ndarray:
    if hasattr(x, "toArray"):  # pyspark.ml.linalg DenseVector / SparseVector
        x = x.toArray()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iufb" or arr.size == 0:
        raise TypeError(f"features of type {type(x).__name__} (dtype {arr.dtype}) are not a non-empty numeric array")
    return arr


def split_row(row: Any) -> tuple[Any, Any]:
    """A (features, label) pair from a tuple/list row or a pyspark Row of two fields."""
    try:
        x, y = row
    except (TypeError, ValueError):
        raise TypeError(f"a row must be a (features, label) pair, got {type(row).__name__}") from None
    return x, y


def summarise_partition(index: int, rows: Iterable[Any]) -> PartitionSummary:
    """Validate one partition's rows; errors are returned (not raised) so the driver reports them."""
    n, fshape, kind, lshape = 0, None, None, None
    try:
        for n, row in enumerate(rows):
            x, y = split_row(row)
            shape = _features(x).shape
            k, ls = _label_kind(y)
            if fshape is None:
                fshape, kind, lshape = shape, k, ls
            elif shape != fshape:
                raise ValueError(f"features of shape {shape} differ from the partition's first row {fshape}")
            elif (k, ls) != (kind, lshape) and not (ls == lshape == () and {k, kind} == {"int", "float"}):
                raise TypeError(f"label kind {k}{list(ls)} differs from the first row's {kind}{list(lshape)}")
            elif k == "float":
                kind = "float"  # ints mixed with floats: the labels are floats
        else:
            if fshape is None:
                return PartitionSummary(index, 0, None, None, None, f"partition {index} is empty")
        return PartitionSummary(index, n + 1, fshape, kind, lshape)
    except (TypeError, ValueError) as e:
        return PartitionSummary(index, n, fshape, kind, lshape, f"partition {index} row {n}: {e}", type(e).__name__)


def check_summaries(summaries: list[PartitionSummary]) -> PartitionSummary:
    """Raise the first partition's error, or a cross-partition mismatch; return the common layout."""
    summaries = sorted(summaries, key=lambda s: s.index)
    for s in summaries:
        if s.error is not None:
            raise (TypeError if s.error_type == "TypeError" else ValueError)(f"bad training data: {s.error}")
    first = summaries[0]
    for s in summaries[1:]:
        if s.feature_shape != first.feature_shape:
            raise ValueError(
                f"bad training data: partition {s.index} has features of shape {s.feature_shape}, "
                f"partition {first.index} has {first.feature_shape}"
            )
        if s.label_shape != first.label_shape or (s.label_kind != first.label_kind and s.label_shape != ()):
            raise TypeError(
                f"bad training data: partition {s.index} has labels {s.label_kind}{list(s.label_shape)}, "
                f"partition {first.index} has {first.label_kind}{list(first.label_shape)}"
            )
    kind = "float" if any(s.label_kind == "float" for s in summaries) else "int"
    return PartitionSummary(-1, sum(s.rows for s in summaries), first.feature_shape, kind, first.label_shape)


def dataframe_to_rdd(df, features_col: str, label_col: str):
    """(features, label) rows from two DataFrame columns (ML vectors or arrays; numeric labels)."""
    missing = [c for c in (features_col, label_col) if c not in df.columns]
    if missing:
        raise ValueError(f"DataFrame has no column(s) {missing}; its columns are {df.columns}")
    return df.select(features_col, label_col).rdd.map(tuple)


# --------------------------------------------------------------------------------------- materialise
class PartitionData:
    """One partition as two arrays, held in memory or, past `spill_bytes`, in a local spill file.

    The rows are read from Spark once (DESIGN.md: "materialises its partition once") and then iterated
    every epoch in a seeded shuffled order.
    """

    def __init__(self, features: np.ndarray, labels: np.ndarray, spill_path: str | None = None):
        self.features, self.labels, self.spill_path = features, labels, spill_path

    def __len__(self) -> int:
        return len(self.labels)

    def close(self) -> None:
        if self.spill_path is not None:
            self.features = self.labels = None  # drop the memmaps before the file goes
            try:
                os.remove(self.spill_path)
            except OSError:
                pass
            self.spill_path = None

    @classmethod
    def from_rows(cls, rows: Iterator[Any], label_dtype: str, *, spill_bytes: int = 256 << 20,
                  spill_dir: str | None = None, chunk_rows: int = 4096, index: int = 0) -> "PartitionData":
        xs_chunks: list[np.ndarray] = []
        ys_chunks: list[np.ndarray] = []
        held = 0
        spill = None  # (file, path) once past the limit
        fshape = None
        xs: list[np.ndarray] = []
        ys: list[Any] = []
        n = 0

        def flush() -> None:
            nonlocal held, spill
            if not xs:
                return
            cx = np.stack(xs).astype(np.float32, copy=False)
            cy = np.asarray(ys, dtype=label_dtype)
            xs.clear()
            ys.clear()
            held += cx.nbytes + cy.nbytes
            xs_chunks.append(cx)
            ys_chunks.append(cy)
            if spill is None and held > spill_bytes:
                import tempfile

                fd, path = tempfile.mkstemp(prefix=f"gradshare-part{index}-", suffix=".bin", dir=spill_dir)
                spill = (os.fdopen(fd, "wb"), path)
            if spill is not None:  # features go to disk; labels are small and stay in memory
                for c in xs_chunks:
                    c.tofile(spill[0])
                xs_chunks.clear()

        for row in rows:
            x, y = split_row(row)
            arr = _features(x)
            if fshape is None:
                fshape = arr.shape
            elif arr.shape != fshape:
                raise ValueError(f"partition {index} row {n}: features of shape {arr.shape}, first row {fshape}")
            xs.append(arr)
            ys.append(y.toArray() if hasattr(y, "toArray") else y)
            n += 1
            if len(xs) >= chunk_rows:
                flush()
        flush()
        if n == 0:
            raise ValueError(f"partition {index} is empty")
        labels = np.concatenate(ys_chunks)
        if spill is None:
            return cls(np.concatenate(xs_chunks), labels)
        spill[0].close()
        features = np.memmap(spill[1], dtype=np.float32, mode="r", shape=(n, *fshape))
        return cls(features, labels, spill_path=spill[1])


def epoch_order(n: int, seed: int, rank: int, epoch: int) -> np.ndarray:
    """Row order of one epoch: seeded by (seed, rank, epoch) so a resumed attempt replays it exactly."""
    return np.random.default_rng([seed, rank, epoch]).permutation(n)
