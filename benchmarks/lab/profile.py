"""Where a gradshare step goes (a missed target is explained from such profiles, not guessed).

The worker times its own phases when `SharedTrainer(runtime=Runtime(worker_options={"profile": True}))` is given
(gradshare/task/profiling.py); each rank's report then holds a "profile" entry: per-step seconds of every
phase, the step wall time (evaluation excluded), the accuracy curve on rank 0 against training
wall-clock, and the `lo` transmit counter over the steps. This module only summarises it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradshare.task.profiling import PHASES as WORKER_PHASES
from gradshare.task.profiling import lo_tx_bytes

__all__ = ["PHASES", "WORKER_PHASES", "lo_tx_bytes", "summarise"]

# The report's coarse phases, each a sum of worker phases: "compute" is everything local to the step
# (batch, lookahead, forward/backward, snapshot, optimizer step).
PHASES = ("compute", "encode", "send", "wait", "apply")
_COARSE = {
    "compute": ("batch", "lookahead", "compute", "snapshot", "optimizer"),
    "encode": ("encode",),
    "send": ("send",),
    "wait": ("wait",),
    "apply": ("apply",),
}


def summarise(steps: dict[str, list[float]], warmup: int) -> dict[str, Any]:
    """Mean seconds per step of each coarse phase and of the wall time, skipping the first `warmup`
    steps (JIT compilation, allocator warm-up). "other" is the wall time no phase accounts for;
    "detail" holds the mean of every worker phase."""
    n = len(steps["wall"])
    skip = min(warmup, max(n - 1, 0))

    def mean(k: str) -> float:
        return float(np.mean(steps[k][skip:])) if n else float("nan")

    detail = {k: mean(k) for k in WORKER_PHASES}
    out: dict[str, Any] = {k: sum(detail[p] for p in parts) for k, parts in _COARSE.items()}
    out["wall"] = mean("wall")
    out["other"] = out["wall"] - sum(out[p] for p in PHASES)
    out["detail"] = detail
    return out
