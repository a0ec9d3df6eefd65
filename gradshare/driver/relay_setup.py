"""The relay's join window: how long it waits for a rank it has not heard at all (its snapshot
options, which depend on the host the workers reach it at, are transport/sockets/snapshot_rate.py)."""

from __future__ import annotations

from typing import Any

from gradshare.config import TrainConfig
from gradshare.transport import RelayTuning

JOIN_LOAD_FACTOR = 4.0  # join window = timeout + this × the slowest pre-pass partition read (join_window)


def join_window(timeout: float, liveness_timeout: float, load_seconds: float) -> float:
    """How long after a stage attempt starts the relay waits for a rank it has not heard at all:
    `timeout`, plus a generous multiple of the slowest partition's read in the pre-pass
    (the training read also builds arrays or a spill file). A task that is loading says so anyway."""
    return max(timeout, liveness_timeout) + JOIN_LOAD_FACTOR * load_seconds


def relay_tuning(config: TrainConfig, load_seconds: float, forwarding: str, **snapshot: Any) -> RelayTuning:
    """The relay's tunables for this fit (liveness, give-up, join window, forwarding), and `snapshot`'s
    (snapshot_rate.snapshot_options, for the host the workers reach it at)."""
    limits = config.fault_tolerance
    return RelayTuning(
        liveness_timeout=limits.liveness_timeout,
        on_rank_loss=limits.on_rank_loss,
        give_up_after=limits.timeout,
        step_timeout=float(limits.step_timeout),
        join_window=join_window(limits.timeout, limits.liveness_timeout, load_seconds),
        forwarding=forwarding,
        **snapshot,
    )
