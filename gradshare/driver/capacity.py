"""Whether the model fits in a worker, checked on the driver before any job runs: what a worker holds per
parameter against the memory Spark gives each task's Python process. A model too large fails here with
the numbers, instead of an executor killed by the OS or its cluster manager part way into the first step.

The check is a floor, never a guess from above: a worker holds at least the parameters and the residual
(or the folded point q = P + r), 4 bytes each an entry, plus the optimizer's state, measured by stepping
the fit's own optimizer factory once on a probe tensor (Adam: 8 bytes an entry, SGD with momentum: 4).
The gradients, the activations and the interpreter come on top (a worker's whole peak is ~23 bytes a
parameter with Adam: docs/benchmarks/memory.md), so a model that passes may still not fit, but one that
fails cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradshare.errors import MemoryLimitError

HELD_PER_PARAMETER = 8  # P and the residual (or the folded point), float32
PROBE = 64  # the probe tensor's entries: per-entry state is a multiple of it, a step counter is not
MIB = 1 << 20
DEFAULT_OVERHEAD_MIB, OVERHEAD_FACTOR = 384, 0.10  # Spark's spark.executor.memoryOverhead default


def optimizer_state_bytes(factory: Callable[..., torch.optim.Optimizer]) -> int:
    """Bytes of optimizer state an entry of the parameters holds: the factory's optimizer stepped once on a
    probe tensor. 0 where the probe cannot tell (a factory that needs more than one tensor, say): the check
    is then the parameters' and residual's floor alone."""
    probe = torch.zeros(PROBE, requires_grad=True)
    probe.grad = torch.ones(PROBE)
    try:
        optimizer = factory([probe])
        optimizer.step()
    except Exception:  # noqa: BLE001 - the user's factory: any failure only means no measurement
        return 0
    held = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.numel() == PROBE
    )
    return held // PROBE


def parse_bytes(text: str) -> int:
    """A Spark size ("4g", "512m", "1024k", "2048": MiB) in bytes."""
    value = text.strip().lower().removesuffix("b")
    units = {"k": 1 << 10, "m": MIB, "g": 1 << 30, "t": 1 << 40}
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(float(value) * MIB)


def _size(conf: Callable[[str], str | None], key: str, default: str) -> int:
    """``key``'s size in bytes (``default`` where it is not set); a value Spark would not read names the key."""
    text = conf(key) or default
    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a size (e.g. 4g, 512m)") from None


def _count(conf: Callable[[str], str | None], key: str) -> int:
    text = conf(key) or "1"
    try:
        return max(1, int(text))
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a whole number") from None


def worker_budget(conf: Callable[[str], str | None], world: int, available: int | None) -> tuple[int, str] | None:
    """(bytes one worker's Python process may hold, where that bound comes from), or None where nothing
    bounds it that the driver can read. ``conf``: the session's Spark configuration; ``available``: this
    host's available memory (a local master runs every worker here)."""
    pyspark = conf("spark.executor.pyspark.memory")
    if pyspark:  # Spark limits each Python worker to it
        return _size(conf, "spark.executor.pyspark.memory", pyspark), f"spark.executor.pyspark.memory={pyspark}"
    master = conf("spark.master") or ""
    if master.startswith("local"):
        if available is None:
            return None
        share = available // max(world, 1)
        return share, f"this host's available memory ({available / MIB:,.0f} MiB) split over {world} workers"
    if not master.startswith(("yarn", "k8s://")):  # standalone: no container limit the driver knows of
        return None
    # YARN and Kubernetes kill a container over spark.executor.memory + memoryOverhead; the JVM keeps its
    # heap, so Python's workers live in the overhead, split over the executor's concurrent tasks
    overhead = conf("spark.executor.memoryOverhead")
    if overhead:
        total, said = (
            _size(conf, "spark.executor.memoryOverhead", overhead),
            f"spark.executor.memoryOverhead={overhead}",
        )
    else:
        heap = _size(conf, "spark.executor.memory", "1g")
        total = max(DEFAULT_OVERHEAD_MIB * MIB, int(heap * OVERHEAD_FACTOR))
        said = (
            f"spark.executor.memoryOverhead's default ({total / MIB:,.0f} MiB: the larger of 384 MiB and 10 % "
            "of spark.executor.memory)"
        )
    tasks = max(1, _count(conf, "spark.executor.cores") // _count(conf, "spark.task.cpus"))
    return total // tasks, f"{said}, the executor's memory outside the JVM, split over its {tasks} task(s)"


def check_fits(n_state: int, state_bytes: int, budget: tuple[int, str] | None) -> None:
    """MemoryLimitError where a worker's floor for ``n_state`` entries exceeds ``budget``."""
    if budget is None:
        return
    per = HELD_PER_PARAMETER + state_bytes
    need, (limit, source) = n_state * per, budget
    if need > limit:
        raise MemoryLimitError(
            f"the model's {n_state:,} parameters need at least {need / MIB:,.0f} MiB in each worker "
            f"({per} bytes a parameter: the parameters, the residual and {state_bytes} of optimizer state; "
            f"gradients and activations come on top), more than the {limit / MIB:,.0f} MiB a worker has: "
            f"{source}. Give each worker more memory, run fewer workers per executor or host, or train a "
            "smaller model"
        )


def available_memory() -> int | None:
    """This host's MemAvailable (Linux /proc/meminfo), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_worker_memory(
    n_state: int, factory: Callable[..., torch.optim.Optimizer], conf: Callable[[str], Any], world: int
) -> None:
    """The whole check for a fit: the floor of ``n_state`` entries with the factory's state, against the
    budget the session's configuration gives each of ``world`` workers."""
    check_fits(n_state, optimizer_state_bytes(factory), worker_budget(conf, world, available_memory()))


__all__ = ["check_fits", "check_worker_memory", "optimizer_state_bytes", "parse_bytes", "worker_budget"]
