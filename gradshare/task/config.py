"""What a Spark barrier task is given: `WorkerConfig`, shipped inside the job closure, and the step
counts it implies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from gradshare.config.options import Compression, FaultTolerance, Network, Runtime, ThresholdRule, WorkerOption
from gradshare.encoding.step_cap import StepCap
from gradshare.encoding.threshold import ResidualClipping
from gradshare.stopping import EarlyStopping
from gradshare.task.relay_host import HostedRelay


class TrainStep(Protocol):
    """What a batch is and the loss of it (losses.LossStep, losses.HookStep)."""

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, ...], metric: Callable[..., Any] | None) -> Any: ...


@dataclass(frozen=True)
class JobIdentity:
    """Which job a task is in and where its relay is (the job key never goes over UDP)."""

    relay_address: tuple[str, int]
    key: bytes
    job_id: int
    world_size: int
    # relay="in-job": rank 0 hosts the relay (relay_host.py) and tells the other ranks its address
    hosted: HostedRelay | None = None


@dataclass(frozen=True)
class UserCode:
    """The user's objects: classes and closures the executors must import or rebuild, cloudpickled together
    by fit (shipping.py)."""

    model: nn.Module  # its parameters are the initial ones (every replica starts from them)
    optimizer: Callable[..., torch.optim.Optimizer]  # factory: params -> torch.optim.Optimizer
    loss: Callable[..., Any] | None = None  # (outputs, labels) -> loss; None when train_step is a user's hook
    train_step: TrainStep | None = None  # losses.LossStep / HookStep; None: LossStep(loss)
    lr_scheduler: Callable[..., Any] | None = None  # factory: optimizer -> torch LR scheduler (same on every rank)
    metric: Callable[..., Any] | None = None  # (outputs, labels) -> float; rank 0 evaluates it after each epoch
    on_epoch_end: tuple[Callable[..., Any], ...] = ()  # (row) -> truthy to stop; rank 0, after its epoch is scored


@dataclass(frozen=True)
class StepRule:
    """What the planner made of the options for every step (driver/plan.py)."""

    threshold_rule: ThresholdRule  # FixedThreshold / AdaptiveThreshold / ... (deep-copied per worker)
    residual_clip: ResidualClipping | None = None
    lr_factor: float = 1.0  # every step's lr × this (TrainConfig.lr_factor: lr_batch_size's scaling)
    momentum_ceiling: float | None = None  # each step's β1 / momentum at most this (replica/momentum.py)
    apply_scale: float = 1.0  # every replica and the relay apply each message × this (aggregate="mean": 1/N)
    step_cap: StepCap | None = None  # each tensor's share of a step capped (encoding/step_cap.py)


@dataclass(frozen=True)
class DataPlan:
    """A rank's rows and steps: what the driver's pre-pass counted and the batches it makes of them."""

    steps_per_epoch: tuple[int, ...]  # per rank
    epochs: int
    batch_size: int
    seed: int
    label_dtype: str
    rows: tuple[int, ...] = ()  # per rank: the driver's pre-pass count, which a task's must equal
    drop_last: str = "never"  # "never" | "single" (a final batch of 1 row) | "partial" (any short final batch)
    validation: tuple[tuple[np.ndarray, ...], np.ndarray] | None = None  # (inputs, labels): validation_arrays
    shards: bool = False  # validation rows come zipped with the training rows; every rank scores (validation.py)
    first_epoch: int = 0  # epochs done before this fit (a resumed one): data order and τ's step count go on


@dataclass(frozen=True)
class CheckpointPlan:
    """What the workers need to write checkpoints."""

    root: str  # a local directory or a Hadoop-FS URI
    every: int  # epochs between checkpoints (the fit's last epoch always writes one)
    job: dict[str, Any]  # `driver.checkpoint.job_of`: compared on resume
    service: tuple[str, int] | None = None  # the driver's checkpoint service (host, port) when root is not local


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a task needs, shipped inside the Spark job closure: the job it is in, the user's code,
    the step rule, its data plan, and the option groups as the trainer holds them (Runtime without what
    is the driver's: its callbacks travel in `user`, its MLflow settings not at all). `fit.worker_config`
    builds it, and the lock-step harness through the same records."""

    job: JobIdentity
    user: UserCode | None  # None once packed into user_objects (shipping.py)
    rule: StepRule
    data: DataPlan
    compression: Compression = field(default_factory=Compression)
    network: Network = field(default_factory=Network)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    runtime: Runtime = field(default_factory=Runtime)
    early_stopping: EarlyStopping | None = None  # rank 0 decides, the log carries it (stopping.py)
    checkpoint: CheckpointPlan | None = None  # write state every plan.every epochs
    resume: dict[str, Any] | None = None  # checkpoint.read_manifest's dict: start each rank from its saved state
    n_state: int = 0  # parameters + float buffers (FlatParams.n_state): the peer exists before the model
    frozen_digest: str | None = None  # the driver's frozen parameters' digest (flat.frozen_digest); None: none
    user_objects: bytes | None = None  # `user`, cloudpickled by fit (shipping.py); None: not packed

    @property
    def code(self) -> UserCode:
        """The user's objects (unpacked: a task calls shipping.unpack_user_objects first)."""
        if self.user is None:
            raise ValueError("WorkerConfig: the user's objects are still packed (shipping.unpack_user_objects)")
        return self.user

    def flag(self, name: WorkerOption) -> bool | None:
        """worker_options[name] (Runtime), or its default."""
        return self.runtime.worker_flags.get(name, WORKER_FLAG_DEFAULTS[name])

    def total_steps(self, rank: int) -> int:
        return self.data.steps_per_epoch[rank] * self.data.epochs

    @property
    def final_step(self) -> int:
        """The last step any rank takes: the log is complete when it is applied through this."""
        return max(self.total_steps(r) for r in range(self.job.world_size)) - 1


# worker_options' defaults: profile off, the direct update path and the folded view where they apply, the
# CPU's NumPy codec, the step in backward where it pays (None)
WORKER_FLAG_DEFAULTS: dict[str, bool | None] = {
    "profile": False,
    "direct_update": True,
    "tensor_state": False,
    "step_in_backward": None,
    "folded_view": True,
}


def shipped_runtime(runtime: Runtime) -> Runtime:
    """The Runtime group as a task gets it: without the epoch callbacks (the user's code: they travel in
    `UserCode`) and the MLflow settings (the driver's)."""
    return replace(runtime, on_epoch_end=None, mlflow=None)


DROP_LAST = ("never", "single", "partial")


def steps_per_epoch(rows: int, batch_size: int, drop_last: str) -> int:
    """Batches an epoch of `rows` rows takes: the final short batch is dropped per `drop_last`."""
    full, rest = divmod(rows, batch_size)
    if rest == 0 or drop_last == "partial" or (drop_last == "single" and rest == 1):
        return full
    return full + 1
