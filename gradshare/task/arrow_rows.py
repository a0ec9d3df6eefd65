"""A DataFrame's partition as training rows, read from Arrow record batches (`DataFrame.mapInArrow`).

What runs inside the tasks of the DataFrame path (driver/job.py): the pre-pass and the barrier stage
over ``df.select(*features, label).mapInArrow(...)``. A Spark Connect session has no RDDs, and this path
needs none (docs/guide/connect.md).

Each record batch's columns become one NumPy array per column (an Arrow list column is its flat values
reshaped, no per-row Python object), and the rows handed on are views into them, ``(features, label)``
as the RDD path's rows are after `batches.row_inputs`: one array, or a tuple of arrays for several
feature columns, with the same dtypes (floats float32, integers int64, bools). So `summarise_partition`,
`PartitionData.from_rows` and `train_partition` take them unchanged. pyspark ML vectors arrive as the
VectorUDT's struct (type, size, indices, values): dense ones are their values, sparse ones are scattered.

Task results go back as rows (`RESULT_SCHEMA`): the pickled result cut into chunks of a binary column.
pyarrow is imported inside the functions: the tasks have it (mapInArrow needs it), the driver module
that imports this one need not.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from gradshare.task.partition import summarise_partition

# (part, chunk, data): one task's pickled result, cut into chunks of at most RESULT_CHUNK bytes (an Arrow
# binary value is capped at 2 GiB; small chunks keep each result batch small too)
RESULT_SCHEMA = "part long, chunk long, data binary"
RESULT_CHUNK = 1 << 20
VECTOR_FIELDS = {"type", "size", "indices", "values"}  # pyspark.ml.linalg.VectorUDT's sqlType


def _nulls(arr: Any, name: str, offset: int) -> None:
    if arr.null_count:
        first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {name!r} is null at row {offset + first}: fill or drop the nulls first")


def _training_dtype(values: np.ndarray, name: str) -> np.ndarray:
    """Floats float32, integers int64, bools as they are (gradshare/task/batches.py); anything else an error."""
    kind = values.dtype.kind
    if kind == "f":
        return values.astype(np.float32, copy=False)
    if kind in "iu":
        if kind == "u" and values.dtype.itemsize == 8:
            raise TypeError(f"column {name!r} is uint64, whose values above 2**63-1 do not fit int64; cast it")
        return values.astype(np.int64, copy=False)
    if kind == "b":
        return values
    raise TypeError(f"column {name!r} holds {values.dtype}, not numbers")


def column_values(arr: Any, name: str, offset: int = 0, keep: bool = False) -> np.ndarray | list[np.ndarray]:
    """One Arrow column of a batch as a (rows, *shape) array; a list of per-row arrays when its lists
    are ragged (the row checks downstream then name the row whose shape differs). `keep`: leave the
    number type as it is (labels: a float64 label stays float64, as the RDD path's Python float)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    _nulls(arr, name, offset)
    t = arr.type
    if pa.types.is_struct(t) and VECTOR_FIELDS <= {t.field(i).name for i in range(t.num_fields)}:
        return _vectors(arr, name, offset)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        offsets = np.asarray(
            arr.offsets if not pa.types.is_fixed_size_list(t) else np.arange(len(arr) + 1) * t.list_size, dtype=np.int64
        )
        if pa.types.is_fixed_size_list(t):
            offsets = offsets + arr.offset * t.list_size
        inner = column_values(arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])), name, offset, keep)
        offsets = offsets - offsets[0]
        lengths = np.diff(offsets)
        if len(lengths) and np.all(lengths == lengths[0]) and not isinstance(inner, list):
            return inner.reshape(len(lengths), int(lengths[0]), *inner.shape[1:])
        return [np.asarray(inner[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        values = arr.to_numpy(zero_copy_only=False)
        return values if keep else _training_dtype(values, name)
    raise TypeError(f"column {name!r} has type {t}: not a number, an array of numbers or an ML vector")


def _vectors(arr: Any, name: str, offset: int) -> np.ndarray | list[np.ndarray]:
    """A VectorUDT column: dense rows are their values (float64 → float32), sparse rows are scattered."""
    kinds = arr.field("type").to_numpy(zero_copy_only=False)
    values = arr.field("values")
    if np.all(kinds == 1):  # every row dense
        dense = column_values(values, name, offset)
        return dense if isinstance(dense, list) else dense.astype(np.float32, copy=False)
    sizes = arr.field("size").to_numpy(zero_copy_only=False)
    indices = arr.field("indices")
    rows = []
    for i in range(len(arr)):
        vals = np.asarray(values[i].values, dtype=np.float32)
        if kinds[i] == 1:
            rows.append(vals)
        else:
            row = np.zeros(int(sizes[i]), np.float32)
            row[np.asarray(indices[i].values, dtype=np.int64)] = vals
            rows.append(row)
    return rows


def batch_rows(batches: Iterator[Any], names: tuple[str, ...], multi: bool) -> Iterator[tuple[Any, Any]]:
    """(features, label) rows of a partition's record batches, whose columns are `names`: the features,
    then the label (the DataFrame path selects them in that order). `multi`: features_col was a list,
    so features are a tuple with one array per column (a number column: a 0-d array), as
    spark.dataframe_to_rdd makes them."""
    seen = 0
    for batch in batches:
        cols = [column_values(batch.column(i), n, seen) for i, n in enumerate(names[:-1])]
        labels = column_values(batch.column(len(names) - 1), names[-1], seen, keep=True)
        for i in range(batch.num_rows):
            # [i, ...] is a view, and a 0-d ARRAY for a column of numbers (a scalar would not count as
            # an input: batches.is_multi)
            xs = tuple(c[i] if isinstance(c, list) else c[i, ...] for c in cols)
            yield (xs if multi else xs[0]), labels[i]  # a NumPy scalar, or an array for array labels
        seen += batch.num_rows


def result_batches(part: int, result: object) -> Iterator[Any]:
    """`result` pickled and cut into RESULT_SCHEMA record batches (one per chunk)."""
    import pyarrow as pa

    data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    schema = pa.schema([("part", pa.int64()), ("chunk", pa.int64()), ("data", pa.binary())])
    for c, start in enumerate(range(0, max(len(data), 1), RESULT_CHUNK)):
        yield pa.RecordBatch.from_pydict(
            {"part": [part], "chunk": [c], "data": [data[start : start + RESULT_CHUNK]]}, schema=schema
        )


def read_results(rows: list[Any]) -> dict[int, Any]:
    """part -> the unpickled result, from the collected RESULT_SCHEMA rows (any order)."""
    parts: dict[int, list[tuple[int, bytes]]] = {}
    for row in rows:
        parts.setdefault(int(row["part"]), []).append((int(row["chunk"]), bytes(row["data"])))
    return {p: pickle.loads(b"".join(d for _, d in sorted(chunks))) for p, chunks in parts.items()}


def summarise_batches(names: tuple[str, ...], multi: bool, batches: Iterator[Any]) -> Iterator[Any]:
    """The pre-pass task: (PartitionSummary, seconds it took) of this partition, as result rows."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None  # inside a task
    index = ctx.partitionId()
    t0 = time.monotonic()
    summary = summarise_partition(index, batch_rows(batches, names, multi), names[:-1])
    yield from result_batches(index, (summary, time.monotonic() - t0))


def train_batches(cfg: Any, names: tuple[str, ...], multi: bool, batches: Iterator[Any]) -> Iterator[Any]:
    """The barrier task: `worker.train_partition` on this partition's rows; its reports as result rows."""
    from pyspark import BarrierTaskContext

    from gradshare.errors import TrainingError
    from gradshare.task.train import train_partition

    ctx = BarrierTaskContext.get()
    tasks = len(ctx.getTaskInfos())
    if tasks != cfg.job.world_size:  # the pre-pass counted partitions; a plan that changed would misnumber ranks
        raise TrainingError(
            f"the barrier stage has {tasks} tasks but the pre-pass found {cfg.job.world_size} partitions: "
            "the DataFrame's partitioning is not deterministic (cache it or repartition it first)"
        )
    yield from result_batches(ctx.partitionId(), train_partition(cfg, batch_rows(batches, names, multi)))
