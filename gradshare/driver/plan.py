"""What a SharedTrainer's options become at the start of a fit, before any Spark job: the model built,
the optimizer and scheduler tried once, the threshold rule each worker starts from, drop_last's rule
and the relay's forwarding mode.

`FitSpec` is what the fit reads: the trainer's TrainConfig (frozen, checked once) with its model and
optimizer factory, so the fit's stages (fit.py) are plain functions of it and import nothing of trainer.py.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradshare.config import ModelSpec, OptimizerFactory, SchedulerFactory, TrainConfig
from gradshare.config.options import DEFAULT_WARMUP_MIN_STEPS, OptimizerMomentum, ThresholdRule, is_calibrated
from gradshare.driver.policy import auto_for
from gradshare.encoding import AdaptiveThreshold, CalibratedThreshold, FixedThreshold, ResidualClipping
from gradshare.encoding.step_cap import step_cap_for
from gradshare.encoding.threshold import DEFAULT_DECAY_LR_POWER, DEFAULT_DENSITY
from gradshare.replica.momentum import check_optimizer_momentum, momentum_ceiling


@dataclass(frozen=True)
class FitSpec:
    """What a fit reads: the trainer's options (its TrainConfig, checked and frozen) and the two things
    the trainer adds to them, the model (not an option) and the optimizer factory with its default."""

    config: TrainConfig
    model: ModelSpec
    optimizer: OptimizerFactory  # config.optimizer, or SharedTrainer's default_optimizer


def build_model(given: ModelSpec, seed: int) -> nn.Module:
    """A copy of the user's model, or the factory's model built after ``torch.manual_seed(seed)``."""
    spec: object = given  # the user's: checked here, whatever the annotation promises
    if isinstance(spec, nn.Module):
        return copy.deepcopy(spec)
    if callable(spec):
        torch.manual_seed(seed)
        model: object = spec()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model factory returned {type(model).__name__}, not a torch.nn.Module")
        return model
    raise TypeError(f"model must be a torch.nn.Module or a factory returning one, got {type(spec).__name__}")


def rule_for(config: TrainConfig, steps_per_epoch: int, world: int = 2, capped: bool | None = None) -> ThresholdRule:
    """The threshold rule each of ``world`` workers starts from (deep-copied per worker); `capped`: whether
    the fit runs a step cap, which takes the run-long decay's lower lr's place (None: from the config)."""
    algo = config.compression.threshold_algorithm
    run_steps = config.epochs * steps_per_epoch  # what a run-long density decay spans
    if is_calibrated(algo):
        return algo.for_run(run_steps)
    if config.auto:
        given = config.compression
        steps = round(given.warmup_epochs * steps_per_epoch)
        if given.warmup is None and steps > 0:  # a warm-up the user gave is taken as given
            steps = max(steps, DEFAULT_WARMUP_MIN_STEPS)
        auto = auto_for(world)
        decay_from, lr_power = auto.decay_from, auto.decay_lr_power
        if given.decay_from is not None:  # the user's, with the default lr power wherever it is on
            decay_from, lr_power = given.decay_from, DEFAULT_DECAY_LR_POWER if given.decay_from else 0.0
        if capped if capped is not None else cap_share(config, world) is not None:
            lr_power = 0.0  # the cap takes the lower lr's place (measured better: encoding/step_cap.py)
        # None: CalibratedThreshold's own defaults
        return CalibratedThreshold(
            density=DEFAULT_DENSITY if given.density is None else given.density,
            warmup_steps=steps,
            warmup_density=auto.warmup_density if given.warmup_density is None else given.warmup_density,
            decay_from=decay_from,
            decay_lr_power=lr_power,
        ).for_run(run_steps)
    tau = float(config.threshold)  # not "auto" here: the number TrainConfig checked
    if isinstance(algo, str):  # TrainConfig checked it: "fixed" or "adaptive"
        return FixedThreshold(tau) if algo == "fixed" else AdaptiveThreshold(initial=tau)
    if not (hasattr(algo, "threshold") and hasattr(algo, "update")):
        raise TypeError("threshold_algorithm object must have .threshold and .update(n_entries, n_params)")
    return copy.deepcopy(algo)


@dataclass(frozen=True)
class StepPlan:
    """How far each step of a fit of `world` workers moves: every default that depends on the worker
    count, resolved once. `fit` and the lock-step harness both take it from `plan_steps`."""

    rule: ThresholdRule  # each worker's τ rule (deep-copied per worker)
    cap_share: float | None  # the step cap's share of each tensor's norm (step_cap.py); None: no cap
    cap_norm: str  # which norm: "now" (as each step starts) or "initial" (policy.py's row)
    momentum_ceiling: float | None  # the most β1 / momentum each worker steps with; None: the optimizer's own
    apply_scale: float  # every replica and the relay apply each message × this
    lr_factor: float  # every worker's lr × this (lr_batch_size's scaling)


def plan_steps(config: TrainConfig, world: int, steps_per_epoch: int) -> StepPlan:
    """The step rule of a fit of `world` workers whose longest shard takes `steps_per_epoch` steps: the
    options as given, "auto" from the table of policy.py."""
    option = config.compression.optimizer_momentum
    momentum = auto_for(world).momentum if option == "auto" else momentum_ceiling(option)
    share = cap_share(config, world)
    return StepPlan(
        rule=rule_for(config, steps_per_epoch, world, share is not None),
        cap_share=share,
        cap_norm=auto_for(world).step_cap_norm,
        momentum_ceiling=momentum,
        apply_scale=1.0 / world if config.compression.aggregate == "mean" else 1.0,
        lr_factor=config.lr_factor,
    )


def cap_share(config: TrainConfig, world: int) -> float | None:
    """The step cap a fit of `world` workers runs with (None: none)."""
    given = config.compression.step_cap
    return auto_for(world).step_cap if given == "auto" else step_cap_for(given)


def check_optimizer(
    factory: OptimizerFactory,
    lr_scheduler: SchedulerFactory | None,
    model: nn.Module,
    momentum: OptimizerMomentum = "auto",
) -> None:
    """Build the optimizer and the scheduler once on the driver: a bad factory (or an optimizer_momentum
    of "off" for an optimizer that has none) fails here, before any Spark job, not on every executor after
    the data is loaded."""
    sparse = [name for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(
            f"module {sparse[0]!r} is an embedding with sparse=True: gradshare needs dense gradients "
            "(its updates are sparse on the wire already); build it with sparse=False and use a "
            "dense optimizer such as Adam or AdamW"
        )
    trainable = [p for p in copy.deepcopy(model).parameters() if p.requires_grad]
    if not trainable:  # FlatParams names it: nothing to train or share
        return
    optimizer = factory(trainable)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(
            "optimizer: SparseAdam needs sparse gradients, and gradshare trains with dense ones (its "
            "updates are sparse on the wire already); use Adam or AdamW"
        )
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"optimizer: {type(optimizer).__name__}.step needs a closure (it re-evaluates the loss), "
            "which a step of gradshare cannot give it; use an optimizer whose step takes none, such "
            "as Adam, AdamW or SGD"
        )
    check_optimizer_momentum(momentum, optimizer)
    if lr_scheduler is not None:
        check_scheduler(lr_scheduler, optimizer)


def check_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> None:
    """The scheduler `factory` builds for `optimizer`: one of steps or epochs, bound to that optimizer."""
    scheduler = factory(optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "lr_scheduler: ReduceLROnPlateau is not supported: it steps on a metric, and "
            "each worker would see its own; use a schedule of steps or epochs"
        )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"lr_scheduler must return a torch.optim.lr_scheduler.LRScheduler for the optimizer "
            f"it is given, got {type(scheduler).__name__}"
        )
    if scheduler.optimizer is not optimizer:
        raise ValueError(
            "lr_scheduler returned a scheduler bound to another optimizer; it must schedule "
            "the optimizer it is given (e.g. lambda opt: StepLR(opt, 100))"
        )


def drop_rule(config: TrainConfig, model: nn.Module) -> str:
    """drop_last as the worker's rule ("never" | "single" | "partial", worker.steps_per_epoch)."""
    if config.runtime.drop_last == "auto":
        return "single" if any(isinstance(m, _BatchNorm) for m in model.modules()) else "never"
    return "partial" if config.runtime.drop_last else "never"


def clipping(config: TrainConfig) -> ResidualClipping | None:
    if config.compression.residual_clip is None:
        return None
    return ResidualClipping(clip=float(config.compression.residual_clip))


def forwarding_for(forwarding: str, world_size: int, checkpointed: bool = False) -> str:
    """The forwarding mode a fit of ``world_size`` workers runs: "auto" from the table of policy.py, and
    per-rank for a checkpointed fit (a checkpoint does not hold the relay's aggregation residual)."""
    if forwarding == "auto":
        return "per-rank" if checkpointed else auto_for(world_size).forwarding
    return forwarding
