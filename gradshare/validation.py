"""Validation data split across the workers: a DataFrame or RDD of validation rows,
one shard per rank, scored on every replica and reduced to one number.

Driver side (`shards_for`): the validation rows are checked against the training data (columns and
their types from the schema, before any Spark job; then dtypes and shapes in a pre-pass like the
training one), cut into one shard per rank, and zipped into the training RDD without moving the
training rows: PySpark has no `zipPartitions`, and `rdd.barrier()` takes one RDD, so shard i is
packed into exactly as many elements as training partition i has rows (the pre-pass counted them) and
`RDD.zip` pairs each training row with a short list of validation rows (`pack`). The training rows keep
their partition and order, so a fit with and without shards trains the same trajectory.

Worker side: `split_rows` hands the training rows to the usual reader and the validation rows, on a
second thread through a bounded queue, to a second reader (memory or spill file, as training rows);
`shard_sums` scores a shard in batches. Every rank scores its shard at the same log point (the
epoch's last step on the longest rank, worker.py), and the partial sums are all-gathered through
Spark's barrier context (`BarrierTaskContext.allGather`) and reduced in rank order: the same float64
operations on the same numbers on every rank, so every rank holds the same value bit for bit and rank
0's early stopping and callbacks decide on it.

The reduction rule (`reduce_sums`): a metric returns a number, read as the mean over the batch's rows
and summed as value × rows; or a pair (sum, count), summed as it is. The reduced value is
Σ sum / Σ count. That is exact for means over rows (accuracy: the default counts correct rows, the
mean loss, MSE, MAE); a metric that is not a mean over rows (AUC, F1) cannot be reduced from shards:
score it with the in-memory ``(X, y)`` pair instead.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeGuard

import numpy as np
import torch
from pyspark.sql.types import ArrayType, BooleanType, FractionalType, IntegralType

from gradshare.errors import TrainingError
from gradshare.spark import dataframe_to_rdd, is_dataframe

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

# validation rows per forward pass on a worker (at least batch_size): bounds the memory of a score
SCORE_BATCH_ROWS = 1024
QUEUE_CHUNKS = 64  # validation chunks in flight between the reading thread and the training rows


def is_distributed(data: object) -> TypeGuard[DataFrame | RDD[Any]]:
    """Whether `validation_data` is a Spark DataFrame or RDD (else an in-memory pair or None)."""
    return is_dataframe(data) or hasattr(data, "mapPartitionsWithIndex")


def metric_value(value: Any):
    """A metric's value: a float, or a (sum, count) pair of floats (module docstring)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise TypeError(f"metric returned a sequence of {len(value)} values; return a number or (sum, count)")
        return float(value[0]), float(value[1])
    return float(value)


def as_mean(value: Any) -> float:
    """The in-memory pair's score: a (sum, count) pair is its ratio."""
    value = metric_value(value)
    return value[0] / value[1] if isinstance(value, tuple) else value


def reduce_sums(messages: Iterable[str]) -> float:
    """Σ sum / Σ count over every rank's ``json [sum, count]`` (in rank order: every rank adds the same
    numbers in the same order, so every rank gets the same float)."""
    total, count = 0.0, 0.0
    for m in messages:
        s, c = json.loads(m)
        total, count = total + float(s), count + float(c)
    return total / count if count else float("nan")


# ------------------------------------------------------------------------------------ driver side
def _column_kind(dtype) -> str:
    """A column's Spark type as what it becomes for the model: "vector", "int", "float", "bool", or
    "array<...>" of those; "?" for anything else."""
    # imported here, on the driver only: pyspark.ml's package __init__ imports pandas and pyarrow, which
    # a worker importing this module would otherwise carry (~50 MB of its baseline; docs/benchmarks/memory.md)
    from pyspark.ml.linalg import VectorUDT

    if isinstance(dtype, VectorUDT):
        return "vector"
    if isinstance(dtype, ArrayType):
        inner = _column_kind(dtype.elementType)
        return "?" if inner == "?" else f"array<{inner}>"
    if isinstance(dtype, BooleanType):
        return "bool"
    if isinstance(dtype, IntegralType):
        return "int"
    if isinstance(dtype, FractionalType):
        return "float"
    return "?"


def check_columns(validation, training, columns: list[str]) -> None:
    """A validation DataFrame has every column (features and label) with the kind of type the training
    DataFrame's has: read from the schemas, so it fails before any Spark job."""
    for c in columns:
        if c not in validation.columns:
            raise ValueError(f"validation_data has no column {c!r} (the training data's); its columns are "
                             f"{validation.columns}")
        mine = _column_kind(validation.schema[c].dataType)
        theirs = _column_kind(training.schema[c].dataType)
        if mine == "?" or mine != theirs:
            raise TypeError(f"validation_data column {c!r} has type {validation.schema[c].dataType.simpleString()}, "
                            f"the training data's has {training.schema[c].dataType.simpleString()}; cast it")


def validation_rows(validation: DataFrame | RDD[tuple[object, object]], training: object,
                    features_col: str | list[str] | None, label_col: str | None) -> RDD[tuple[object, object]]:
    """The validation data as an RDD of (features, label) rows, read like the training data."""
    if is_dataframe(validation):
        if not is_dataframe(training):
            raise ValueError("validation_data is a DataFrame but the training data is an RDD: give both as "
                             "DataFrames (fit's features_col/label_col name the columns of both) or both as RDDs")
        cols = [features_col] if isinstance(features_col, str) else list(features_col)
        check_columns(validation, training, [*cols, label_col])
        return dataframe_to_rdd(validation, features_col, label_col)
    return validation


