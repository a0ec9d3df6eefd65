"""One training partition inside a Spark task: the pre-pass's summary of its rows (`summarise_partition`,
run by every task and checked on the driver, driver/session.py), the rows materialised in memory or
spilled (`PartitionData`), and each epoch's order of them (`epoch_order`).

pyspark is not imported here: the task's rows arrive as plain Python objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradshare.task.batches import InputLayout, is_multi, row_inputs, stack_inputs
from gradshare.task.spill import SpilledPartition, SpillWriter


@dataclass(frozen=True)
class PartitionSummary:
    """What the pre-pass learns about one partition; `error` is None when the rows are valid."""

    index: int
    rows: int
    features: InputLayout | None  # dtype and shape of every input (gradshare/task/batches.py)
    label_kind: str | None  # "int" | "float"
    label_shape: tuple[int, ...] | None
    error: str | None = None
    error_type: str = "ValueError"  # "TypeError" for labels/features of the wrong type
    labels_whole: bool = True  # every label is a whole number >= 0 (class indices as doubles: StringIndexer)
    sample: tuple[Any, ...] | None = None  # the first row as (inputs, label) arrays: the driver's one-row probe
    label_range: tuple[int, int] | None = None  # lowest and highest scalar int (or whole) label

    @property
    def feature_shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...] | None:
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


def label_value(label: Any) -> Any:
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


def summarise_partition(index: int, rows: Iterable[Any], columns: tuple[str, ...] = ()) -> PartitionSummary:
    """Validate one partition's rows; errors are returned (not raised) so the driver reports them, naming
    the DataFrame's feature `columns` where the rows come from one."""
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
                sample = (arrays, np.asarray(label_value(y)))
            elif (diff := layout.difference(here, columns)) is not None:
                ragged = "shape" in diff[0] and len(diff[1]) == len(diff[2]) == 1
                raise (ValueError if "shape" in diff[0] else TypeError)(
                    f"{diff[0]} {diff[1]} differ from the first row's {diff[2]}"
                    + (
                        ": every row of an array column needs the same length (pad or truncate token ids to "
                        "one length; an attention_mask column can mark the padding)"
                        if ragged
                        else ""
                    )
                )
            elif (k, ls) != (kind, lshape) and not (ls == lshape == () and {k, kind} == {"int", "float"}):
                raise TypeError(f"label kind {k}{list(ls)} differs from the first row's {kind}{list(lshape or ())}")
            elif k == "float":
                kind = "float"  # ints mixed with floats: the labels are floats
            whole = whole and ls == () and _whole(y)
            if ls == () and k == "int" or whole:
                low, high = min(low, y), max(high, y)
        else:
            if layout is None:
                return PartitionSummary(index, 0, None, None, None, f"partition {index} is empty")
        return PartitionSummary(
            index,
            n + 1,
            layout,
            kind,
            lshape,
            labels_whole=whole,
            sample=sample,
            label_range=(int(low), int(high)) if low <= high else None,
        )
    except (TypeError, ValueError) as e:
        return PartitionSummary(index, n, layout, kind, lshape, f"partition {index} row {n}: {e}", type(e).__name__)


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

    def __init__(self, features: np.ndarray | tuple[np.ndarray, ...], labels: np.ndarray) -> None:
        self.multi = isinstance(features, tuple)
        self.inputs: tuple[np.ndarray, ...] = features if isinstance(features, tuple) else (features,)
        self.labels = labels

    @property
    def features(self) -> np.ndarray | tuple[np.ndarray, ...]:
        return self.inputs if self.multi else self.inputs[0]

    def __len__(self) -> int:
        return len(self.labels)

    def close(self) -> None:
        """Nothing to release (a `SpilledPartition` removes its file)."""

    def read(self, start: int, stop: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """Rows start..stop-1 as (inputs, labels): the sequential read `SpilledPartition.read` also has."""
        return tuple(a[start:stop] for a in self.inputs), self.labels[start:stop]

    @classmethod
    def from_rows(
        cls,
        rows: Iterator[Any],
        label_dtype: str,
        *,
        spill_bytes: int = 256 << 20,
        spill_dir: str | None = None,
        chunk_rows: int = 4096,
        index: int = 0,
    ) -> PartitionData | SpilledPartition:
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
        layout: InputLayout | None = None
        xs: list[tuple[np.ndarray, ...]] = []
        ys: list[Any] = []
        n = 0
        limit = chunk_rows

        def flush() -> None:
            nonlocal held, writer
            if not xs:
                return
            assert layout is not None  # set by the first row, before any row is held
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
                    row_bytes = sum(a.nbytes for a in arrays) + np.asarray(label_value(y)).nbytes
                    limit = max(1, min(chunk_rows, min(CHUNK_BYTES, spill_bytes // 4) // max(row_bytes, 1)))
                elif (diff := layout.difference(here)) is not None:
                    raise ValueError(f"partition {index} row {n}: {diff[0]} {diff[1]}, first row {diff[2]}")
                xs.append(arrays)
                ys.append(label_value(y))
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
        assert layout is not None  # n > 0 rows: the first one set it
        labels = np.concatenate([c[1] for c in chunks])
        inputs = tuple(np.concatenate([c[0][i] for c in chunks]) for i in range(len(layout.dtypes)))
        return cls(inputs if layout.multi else inputs[0], labels)


def epoch_order(n: int, seed: int, rank: int, epoch: int) -> np.ndarray:
    """Row order of one epoch: seeded by (seed, rank, epoch) so a resumed attempt replays it exactly."""
    return np.random.default_rng([seed, rank, epoch]).permutation(n)
