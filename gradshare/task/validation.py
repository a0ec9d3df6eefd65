"""Validation shards on the worker side (the driver's side: driver/validation.py).

`pack` runs in the shards' tasks: it cuts shard i into exactly as many elements as training partition
i has rows, so that `RDD.zip` pairs each training row with a short list of validation rows.
`split_rows` hands the training rows to the usual reader and the validation rows, on a second thread
through a bounded queue, to a second reader (memory or spill file, as training rows); `shard_sums`
scores a shard in batches. Every rank scores its shard at the same log point (the epoch's last step on
the longest rank, task/worker.py), and the partial sums are all-gathered through Spark's barrier
context (`BarrierTaskContext.allGather`) and reduced in rank order: the same float64 operations on
the same numbers on every rank, so every rank holds the same value bit for bit and rank 0's early
stopping and callbacks decide on it.

The reduction rule (`reduce_sums`): a metric returns a number, read as the mean over the batch's rows
and summed as value × rows; or a pair (sum, count), summed as it is (`replica.losses.metric_value`).
The reduced value is Σ sum / Σ count. That is exact for means over rows (accuracy: the default counts
correct rows, the mean loss, MSE, MAE); a metric that is not a mean over rows (AUC, F1) cannot be
reduced from shards: score it with the in-memory ``(X, y)`` pair instead.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from gradshare.errors import TrainingError
from gradshare.replica.losses import metric_value

# validation rows per forward pass on a worker (at least batch_size): bounds the memory of a score
SCORE_BATCH_ROWS = 1024
QUEUE_CHUNKS = 64  # validation chunks in flight between the reading thread and the training rows


def as_mean(value: Any) -> float:
    """The in-memory pair's score: a (sum, count) pair is its ratio."""
    score = metric_value(value)
    return score[0] / score[1] if isinstance(score, tuple) else score


def reduce_sums(messages: Iterable[str]) -> float:
    """Σ sum / Σ count over every rank's ``json [sum, count]`` (in rank order: every rank adds the same
    numbers in the same order, so every rank gets the same float)."""
    total, count = 0.0, 0.0
    for m in messages:
        s, c = json.loads(m)
        total, count = total + float(s), count + float(c)
    return total / count if count else float("nan")


def pack(index: int, rows: Iterator[Any], have: list[int], into: list[int]) -> Iterator[list[Any]]:
    """Shard `index`'s `have[index]` rows as exactly `into[index]` lists (element j: rows
    j·m/n .. (j+1)·m/n), so that `RDD.zip` can pair them with the training partition's rows."""
    m, n = have[index], into[index]
    it = iter(rows)
    for j in range(n):
        size = (j + 1) * m // n - j * m // n
        chunk = list(itertools.islice(it, size))
        if len(chunk) < size or (j == n - 1 and next(it, None) is not None):
            raise ValueError(
                f"validation shard {index} does not have the {m} rows its pre-pass counted: the "
                "validation RDD is not deterministic (cache or checkpoint it)"
            )
        yield chunk


class Evaluates(Protocol):
    """A train step's evaluation (losses.LossStep, losses.HookStep)."""

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, ...], metric: Callable[..., Any] | None) -> Any: ...


class Rows(Protocol):
    """A shard's rows, read in slices (partition.PartitionData, spill.SpilledPartition)."""

    def __len__(self) -> int: ...
    def read(self, start: int, stop: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]: ...


# ------------------------------------------------------------------------------------ worker side
def split_rows(
    pairs: Iterable[tuple[Any, list[Any]]],
    read_train: Callable[[Iterator[Any]], Any],
    read_shard: Callable[[Iterator[Any]], Any],
    timeout: float,
) -> tuple[Any, Any]:
    """(read_train(training rows), read_shard(validation rows) or None when the shard is empty) from
    `zip_shards`'s pairs, read in one pass: the shard's reader runs on a thread fed through a bounded
    queue, so neither side waits for the other's whole partition (both stream, or spill)."""
    chunks: queue.Queue[list[Any]] = queue.Queue(maxsize=QUEUE_CHUNKS)
    done = threading.Event()  # the training side stopped (finished or failed): no more chunks come
    out: dict[str, Any] = {}

    def shard_rows() -> Iterator[Any]:
        while True:
            try:
                chunk = chunks.get(timeout=0.1)
            except queue.Empty:
                if done.is_set() and chunks.empty():
                    return
                continue
            yield from chunk

    def reader() -> None:
        try:
            first = shard_rows()
            head = next(first, None)
            out["shard"] = None if head is None else read_shard(itertools.chain([head], first))
        except BaseException as e:  # noqa: BLE001 - handed to the training side below
            out["error"] = e

    def training_rows() -> Iterator[Any]:
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


def shard_sums(
    model: nn.Module,
    step: Evaluates,
    data: Rows | None,
    metric: Callable[..., Any] | None,
    label_dtype: str,
    batch_rows: int,
    device: torch.device,
) -> tuple[float, float]:
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
