"""The torch device of a Spark task's worker: `replica.device.resolve_device` with the running task's
context, so that "auto" takes the GPU Spark gave this task (two tasks on one executor host must not
both pick cuda:0). The replica's module takes the context as an argument and imports no pyspark.
"""

from __future__ import annotations

from typing import Any

import torch
from pyspark import TaskContext

from gradshare.replica import device as _replica

_FROM_SPARK: Any = object()  # default of ``task_context``: ask pyspark (Any: a sentinel of no type)


def _spark_task_context() -> TaskContext | None:
    return TaskContext.get()  # None on the driver and outside Spark


def resolve_device(
    device: object = "auto",
    *,
    task_context: _replica.TaskContextLike | None = _FROM_SPARK,
    cuda_count: int | None = None,
) -> torch.device:
    """`replica.device.resolve_device` with ``task_context`` defaulting to the running Spark task's."""
    if task_context is _FROM_SPARK:
        task_context = _spark_task_context()
    return _replica.resolve_device(device, task_context=task_context, cuda_count=cuda_count)