def shards_of(rdd, world: int):
    """The validation RDD cut into `world` partitions, one per rank (any shard may be empty). Not by
    coalesce: a barrier stage refuses an RDD with ancestors of another partition count in it
    (SPARK-24820); a shuffle puts them in a stage of their own."""
    return rdd if rdd.getNumPartitions() == world else rdd.repartition(world)


def check_shards(summaries, layout, names: tuple[str, ...]) -> list[int]:
    """Every non-empty shard agrees with the training rows (`layout`: check_summaries's), errors naming
    the shard, the row and the column or input; returns the rows of every shard."""
    rows = []
    for s in sorted(summaries, key=lambda s: s.index):
        if s.rows == 0 and s.error == f"partition {s.index} is empty":  # that rank scores nothing
            rows.append(0)
            continue
        if s.error is not None:  # "partition 1 row 3: ..." of the shards
            raise (TypeError if s.error_type == "TypeError" else ValueError)(
                f"bad validation_data: {s.error.replace('partition', 'shard', 1)}")
        diff = layout.features.difference(s.features)
        if diff is not None:  # "features input 1 of dtype" -> "column 'b' of dtype" where there are columns
            what = diff[0]
            for i, name in enumerate(names):
                what = what.replace(f"features input {i}" if layout.features.multi else "features", name)
            raise (ValueError if "shape" in diff[0] else TypeError)(
                f"bad validation_data: shard {s.index} has {what} {diff[1]}, the training data {diff[2]}")
        if s.label_shape != layout.label_shape or (layout.label_kind == "int" and s.label_kind == "float"
                                                   and not s.labels_whole):
            raise TypeError(f"bad validation_data: shard {s.index} has labels {s.label_kind}{list(s.label_shape)}, "
                            f"the training data {layout.label_kind}{list(layout.label_shape)}")
        rows.append(s.rows)
    if not any(rows):
        raise ValueError("validation_data has no rows")
    return rows


def pack(index: int, rows: Iterator[Any], have: list[int], into: list[int]) -> Iterator[list]:
    """Shard `index`'s `have[index]` rows as exactly `into[index]` lists (element j: rows
    j·m/n .. (j+1)·m/n), so that `RDD.zip` can pair them with the training partition's rows."""
    m, n = have[index], into[index]
    it = iter(rows)
    for j in range(n):
        size = (j + 1) * m // n - j * m // n
        chunk = list(itertools.islice(it, size))
        if len(chunk) < size or (j == n - 1 and next(it, None) is not None):
            raise ValueError(f"validation shard {index} does not have the {m} rows its pre-pass counted: the "
                             "validation RDD is not deterministic (cache or checkpoint it)")
        yield chunk


def zip_shards(train, shards, train_rows: list[int], shard_rows: list[int]):
    """The training RDD with each row paired to a list of validation rows of the same rank (`pack`)."""
    return train.zip(shards.mapPartitionsWithIndex(partial(pack, have=shard_rows, into=train_rows)))


# ------------------------------------------------------------------------------------ worker side
def split_rows(pairs: Iterable, read_train: Callable, read_shard: Callable, timeout: float):
    """(read_train(training rows), read_shard(validation rows) or None when the shard is empty) from
    `zip_shards`'s pairs, read in one pass: the shard's reader runs on a thread fed through a bounded
    queue, so neither side waits for the other's whole partition (both stream, or spill)."""
    chunks: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)
    done = threading.Event()  # the training side stopped (finished or failed): no more chunks come
    out: dict = {}

    def shard_rows():
        while True:
            try:
                chunk = chunks.get(timeout=0.1)
            except queue.Empty:
                if done.is_set() and chunks.empty():
                    return
                continue
            yield from chunk

    def reader():
        try:
            first = shard_rows()
            head = next(first, None)
            out["shard"] = None if head is None else read_shard(itertools.chain([head], first))
        except BaseException as e:  # noqa: BLE001 - handed to the training side below
            out["error"] = e

    def training_rows():
        for row, chunk in pairs:
            while chunk:  # bounded: wait for the reader, never hold more than QUEUE_CHUNKS
                if "error" in out:
                    raise out["error"]
                try:
                    chunks.put(chunk, timeout=0.1)
                    break
                except queue.Full:
                    continue
            yield row

    thread = threading.Thread(target=reader, name="gradshare-validation-read", daemon=True)
    thread.start()
    train = None
    try:
        train = read_train(training_rows())
    finally:
        done.set()
        if train is None:  # failed: let the reader end (bounded, like the join below), drop what it read
            deadline = time.monotonic() + timeout
            while thread.is_alive() and time.monotonic() < deadline:
                try:
                    chunks.get(timeout=0.1)
                except queue.Empty:
                    pass
    thread.join(timeout)  # it ends once the queue (a few chunks at most) is drained after `done`
    if thread.is_alive():
        train.close()
        raise TrainingError(f"the validation shard's reader did not finish {timeout} s after the training rows")
    if "error" in out:
        train.close()
        raise out["error"]
    return train, out.get("shard")


def shard_sums(model, step, data, metric, label_dtype: str, batch_rows: int, device) -> tuple[float, float]:
    """(sum, count) of `metric` (None: the step's loss) over a shard, read in slices of `batch_rows`
    (`PartitionData.read` / `SpilledPartition.read`: bounded memory), on the model in eval mode."""
    total, count = 0.0, 0.0
    if data is None:
        return total, count
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(data), batch_rows):
                inputs, labels = data.read(start, min(start + batch_rows, len(data)))
                labels = np.asarray(labels, dtype=label_dtype)
                batch = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (*inputs, labels))
                value = metric_value(step.evaluate(model, batch, metric))
                if isinstance(value, tuple):
                    total, count = total + value[0], count + value[1]
                else:  # a mean over the batch's rows
                    total, count = total + value * len(labels), count + len(labels)
    finally:
        model.train(was_training)
    return total, count
