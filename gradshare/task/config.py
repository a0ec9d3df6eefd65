"""What a Spark barrier task is given: `WorkerConfig`, shipped inside the job closure, and the step
counts it implies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from gradshare.config.options import Compression, FaultTolerance, Network, Runtime
from gradshare.encoding.step_cap import StepCap
from gradshare.task.relay_host import HostedRelay


class TrainStep(Protocol):
    """What a batch is and the loss of it (losses.LossStep, losses.HookStep)."""

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, ...], metric: Callable[..., Any] | None) -> Any: ...


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a task needs, shipped inside the Spark job closure (the job key never goes over UDP).

    Its own fields, copied by `SharedTrainer.fit` rather than holding the TrainConfig: most options
    reach the task transformed (the threshold rule object, ResidualClipping, the drop_last rule, the
    loss plan, the validation arrays, the epochs left after a resume), and the TrainConfig holds what
    must not travel (a validation DataFrame cannot be pickled; the MLflow settings are the driver's).
    Defaults that mean the same as an option's are TrainConfig's.
    """

    relay_address: tuple[str, int]
    key: bytes
    job_id: int
    world_size: int
    model: Any  # an nn.Module whose parameters are the initial ones (every replica starts from them)
    loss: Callable[..., Any] | None  # (outputs, labels) -> loss; None when train_step is a user's hook
    optimizer: Callable[..., torch.optim.Optimizer]  # factory: params -> torch.optim.Optimizer
    threshold_rule: Any  # FixedThreshold / AdaptiveThreshold / ... (deep-copied per worker)
    residual_clip: Any  # ResidualClipping or None
    steps_per_epoch: tuple[int, ...]  # per rank
    epochs: int
    batch_size: int
    staleness: int
    seed: int
    label_dtype: str
    datagram_size: int = Network.datagram_size
    timeout: float = FaultTolerance.timeout
    insecure: bool = Network.insecure
    spill_bytes: int = Network.spill_bytes
    validation: tuple[tuple[np.ndarray, ...], np.ndarray] | None = None  # (inputs, labels): batches.validation_arrays
    metric: Callable[..., Any] | None = None  # (outputs, labels) -> float; rank 0 evaluates it after each epoch
    lookahead: bool = Compression.lookahead  # k >= 1: step at P + own not-yet-applied messages (worker.py)
    lr_scheduler: Callable[..., Any] | None = None  # factory: optimizer -> torch LR scheduler (same on every rank)
    scheduler_interval: str = Runtime.scheduler_interval  # "step": scheduler.step() every step; "epoch": each epoch
    lr_factor: float = 1.0  # every step's lr × this (TrainConfig.lr_factor: lr_batch_size's scaling)
    # each step's β1 / momentum at most this (replica/momentum.py); None: as given
    momentum_ceiling: float | None = None
    follow_lr: bool = Compression.follow_lr  # the residual and a non-calibrated τ follow the lr (encoding/sharing.py)
    apply_scale: float = 1.0  # every replica and the relay apply each message × this (aggregate="mean": 1/N)
    step_cap: StepCap | None = None  # each tensor's share of a step capped (encoding/step_cap.py); None: none
    drop_last: str = "never"  # "never" | "single" (a final batch of 1 row) | "partial" (any short final batch)
    precision: str = Runtime.precision  # "32" | "bf16-mixed" | "fp16-mixed": the forward's autocast (precision.py)
    # "cpu" | "cuda" | "cuda:N" | "auto", resolved in the task (gradshare/replica/device.py)
    device: Any = Runtime.device
    user_objects: bytes | None = None  # the user fields, cloudpickled by fit (shipping.py); None: not packed
    # worker_options (config.WORKER_OPTIONS: each key is the field of that name)
    profile: bool = False  # per-phase step timers in the report (profiling.py)
    direct_update: bool = True  # the optimizer may write its update into the residual (capture.py)
    tensor_state: bool = False  # the torch state / residual / codec path on the CPU (tests, benchmarks)
    step_in_backward: bool | None = None  # step each parameter as its gradient is ready; None: where it pays
    folded_view: bool = True  # the local view folded into one buffer where it applies (local_view.py); False: A/B
    train_step: TrainStep | None = None  # losses.LossStep / HookStep; None: LossStep(loss)
    n_state: int = 0  # parameters + float buffers (FlatParams.n_state): the peer exists before the model (0: unknown)
    early_stopping: Any = None  # stopping.EarlyStopping or None: rank 0 decides, the log carries it (stopping.py)
    # callables (row) -> truthy to stop; run on rank 0 after its epoch is scored
    on_epoch_end: tuple[Callable[..., Any], ...] | None = ()
    checkpoint: Any = None  # checkpoint.CheckpointPlan or None: write state every plan.every epochs
    resume: dict[str, Any] | None = None  # checkpoint.read_manifest's dict: start each rank from its saved state
    first_epoch: int = 0  # epochs done before this fit (a resumed one): data order and τ's step count go on
    shards: bool = False  # validation rows come zipped with the training rows; every rank scores (validation.py)
    local_view: bool = Compression.local_view  # forward/backward at P + own residual (local_view.py); False: at P
    # relay="in-job": rank 0 hosts the relay (relay_host.py) and tells the other ranks its address
    hosted: HostedRelay | None = None
    rows: tuple[int, ...] = ()  # per rank: the driver's pre-pass count, which a task's must equal (fit sets it)

    def total_steps(self, rank: int) -> int:
        return self.steps_per_epoch[rank] * self.epochs

    @property
    def final_step(self) -> int:
        """The last step any rank takes: the log is complete when it is applied through this."""
        return max(self.total_steps(r) for r in range(self.world_size)) - 1


DROP_LAST = ("never", "single", "partial")


def steps_per_epoch(rows: int, batch_size: int, drop_last: str) -> int:
    """Batches an epoch of `rows` rows takes: the final short batch is dropped per `drop_last`."""
    full, rest = divmod(rows, batch_size)
    if rest == 0 or drop_last == "partial" or (drop_last == "single" and rest == 1):
        return full
    return full + 1
