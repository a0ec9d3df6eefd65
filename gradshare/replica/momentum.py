"""The workers' optimizer momentum under error feedback: kept, or lowered for each step.

A worker's residual holds every part of its updates that it has not sent yet (error feedback, Strom
2015), and each step sends only the entries that crossed τ: what gets through is already an average of
the worker's past updates, a momentum of its own. An optimizer's first moment (Adam's β1, SGD's
momentum) adds a second, lagging average on top, and with many workers that lag is what holds learning
back. The default by worker count is the planner's (driver/policy.py): at most 0.5 below 32 workers, where
some momentum still filters each worker's noise out of what crosses τ, and off from 32; the measurements
are on docs/research/defaults.md.

The lowered value is set around each optimizer step and put back after it, as the lr factors are
(task/worker.py): the optimizer's param groups, a scheduler that cycles momentum (OneCycleLR) and a
checkpoint see the values as given.
"""

from __future__ import annotations

from typing import Any

import torch

# param-group keys that hold a first moment's decay: Adam, AdamW, Adamax, NAdam, RAdam (and any optimizer
# that names its moments' decays the same) keep (β1, β2) in "betas"; SGD and RMSprop keep "momentum"
BETAS, MOMENTUM = "betas", "momentum"

Saved = list[tuple[dict[str, Any], str, Any]]
# config.OptimizerMomentum, checked there ("auto", "off", "keep" or a number in [0, 1)); the replica
# imports nothing above it (pyproject.toml's import contracts)
Option = str | float


def momentum_ceiling(option: Option) -> float | None:
    """The most momentum (Adam's β1, SGD's momentum) each worker steps with, for an option other than
    "auto" (the planner's, driver/policy.py, by worker count); None: the optimizer's own."""
    if option == "auto":
        raise ValueError("optimizer_momentum='auto' depends on the worker count: the planner resolves it")
    if option == "keep":
        return None
    if option == "off":
        return 0.0
    return float(option)


def holds_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any param group has a momentum this module can lower ("betas" or "momentum")."""
    return any(BETAS in g or MOMENTUM in g for g in optimizer.param_groups)


def check_optimizer_momentum(option: Option, optimizer: torch.optim.Optimizer) -> None:
    """On the driver, before Spark starts: "off" or a number needs an optimizer that has a momentum."""
    if option not in ("auto", "keep") and not holds_momentum(optimizer):
        raise ValueError(
            f"optimizer_momentum={option!r}: {type(optimizer).__name__} has no momentum to lower "
            f"(no {BETAS!r} or {MOMENTUM!r} in its param groups); use 'auto' or 'keep'"
        )


def lower_momentum(optimizer: torch.optim.Optimizer, ceiling: float) -> Saved:
    """Lower every param group's momentum to at most `ceiling` for the coming step; returns (group, key,
    value) to put back after it. SGD's Nesterov needs a momentum, so it goes with a momentum of 0."""
    saved: Saved = []
    for group in optimizer.param_groups:
        betas = group.get(BETAS)
        if betas is not None and float(betas[0]) > ceiling:
            saved.append((group, BETAS, betas))
            # as given: both floats or both tensors, as Adam requires
            first = torch.full_like(betas[0], ceiling) if isinstance(betas[0], torch.Tensor) else ceiling
            group[BETAS] = (first, *tuple(betas)[1:])
        if float(group.get(MOMENTUM, 0.0)) > ceiling:
            saved.append((group, MOMENTUM, group[MOMENTUM]))
            group[MOMENTUM] = ceiling
            if ceiling == 0.0 and group.get("nesterov"):
                saved.append((group, "nesterov", True))
                group["nesterov"] = False
    return saved


def put_back(saved: Saved) -> None:
    """Undo `lower_momentum` (and the lr factors, which use the same record)."""
    for group, key, value in reversed(saved):
        group[key] = value


__all__ = ["momentum_ceiling", "holds_momentum", "check_optimizer_momentum", "lower_momentum", "put_back"]
