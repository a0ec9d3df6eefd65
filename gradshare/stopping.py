"""Early stopping and epoch-end callbacks, decided on rank 0 and carried by the log.

Why the log: every replica must stop at a step that is a function of the log alone, or the replicas
would apply different logs and diverge. Rank 0 scores epoch e on the log through its epoch's last step
(task/scoring.py, `Scorer`), decides, and sets ``StepMeta.stop_epoch = E`` in its next message (step t). Every
rank applies that message before its step t + 1 + k, so every rank whose epoch E ends at step t + k or
later can still stop there; E is the first epoch for which that holds on every rank (`stop_epoch`).
Each rank then ends after its own epoch E and announces FINISHED at that step, as at a normal end, so
ranks with different steps per epoch stop consistently and the replicas meet bit-identical.
The price is latency: the stop lands one epoch after the decision (usually E = e + 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODES = ("min", "max")
MONITORS = ("val_metric", "loss")


@dataclass
class EarlyStopping:
    """Keras's rule: stop when `monitor` has not improved by more than `min_delta` for `patience` epochs.

    patience: epochs without improvement tolerated (0: stop at the first one without).
    min_delta: how much a value must beat the best one to count as an improvement (>= 0).
    mode: "max" (accuracy) or "min" (a loss).
    monitor: "val_metric" (rank 0's validation score) or "loss" (rank 0's mean training loss of the epoch).
    """

    patience: int = 0
    min_delta: float = 0.0
    mode: str = "min"
    monitor: str = "val_metric"
    best: float | None = field(default=None, init=False)
    waited: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise ValueError(f"early_stopping: patience must be an int >= 0, got {self.patience!r}")
        if not isinstance(self.min_delta, (int, float)) or not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise ValueError(f"early_stopping: min_delta must be a finite number >= 0, got {self.min_delta!r}")
        if self.mode not in MODES:
            raise ValueError(f"early_stopping: mode must be one of {MODES}, got {self.mode!r}")
        if self.monitor not in MONITORS:
            raise ValueError(f"early_stopping: monitor must be one of {MONITORS}, got {self.monitor!r}")


def early_stopping_from(option: object) -> EarlyStopping | None:
    """SharedTrainer's `early_stopping` option: None, an EarlyStopping, or a dict of its fields."""
    if option is None or isinstance(option, EarlyStopping):
        return option
    if not isinstance(option, dict):
        raise ValueError(f"early_stopping must be None, a dict or an EarlyStopping, got {type(option).__name__}")
    unknown = set(option) - {"patience", "min_delta", "mode", "monitor"}
    if unknown:
        raise ValueError(f"early_stopping: unknown key(s) {sorted(unknown)}; known: patience, min_delta, mode, monitor")
    return EarlyStopping(**option)


def should_stop(rule: EarlyStopping, row: Mapping[str, Any]) -> bool:
    """Feed one epoch's row (rank 0's) to the rule; True when patience is exhausted."""
    value = row.get(rule.monitor)
    if value is None:
        raise ValueError(
            f"early_stopping monitors {rule.monitor!r} but epoch {row.get('epoch')} has no "
            "value for it (monitor 'val_metric' needs validation_data)"
        )
    # a NaN/inf score (a diverged epoch) is no improvement, as in Keras: patience decides, the fit goes on
    better = math.isfinite(value) and (
        rule.best is None
        or (value < rule.best - rule.min_delta if rule.mode == "min" else value > rule.best + rule.min_delta)
    )
    if better:
        rule.best, rule.waited = value, 0
        return False
    rule.waited += 1
    return rule.waited > rule.patience


def stop_epoch(decided_at: int, staleness: int, steps_per_epoch: tuple[int, ...], epochs: int) -> int | None:
    """The epoch after which every rank stops, for a decision sent in rank 0's message of step
    `decided_at`: the first epoch that ends at step decided_at + k or later on every rank (each rank
    applies that message before its step decided_at + 1 + k). None when that epoch would be the last one
    (or past it) on some rank: no stop then, so a stop always ends EVERY rank after the same epoch E and
    every rank's history has epochs 0..E (the decision is reported, not dropped: FitResult.extra
    "stop_requested_epoch")."""
    reach = decided_at + staleness
    epoch = max(-(-(reach + 1) // spe) - 1 for spe in steps_per_epoch)  # (E + 1)·spe − 1 >= reach
    return epoch if epoch < epochs - 1 else None
