"""Which torch device a worker trains on: ``device="cpu" | "cuda" | "cuda:N" | "auto"``.

"auto" prefers the GPU Spark gave the task: with GPU scheduling (``spark.task.resource.gpu.amount``)
each task is handed its own device addresses, and two tasks on one executor host must not both pick
cuda:0. Outside such a task it takes CUDA's current device when torch has CUDA, else the CPU.

The Spark task context and the CUDA device count are arguments (the CUDA count defaulting to torch's),
so the choice is tested with plain fakes and without a GPU. This module imports no pyspark: a task's
worker asks Spark for its context through `gradshare.task.device.resolve_device`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class TaskContextLike(Protocol):
    """What is read of a Spark TaskContext: the resources Spark assigned the task."""

    def resources(self) -> Mapping[str, Any]: ...


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def task_gpu(task_context: TaskContextLike | None) -> int | None:
    """The first GPU address Spark assigned to the task as a CUDA ordinal, or None without one.

    A task may be given several GPUs; a worker trains on one replica, so it takes the first.
    """
    if task_context is None:
        return None
    resources = task_context.resources() or {}
    gpu = resources.get("gpu")
    addresses = list(getattr(gpu, "addresses", None) or [])
    if not addresses:
        return None
    first = str(addresses[0]).strip()
    if not first.isdigit():
        raise ValueError(
            f"the Spark task's GPU address {first!r} is not a CUDA ordinal; the GPU discovery script "
            "must report device indices (0, 1, ...), not UUIDs"
        )
    return int(first)


def resolve_device(
    device: object = "auto", *, task_context: TaskContextLike | None = None, cuda_count: int | None = None
) -> torch.device:
    """The torch.device for ``device``: "cpu", "cuda" (CUDA's current device), "cuda:N", "auto", or a
    torch.device.

    task_context: a Spark TaskContext-like object (``resources()["gpu"].addresses``) or None (no task;
        task/device.py passes the running task's). cuda_count: CUDA devices torch can use; default
        torch's own count.
    A CUDA device that torch cannot use is a ValueError naming it (no silent fall-back to the CPU:
    the user asked for the GPU, or Spark scheduled one for the task).
    """
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        name = device.strip().lower()
        if name == "auto":
            index = task_gpu(task_context)
            count = _cuda_count() if cuda_count is None else cuda_count
            if index is not None:
                dev = torch.device("cuda", index)
                _check_cuda(dev, count, why=f"Spark assigned GPU {index} to this task")
                return dev
            return torch.device("cuda") if count > 0 else torch.device("cpu")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(
                f"device must be 'cpu', 'cuda', 'cuda:N', 'auto' or a torch.device, got {device!r}"
            ) from None
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r} is not supported: gradshare trains on 'cpu' or 'cuda' devices")
    _check_cuda(dev, _cuda_count() if cuda_count is None else cuda_count, why=f"device {str(dev)!r} was asked for")
    return dev


def _check_cuda(dev: torch.device, count: int, *, why: str) -> None:
    if count == 0:
        raise ValueError(f"{why}, but torch cannot use CUDA here (no GPU visible, or a CPU-only torch build)")
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{why}, but torch sees only {count} CUDA device(s): cuda:0..cuda:{count - 1}")


def check_device(device: object) -> str:
    """``device`` as the name a worker resolves (SharedTrainer checks it on the driver, which may have no
    GPU of its own, so only the spelling is checked here; executors check that CUDA is usable)."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N', 'auto' or a torch.device, got {device!r}")
    name = device.strip().lower()
    if name == "auto":
        return name
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N', 'auto' or a torch.device, got {device!r}")
    return "cpu" if dev.type == "cpu" else str(dev)


def select(device: torch.device) -> torch.device:
    """Make a CUDA ``device`` CUDA's current one (kernels launched without a device, autocast's and the
    loss scaler's, would otherwise run on cuda:0, the GPU of another task); return it with its index."""
    if device.type == "cuda":
        index: int | None = device.index  # torch's stubs say int; "cuda" has None
        if index is None:  # "cuda" is the current device already; set_device needs an index
            return torch.device("cuda", torch.cuda.current_device())  # (torch 2.11 raises without one)
        torch.cuda.set_device(device)
    return device
