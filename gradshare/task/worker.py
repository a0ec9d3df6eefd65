"""What runs inside one Spark barrier task: a model replica, its residual, the step loop, the apply log.

One step t on rank w (docs/design.md, "One training step"):

    batch → forward/backward → optimizer.step() on the flat buffer P
    u = P_after − P_before ; P = P_before          # DL4J's "post-updater" update
    m = encode(residual, u, τ)                     # r += u; entries with |r_i| ≥ τ leave r as ±τ
      (direct path, capture.py: when the optimizer's update does not depend on P (SGD, Adam, ... without
       weight decay) optimizer.step() runs with the parameters aliased to the residual, so it adds u to
       r itself and P is never moved. General path: one fused pass; P_before is a twin copy of P that
       the apply log keeps equal to it, and the pass also writes P_before back over the live buffer,
       so no copy of P and no u vector per step)
    send m as (t, w)
    P changes only by applying decoded messages of the log, in (step, sender) order, own included

Staleness k: before step t the log is applied through step t-1-k, and never further, so the trajectory
of every replica is a function of the data and the seed alone (k = 0 is synchronous).

Own-update lookahead (k ≥ 1, `WorkerConfig.lookahead`): with stale parameters the step's gradient is taken
at P, which lacks every worker's last k messages, so a worker keeps pushing in directions already-sent
updates have covered (with Adam at lr 1e-3, k = 1 falls from ~89 % to ~19 % on the benchmark MLP after
4 epochs; docs/guide/convergence.md, "Staleness"). Its OWN missing messages are known locally, so the forward/backward and
optimizer step run at P + (own sent messages the log has not applied yet), and u is measured from that
point; afterwards P is restored bit for bit (exact for one worker, partial for several). P
itself still changes only by applying the log, so replicas stay bit-identical (the lookahead is a local
evaluation point, like the residual is local state). The residual and
the optimizer state (e.g. Adam moments) stay local to the worker, as in DL4J; a resumed attempt starts
them from zero — that is what a restart loses — unless there is a checkpoint (gradshare/task/checkpoint.py),
which holds them: a fit resumed from one, or a retried stage, which the relay restarts at the last one.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import json
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import numpy as np
import torch
from pyspark import BarrierTaskContext, SparkFiles
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import gradshare
from gradshare.replica.capture import DirectPath, frees_enough, needs_all_gradients, update_path, writes_update_only
from gradshare.task.checkpoint import load_rank, manifest_for, worker_store, write_manifest, write_rank
from gradshare.config import TrainConfig
from gradshare.replica.device import resolve_device, select
from gradshare.encoding import SharingState, StepUpdate, apply, apply_update, buffer_change, decode_update, skipped_step
from gradshare.errors import GradshareError, ProtocolError, TrainingError
from gradshare.replica.flat import FlatParams, int_buffers
from gradshare.replica.local_view import FoldedView, LocalView, NoView
from gradshare.replica.losses import LossStep
from gradshare.replica.precision import Precision
from gradshare.task.profiling import OFF as OFF_PROFILE
from gradshare.task.profiling import StepProfile, _Off
from gradshare.reports import Counters, EpochStats, Progress, WorkerFailure, WorkerReport
from gradshare.task.shipping import materialize, unpack_user_objects
from gradshare.task.partition import PartitionData, epoch_order
from gradshare.task.spill import SpilledPartition
from gradshare.stopping import should_stop, stop_epoch
from gradshare.transport import Peer, param_hash
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN, Update
from gradshare.task.validation import SCORE_BATCH_ROWS, as_mean, reduce_sums, shard_sums, split_rows
from gradshare.vectors import Vector, copy_into, copy_of, index_for, where


class TrainStep(Protocol):
    """What a batch is and the loss of it (losses.LossStep, losses.HookStep)."""

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, ...], metric: Callable[..., Any] | None) -> Any: ...


# a lookahead's undo record (Worker._look_ahead): indices, P there before and after, the folded point's too
LookBack = tuple[Vector, Vector, Vector, Vector | None, Vector | None]


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
    datagram_size: int = TrainConfig.datagram_size
    timeout: float = TrainConfig.timeout
    insecure: bool = TrainConfig.insecure
    spill_bytes: int = TrainConfig.spill_bytes
    validation: tuple[tuple[np.ndarray, ...], np.ndarray] | None = None  # (inputs, labels): batches.validation_arrays
    metric: Callable[..., Any] | None = None  # (outputs, labels) -> float; rank 0 evaluates it after each epoch
    lookahead: bool = TrainConfig.lookahead  # k >= 1: step at P + own not-yet-applied messages (module docstring)
    lr_scheduler: Callable[..., Any] | None = None  # factory: optimizer -> torch LR scheduler (same on every rank)
    scheduler_interval: str = TrainConfig.scheduler_interval  # "step": scheduler.step() every step; "epoch": each epoch
    follow_lr: bool = TrainConfig.follow_lr  # the residual and a non-calibrated τ follow the lr (encoding/sharing.py)
    apply_scale: float = 1.0  # every replica and the relay apply each message × this (aggregate="mean": 1/N)
    drop_last: str = "never"  # "never" | "single" (a final batch of 1 row) | "partial" (any short final batch)
    precision: str = TrainConfig.precision  # "32" | "bf16-mixed" | "fp16-mixed": the forward's autocast (precision.py)
    device: Any = TrainConfig.device  # "cpu" | "cuda" | "cuda:N" | "auto", resolved in the task (gradshare/replica/device.py)
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
    local_view: bool = TrainConfig.local_view  # forward/backward at P + own residual (local_view.py); False: at P

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


def non_finite_cause(batch: tuple[torch.Tensor, ...], loss: torch.Tensor) -> str:
    """The likely cause of a step's non-finite update, for its error: the batch, the loss, or the step."""
    for i, x in enumerate(batch):
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            rows = torch.nonzero(~torch.isfinite(x).reshape(len(x), -1).all(dim=1)).flatten()[:5].tolist()
            what = "the labels" if i == len(batch) - 1 else f"input {i}"
            return f"{what} of the batch hold NaN or inf (batch rows {rows}): clean the data"
    value = float(loss.detach())
    if not math.isfinite(value):
        return (f"the loss is {value} on finite inputs: the model diverged or the loss overflowed; lower the "
                "learning rate or clip gradients (gradshare.replica.losses.clip_grad_norm)")
    return (f"the loss is finite ({value:.4g}) but the optimizer's update is not: a gradient overflowed or the "
            "learning rate is too high; lower it or clip gradients (gradshare.replica.losses.clip_grad_norm)")


class ApplyLog:
    """Applies delivered messages to the replica in canonical (step, sender) order, never past a bound.

    `peer.receive` may hand over messages beyond the step we need; they wait in `pending` (bounded by
    the staleness window times the world size) until their turn, so applying is deterministic.
    """

    def __init__(self, peer: Peer, flat: FlatParams, start_step: int, timeout: float,
                 profile: StepProfile | _Off | None = None, scale: float = 1.0) -> None:
        self._decode, self._apply_update, self._apply = decode_update, apply_update, apply
        self.peer, self.flat, self.timeout = peer, flat, timeout  # flat.state: the live parameters + buffers
        self.scale = scale  # the same on every replica and the relay, so the replicas stay bit-identical
        self.applied_through = start_step - 1  # the snapshot (or the initial params) covers the rest
        self.start_step = start_step
        self.pending: deque[Update] = deque()
        self.applied = 0
        self.last_key = (-1, -1)
        self.profile = OFF_PROFILE if profile is None else profile
        self.stop_epoch: int | None = None  # rank 0's early-stop decision, once the log has applied it

    def _take(self, updates: Iterable[Update]) -> None:
        for u in updates:
            key = (u.step, u.sender)
            if key <= self.last_key:  # the transport promises canonical order, each exactly once
                raise ProtocolError(f"update {key} delivered after {self.last_key}: not canonical order")
            self.last_key = key
            if u.step >= self.start_step:  # older ones are inside the snapshot we resumed from
                self.pending.append(u)
            else:
                # older than a resumed attempt's start: inside its snapshot. (The relay starts a new
                # attempt's log at its start; a stop decided before it comes in WELCOME's notes.)
                self._note_stop(u)

    def _note_stop(self, u: Update) -> None:
        """Rank 0's early-stop decision (stopping.py), taken in log order: the same step on every rank."""
        # aggregated forwarding: the relay's aggregate carries rank 0's decision (relay_core._aggregate)
        if u.sender in (0, AGGREGATE_ORIGIN) and u.meta and "stop_epoch" in u.meta and self.stop_epoch is None:
            self.stop_epoch = int(u.meta["stop_epoch"])

    def apply_through(self, step: int) -> None:
        if step <= self.applied_through:
            return
        # Always ask: messages of `step` may already be pending from some senders but not from all.
        self._take(self.peer.receive(until_step=step, timeout=self.timeout))
        self.profile.lap("wait")
        flat, twin, point = self.flat, self.flat.twin, self.flat.point
        while self.pending and self.pending[0].step <= step:
            u = self.pending.popleft()
            self._note_stop(u)
            update = self._decode(u.payload, flat.n_state, n_params=flat.n_params)
            self._apply_update(update, flat.state, self.scale)
            if twin is not None:  # the worker's copy of P (FlatParams.keep_twin) follows the log too
                self._apply(update.message, twin, self.scale)
            if point is not None:  # and P + s·r of the folded view (FlatParams.keep_point): r stays
                self._apply(update.message, point, self.scale)
            self.applied += 1
        self.applied_through = step
        self.profile.lap("apply")


def current_lr(optimizer: torch.optim.Optimizer) -> float | None:
    """The learning rate of the optimizer's first parameter group (None if it has none): the rate the
    sharing state follows (a scheduler scales every group alike)."""
    lr = optimizer.param_groups[0].get("lr")
    if lr is None:
        return None
    return float(lr.item() if hasattr(lr, "item") else lr)  # a tensor lr (capturable Adam) too


class Worker:
    """One replica. `run(peer)` trains this rank's steps and returns its report for the driver."""

    def __init__(self, cfg: WorkerConfig, rank: int, data: PartitionData | SpilledPartition,
                 model: nn.Module | None = None) -> None:
        """`model`: a module this worker owns and trains in place (the Spark task's, built from the
        shipped skeleton); None trains a deep copy of ``cfg.model`` (drivers that step workers
        themselves)."""
        self.cfg, self.rank, self.data = cfg, rank, data
        self.device = select(resolve_device(cfg.device))  # auto: the GPU Spark gave this task, if any
        torch.manual_seed(cfg.seed * 1_000_003 + rank)  # dropout etc.: seeded per rank
        self.model = (copy.deepcopy(cfg.model) if model is None else model).to(self.device)
        # A GPU keeps the state, residual and twin as torch tensors there; on the CPU they are NumPy arrays
        # for the Numba kernels, unless a test or benchmark asks for the torch path there ("tensor_state").
        on_tensors = self.device.type != "cpu" or cfg.tensor_state
        self.flat = FlatParams(self.model, device=self.device if on_tensors else None)
        self.optimizer = cfg.optimizer(self.flat.params)
        self.precision = Precision(cfg.precision, self.flat.params[0].device.type)  # its loss scaler: local
        self.scheduler = cfg.lr_scheduler(self.optimizer) if cfg.lr_scheduler is not None else None
        direct = cfg.direct_update and writes_update_only(self.optimizer)
        # The local view folded into one buffer, P + r kept instead of r (local_view.py), where the
        # update goes straight into it (the direct path) and messages apply at scale 1 (aggregate="sum");
        # the two-buffer view elsewhere, or with worker_options={"folded_view": False} (an A/B)
        folded = (cfg.local_view and direct and cfg.apply_scale == 1.0 and cfg.folded_view)
        point = self.flat.keep_point() if folded else None
        fold = (self.flat.array, point, cfg.apply_scale) if point is not None else None
        # residual, threshold rule, clipping, lr correction and own pending messages (encoding/sharing.py)
        self.state = SharingState(self.flat.n_params, copy.deepcopy(cfg.threshold_rule), cfg.residual_clip,
                                  follow_lr=cfg.follow_lr, keep_pending=cfg.lookahead and cfg.staleness > 0,
                                  device=self.flat.device, fold=fold)
        # The optimizer writes its update straight into the residual where it can; otherwise the step
        # measures it against a twin of P that the apply log keeps (capture.py).
        # and on that direct path it steps each parameter as its gradient is ready, so that gradients do
        # not all live at once, unless something needs them all (capture.py, needs_all_gradients); by
        # default only where that frees enough memory to pay for the per-parameter steps
        wanted = cfg.step_in_backward
        in_backward = ((frees_enough(self.flat) if wanted is None else wanted)
                       and needs_all_gradients(self.optimizer, self.precision) is None)
        self.path = update_path(self.flat, self.optimizer, self.state.target,
                                allow_direct=cfg.direct_update, in_backward=in_backward, folded=folded)
        # the gradient is taken at P + this worker's unsent residual (local_view.py)
        self.view: FoldedView | LocalView | NoView
        if point is not None and isinstance(self.path, DirectPath):  # folded (update_path: the direct path)
            self.view = FoldedView(self.flat, point, self.path.stepped)
        else:
            self.view = LocalView(self.flat, cfg.apply_scale) if cfg.local_view else NoView()
        self.log: ApplyLog | None = None  # set by run(), or by a driver that steps the worker itself
        self.stopper = copy.deepcopy(cfg.early_stopping)  # rank 0's rule state (best, epochs waited)
        self.stop_requested: int | None = None  # rank 0: the epoch whose end asked for a stop
        self.stop_sent = False
        self.inherited_stop: int | None = None  # a stop the log decided before this attempt (`inherit`)
        self.restored = False  # state loaded from a checkpoint: the schedule and counters are where it left them
        self.epoch_notes: dict[str, float] = {}  # rank 0: its epoch end (score, rule state) for its next message's meta
        self.checkpoint_seconds = 0.0  # spent writing checkpoints (checkpoint.py)
        self.current_step: int | None = None  # the step `run` is in (a failure report names it)
        self.shard = None  # this rank's validation rows (cfg.shards; None: none or an empty shard)
        self.gather: Callable[[str], list[str]] | None = None  # the barrier's allGather: reduces shard scores
        self.checkpoint_store = None  # where they go: the directory, or the driver's service (checkpoint.py)
        self._order_epoch = -1
        self._trim_due = False  # release_free_memory before the next backward (after a large message)
        self.profile = StepProfile() if cfg.profile else OFF_PROFILE  # benchmarks: per-phase timers
        # losses.py: what a batch is, the loss of it
        if cfg.train_step is not None:
            self.train_step: TrainStep = cfg.train_step
        elif cfg.loss is not None:
            self.train_step = LossStep(cfg.loss)
        else:
            raise ValueError("WorkerConfig needs a loss or a train_step")
        self.labels: torch.Tensor | None
        if isinstance(data, SpilledPartition):  # its labels stay in the spill file; each batch reads its own (spill.py)
            self.labels = None
        elif len(data.labels) and cfg.label_dtype == "int64":
            self.labels = torch.from_numpy(np.ascontiguousarray(data.labels, dtype=np.int64))
        else:
            self.labels = torch.from_numpy(np.ascontiguousarray(data.labels, dtype=np.float32))

    def _batch(self, epoch: int, b: int) -> tuple[torch.Tensor, ...]:
        data, all_labels = self.data, self.labels
        if all_labels is None or isinstance(data, SpilledPartition):  # spilled (no labels then): read in bounded
            # shuffle windows, in their own order (spill.py)
            spilled = cast(SpilledPartition, data)
            *inputs, labels = spilled.batch(epoch, b, self.cfg.batch_size, self.cfg.seed, self.rank)
            labels = labels.astype(np.int64 if self.cfg.label_dtype == "int64" else np.float32, copy=False)
            return tuple(torch.from_numpy(a).to(self.device) for a in (*inputs, labels))
        if b == 0 or self._order_epoch != epoch:
            self._order = epoch_order(len(data), self.cfg.seed, self.rank, epoch)
            self._order_epoch = epoch
        idx = np.sort(self._order[b * self.cfg.batch_size : (b + 1) * self.cfg.batch_size])
        # every input keeps its dtype (int64 token ids stay exact; batches.py)
        tensors = (torch.from_numpy(np.ascontiguousarray(a[idx])).to(self.device) for a in data.inputs)
        return (*tensors, all_labels[torch.from_numpy(idx)].to(self.device))

    def _loss_of(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The step's loss tensor for a batch (x1, ..., xn, labels): the user's train_step or
        loss(model(*inputs), labels) (losses.py)."""
        return self.train_step(self.model, batch)

    def _log(self) -> ApplyLog:
        """The apply log that `run` (or a driver stepping this worker itself) set."""
        if self.log is None:
            raise TrainingError(f"rank {self.rank} has no apply log: run() sets it before the first step")
        return self.log

    @property
    def evaluates(self) -> bool:
        return self.cfg.validation is not None and self.rank == 0

    @property
    def closes_epochs(self) -> bool:
        """Rank 0 runs the epoch's end (score, early-stopping rule, callbacks) once the log reaches it."""
        return self.rank == 0 and (self.evaluates or self.stopper is not None or bool(self.cfg.on_epoch_end))

    def _epoch_end(self, row: EpochStats) -> None:
        """Rank 0, after scoring an epoch: the callbacks (each sees a copy of the row) and the rule. Any
        of them may ask for a stop; the next message carries it (stopping.py)."""
        stop = False
        for callback in self.cfg.on_epoch_end or ():
            stop = bool(callback(dict(row))) or stop
        if self.stopper is not None:
            stop = should_stop(self.stopper, row) or stop
            if self.stopper.best is not None:
                self.epoch_notes["es_best"] = self.stopper.best
            self.epoch_notes["es_waited"] = self.stopper.waited
        if row["val_metric"] is not None:  # the relay keeps it for the epoch's row (a retried stage's history)
            self.epoch_notes.update(val_epoch=row["epoch"], val_metric=row["val_metric"])
        if stop and self.stop_requested is None:
            self.stop_requested = row["epoch"]

    def inherit(self, notes: Mapping[str, Any]) -> None:
        """What a retried stage's attempt inherits from the log before it (the relay's WELCOME notes,
        transport/protocol/tallies.py AttemptNotes): rank 0's rule state and stop request, every rank's stop epoch."""
        if "stop_epoch" in notes:
            self.inherited_stop = int(notes["stop_epoch"])
        if self.rank != 0:
            return
        if "stop_requested" in notes:  # sent in a message the log holds: never sent twice
            self.stop_requested, self.stop_sent = int(notes["stop_requested"]), True
        if self.stopper is not None and "es_waited" in notes:
            self.stopper.best = notes.get("es_best")
            self.stopper.waited = int(notes["es_waited"])

    def _score(self, scores: deque[tuple[int, int]], upto: int, history: list[EpochStats]) -> None:
        """Score every epoch (entries (epoch, log step)) whose log step is <= `upto`, each on the log
        applied through its epoch's last step (every worker's messages, buffers included; the last
        epoch: the whole log, the model fit returns). Called before each step with the step's own apply
        bound, so scoring never applies the log further than the step would: validation does not change
        what is trained."""
        log = self._log()
        while scores and scores[0][1] <= upto:
            epoch, through = scores.popleft()
            log.apply_through(through)
            if log.stop_epoch is not None and epoch > log.stop_epoch:
                continue  # shards: an epoch the stop cut; the log decides it alike on every rank
            value = self._evaluate()
            i = next((i for i in range(len(history) - 1, -1, -1) if history[i].epoch == epoch), None)
            if i is None:  # shards, a retried stage: this rank closed the epoch in an earlier attempt
                continue
            history[i] = history[i].scored(value)
            self.profile.score(i, value)
            if self.rank == 0:
                self._epoch_end(history[i])

    def _shard_points(self, start_step: int) -> list[tuple[int, int]]:
        """Shards: every rank scores epoch e on the log through the step where the longest rank ends it
        (the same point, the same allGather calls in the same order on every rank, whatever each rank's
        steps per epoch); only the epochs this attempt reaches."""
        if not self.cfg.shards:
            return []
        ends = (max((e + 1) * spe for spe in self.cfg.steps_per_epoch) - 1 for e in range(self.cfg.epochs))
        return [(e, end) for e, end in enumerate(ends) if end >= start_step]

    def _evaluate(self) -> float | None:
        """Rank 0's validation score of its replica as it is now (None elsewhere); with shards, every
        rank's shard sums reduced over all ranks (validation.py)."""
        if self.cfg.shards:
            if self.gather is None:
                raise TrainingError(f"rank {self.rank} scores a validation shard with no allGather to reduce it")
            sums = shard_sums(self.model, self.train_step, self.shard, self.cfg.metric, self.cfg.label_dtype,
                              max(SCORE_BATCH_ROWS, self.cfg.batch_size), self.device)
            return reduce_sums(self.gather(json.dumps(sums)))
        if not self.evaluates or self.cfg.validation is None:  # (evaluates: validation is not None)
            return None
        inputs, yv = self.cfg.validation
        labels = torch.as_tensor(np.asarray(yv, dtype=self.cfg.label_dtype))
        batch = tuple(torch.as_tensor(a).to(self.device) for a in (*inputs, labels))
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            value = self.train_step.evaluate(self.model, batch, self.cfg.metric)
        self.model.train(was_training)
        return as_mean(value)

    def step(self, peer: Peer, t: int) -> tuple[float, int, int]:
        """Global step ``t`` of this rank: docs/design.md's step (batch → forward/backward → optimizer step into
        the residual → encode → send), then the lr schedule's step when it steps per step. The caller
        applies the log through t − 1 − k first. Returns (loss, entries sent, payload bytes)."""
        out = self._step(peer, t, *divmod(self._global(t), self.cfg.steps_per_epoch[self.rank]))
        if self.scheduler is not None and self.cfg.scheduler_interval == "step":
            self.scheduler.step()
        return out

    def _step(self, peer: Peer, t: int, epoch: int, b: int) -> tuple[float, int, int]:
        prof, flat, state = self.profile, self.flat, self.state
        batch = self._batch(epoch, b)
        prof.lap("batch")
        looked = self._look_ahead()  # None: no own message pending, the step runs at P itself
        versions = flat.versions()
        buffers_before = copy_of(flat.buffer_array) if flat.n_buffers else None
        if self._trim_due:  # before the step's peak (backward): the last step's big transients are garbage
            release_free_memory()
        prof.lap("lookahead")
        lr = current_lr(self.optimizer)  # the schedule steps after the step: one lr for all of it
        state.set_lr(lr)  # rescales the residual if a schedule moved the lr
        restore = self._scale_lr(self._global(t))  # a run-long density decay's smaller steps (threshold.py)
        self.optimizer.zero_grad(set_to_none=True)
        with self.view.around(state.residual):  # the gradient at P + own residual (local_view.py)
            with self.precision.autocast():
                loss = self._loss_of(batch)
            if isinstance(self.path, DirectPath) and self.path.in_backward:  # the optimizer steps inside
                # backward, one parameter at a time (capture.py)
                self.path.backward(lambda: self.precision.backward(loss))
            else:
                self.precision.backward(loss)
        prof.lap("compute")
        changed = self._take_buffer_change(buffers_before)
        self.path.after_compute(flat.versions() != versions)
        prof.lap("snapshot")
        # False: the fp16 loss scaler skipped it
        taken = True if self.path.in_backward else self.path.optimizer_step(self.precision.step)
        for group, group_lr in restore:
            group["lr"] = group_lr
        self.optimizer.zero_grad(set_to_none=True)  # nothing reads them now: free them before the encode
        prof.lap("optimizer")
        try:
            msg = self.path.encode(state, self._global(t)) if taken else skipped_step(state)  # P is P_before again here
        except ValueError as e:
            if "not finite" not in str(e):
                raise
            raise ValueError(f"rank {self.rank}, step {t} (epoch {epoch}, batch {b}): the update is not finite: "
                             f"{non_finite_cause(batch, loss)} ({e})") from e
        if looked is not None:
            self._look_back(*looked)
        payload = StepUpdate(msg, *changed).to_bytes(flat.n_buffers)
        loss_value = float(loss.detach())
        prof.lap("encode")
        # the relay tallies these per (rank, epoch) as it applies the log: a retried stage's history
        # then still has the steps of the attempts before it
        # (a skipped fp16 step's empty message carries a placeholder τ, not one that was used: no τ)
        meta = Progress(loss_value, msg.n_entries / flat.n_params, float(len(payload)),
                        float(epoch - self.cfg.first_epoch), msg.threshold if taken else None, lr).to_meta()
        if self.epoch_notes:  # rank 0's last epoch end: the relay keeps it for a retried stage
            meta.update(self.epoch_notes)
            self.epoch_notes = {}
        if self.stop_requested is not None and not self.stop_sent:
            self.stop_sent = True  # one decision; a stop that comes too late to shorten any rank sends none
            cfg = self.cfg
            stop = stop_epoch(t, cfg.staleness, cfg.steps_per_epoch, cfg.epochs)
            meta["stop_requested"] = float(self.stop_requested)
            if stop is not None:
                meta["stop_epoch"] = float(stop)
        peer.send_update(t, payload, meta)
        # a message this large (density ~1e-2 and up: a warm-up, Adam's first steps) left its codes and
        # payloads freed but held, and the others' messages of the step will be as large
        self._trim_due = len(payload) >= TRIM_PAYLOAD_BYTES
        prof.lap("send")
        return loss_value, msg.n_entries, len(payload)

    def _scale_lr(self, step: int) -> list[tuple[dict[str, Any], Any]]:
        """Multiply every parameter group's lr by the threshold rule's `lr_factor` for this step's
        optimizer step (not a change of rate: the residual is not rescaled, a scheduler does not see it);
        returns what to put back."""
        factor_of = getattr(self.state.rule, "lr_factor", None)
        factor = 1.0 if factor_of is None else float(factor_of(step, self.flat.n_params))
        if factor == 1.0:
            return []
        saved = [(group, group["lr"]) for group in self.optimizer.param_groups]
        for group, group_lr in saved:
            group["lr"] = group_lr * factor
        return saved

    def _global(self, t: int) -> int:
        """Step t of this fit's log as a step of the whole training (a resumed fit's log starts at 0):
        what the data order and a calibrated τ's warm-up count in, so they go on where they stopped."""
        return t + self.cfg.first_epoch * self.cfg.steps_per_epoch[self.rank]

    def _take_buffer_change(self, before: Vector | None) -> tuple[np.ndarray, ...]:
        """The step's forward moved the float buffers (BatchNorm running statistics) of this replica:
        take that change out of them (it reaches every replica, this one included, through the log,
        encoding/update.py) and return it as (indices, values ÷ world size)."""
        if before is None:
            return ()
        flat = self.flat
        flat.check_buffers()
        # `before` is a copy of the buffers: the same kind (mypy cannot tie the two to one SameVector)
        changed = buffer_change(before, flat.buffer_array, self.cfg.world_size,  # type: ignore[type-var]
                                flat.buffer_entry_name)
        copy_into(flat.buffer_array, before)
        return changed

    def _look_ahead(self) -> LookBack | None:
        """Add this rank's sent-but-not-yet-applied messages to P (both copies, the live one and the
        twin the update is measured from) and return what `_look_back` needs to take them out again:
        (indices they touch, P there before, P there after), on P's device. None (and nothing done) when
        no own message is pending: the step runs at P as with k = 0.

        Only the touched values are saved (a few per thousand parameters), not all of P: subtracting
        the ±τ again would not restore P bit for bit in float32, putting the saved values back does."""
        pending = self.state.pending
        self.state.forget_applied(self.log.applied_through if self.log is not None else -1)
        if not pending:
            return None
        live, twin, point = self.flat.array, self.flat.twin, self.flat.point
        idx = index_for(live, np.concatenate([i for _, _, i in pending]))
        saved = live[idx]
        saved_point = None if point is None else point[idx]
        for _, msg, _ in pending:  # in step order, the order the log will apply them
            apply(msg, live, self.cfg.apply_scale)
            for follower in (twin, point):  # the folded point: P + pending + s·r, the local view's point
                if follower is not None:
                    apply(msg, follower, self.cfg.apply_scale)
        return idx, saved, live[idx], saved_point, None if point is None else point[idx]

    def _look_back(self, idx: Vector, saved: Vector, ahead: Vector, saved_point: Vector | None = None,
                   point_ahead: Vector | None = None) -> None:
        """After the step's encode (both copies equal again), restore P at the touched indices. Where
        forward/backward changed a touched value in place, that change stays in P, as everywhere else
        (see `_step`). The folded point likewise: what the step moved it by (its update, what it sent)
        stays, the rest goes back bit for bit.

        Every vector here is of P's kind (FlatParams.device): the ignores below are mypy not seeing that
        a union-typed P, its twin, its point and the values gathered from them are one kind."""
        now = self.flat.array[idx]
        back = where(now == ahead, saved, saved + (now - ahead))  # type: ignore[type-var]  # == : exact, -0.0 too
        self.flat.array[idx] = back  # type: ignore[assignment]
        if self.flat.twin is not None:
            self.flat.twin[idx] = back  # type: ignore[assignment]
        point = self.flat.point
        if saved_point is not None and point is not None:  # saved_point: there is a point
            now = point[idx]
            point[idx] = where(now == point_ahead, saved_point,  # type: ignore[type-var,assignment]
                               saved_point + (now - point_ahead))  # type: ignore[operator]

    def run(self, peer: Peer, start_step: int) -> WorkerReport:
        cfg, rank = self.cfg, self.rank
        spe, total = cfg.steps_per_epoch[rank], cfg.total_steps(rank)
        prof = self.profile
        log = ApplyLog(peer, self.flat, start_step, cfg.timeout, prof, scale=cfg.apply_scale)
        self.log = log
        log.stop_epoch = self.inherited_stop
        if log.stop_epoch is not None:  # decided before this attempt: this rank may even be done already
            total = min(total, (log.stop_epoch + 1) * spe)
        history: list[EpochStats] = []
        if not self.restored:  # a checkpoint's state already has them where its step left them
            self._resume_schedule(start_step, spe)
            self._resume_counters(start_step)
        acc = self._fresh_epoch(peer)
        scores: deque[tuple[int, int]] = deque(self._shard_points(start_step))  # (epoch, the log step that scores it)
        t0 = time.monotonic()
        t = start_step
        while t < total:
            self._score(scores, t - 1 - cfg.staleness, history)  # before the step: the log is there anyway
            prof.begin()
            self.current_step = t
            log.apply_through(t - 1 - cfg.staleness)
            if log.stop_epoch is not None:  # early stop: this rank ends after its epoch stop_epoch
                total = min(total, (log.stop_epoch + 1) * spe)  # never before t (stopping.stop_epoch)
            epoch, b = divmod(t, spe)
            acc["lr"] = current_lr(self.optimizer) if acc["lr"] is None else acc["lr"]
            peer.begin_step(t)  # until its send_update: the relay's step_timeout watches this
            loss, entries, nbytes = self.step(peer, t)
            prof.end()
            acc["loss"] += loss
            acc["entries"] += entries
            acc["payload"] += nbytes
            acc["steps"] += 1
            acc["silent"] += entries == 0
            if b == spe - 1:
                history.append(self._close_epoch(peer, epoch, acc))
                prof.epoch(None)  # the training time of the epoch's end; the score comes with _score
                if self.closes_epochs and not cfg.shards:  # the last epoch: on the whole log, the model fit returns
                    scores.append((epoch, cfg.final_step if t == total - 1 else t))
                if self.scheduler is not None and cfg.scheduler_interval == "epoch":
                    self.scheduler.step()
                self._checkpoint(epoch + cfg.first_epoch, t, total, scores, history)
                acc = self._fresh_epoch(peer)
            t += 1
        prof.finish()
        # a rank whose last step the log held before this attempt's start has nothing to send in it
        peer.finish(max(total, start_step) - 1)
        self._score(scores, cfg.final_step, history)
        log.apply_through(cfg.final_step)  # everyone's remaining messages: the replicas meet again

        return WorkerReport(
            rank=rank,
            start_step=start_step,
            last_step=total - 1,
            stopped_epoch=log.stop_epoch,  # None: every epoch ran
            stop_requested_epoch=self.stop_requested,  # rank 0: the epoch that asked (None elsewhere)
            history=tuple(history),
            applied=log.applied,
            train_seconds=time.monotonic() - t0,
            steps_run=max(total - start_step, 0),
            update_path=self.path.name,  # capture.py
            step_in_backward=self.path.in_backward,  # capture.py: each parameter stepped in backward
            device=str(self.flat.buffer.device),  # where it trained: "cpu", "cuda:0", ...
            tensor_state=self.flat.device is not None,  # the torch state (always on a GPU; vectors.py)
            silent_steps=self.state.silent_steps,
            # integer buffers (BatchNorm's num_batches_tracked) are local; the result model takes rank 0's
            int_buffers={name: b.numpy() for name, b in int_buffers(self.model).items()} if rank == 0 else {},
            skipped_steps=self.precision.skipped,  # optimizer steps the fp16 loss scaler skipped
            checkpoint_seconds=self.checkpoint_seconds,  # rank 0's includes waiting for the others' files
            profile=prof.report() if isinstance(prof, StepProfile) else None,  # OFF_PROFILE: not profiled
        )

    def _resume_counters(self, start_step: int) -> None:
        """A resumed attempt's BatchNorm layers count the batches the attempts before it ran (one
        training forward a step): integer buffers are local, not in the relay's snapshot, and
        BatchNorm(momentum=None) averages with 1/num_batches_tracked."""
        for m in self.model.modules():
            if isinstance(m, _BatchNorm) and m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(start_step)

    def _checkpoint(self, epoch: int, t: int, total: int, scores: deque[tuple[int, int]],
                    history: list[EpochStats]) -> None:
        """After the last step of `epoch` (a whole-training epoch number): this rank's state, and rank 0's
        parameters and manifest, when a checkpoint is due (checkpoint.py). Needs staleness 0, where the
        next step would apply the log through t first anyway: applying it (and scoring the epoch, which
        would happen before that step) now changes nothing, and the checkpoint then holds the rule's
        state and stop request after this epoch: a fit resumed from it decides as an uninterrupted one."""
        plan = self.cfg.checkpoint
        if plan is None or ((epoch + 1) % plan.every and t != total - 1):
            return
        self._score(scores, t, history)
        self._log().apply_through(t)
        t0 = time.monotonic()
        if self.checkpoint_store is None:
            self.checkpoint_store = worker_store(self.cfg, "checkpoint", self.rank)
        write_rank(plan, epoch + 1, self, self.cfg.job_id, self.checkpoint_store)
        if self.rank == 0:
            write_manifest(plan, epoch + 1, self.cfg.timeout, self.cfg.job_id, self.checkpoint_store)
        self.checkpoint_seconds += time.monotonic() - t0

    def _resume_schedule(self, start_step: int, spe: int) -> None:
        """A resumed attempt starts at `start_step`: bring the lr schedule to where it was then."""
        if self.scheduler is None or start_step == 0:
            return
        done = start_step if self.cfg.scheduler_interval == "step" else start_step // spe
        with warnings.catch_warnings():  # torch warns when a scheduler steps before its optimizer
            warnings.simplefilter("ignore")
            for _ in range(done):
                self.scheduler.step()

    def _fresh_epoch(self, peer: Peer) -> dict[str, Any]:
        c = Counters.from_dict(peer.counters())
        return {"loss": 0.0, "entries": 0, "payload": 0, "steps": 0, "silent": 0, "lr": None,
                "t0": time.monotonic(), "out0": c.bytes_sent, "in0": c.training_bytes_in}

    def _close_epoch(self, peer: Peer, epoch: int, acc: dict[str, Any]) -> EpochStats:
        c = Counters.from_dict(peer.counters())
        steps = max(acc["steps"], 1)
        return EpochStats(
            epoch=epoch,
            steps=acc["steps"],
            loss=acc["loss"] / steps,
            sparsity=acc["entries"] / (steps * self.flat.n_params),
            payload_bytes=acc["payload"],
            bytes_sent=c.bytes_sent - acc["out0"],
            bytes_received=c.training_bytes_in - acc["in0"],
            tau=None if self.state.tau is None else float(self.state.tau),  # the last encoded step's τ
            lr=acc["lr"],  # at the epoch's first step
            silent_steps=acc["silent"],
            seconds=time.monotonic() - acc["t0"],
            val_metric=None,  # set by _score: the score of the log through the epoch's end
        )


TRIM_PAYLOAD_BYTES = 1 << 20  # a step whose message is this large trims the heap before the next backward
FAIL_REPORT_SECONDS = 5.0  # how long a failing task waits for the relay to acknowledge its fatal FAIL
# ... and a retryable one's: only which class the driver raises rides on it (Spark's text is the
# fallback), and a relay that is not there (often the very error) must not hold up Spark's retry long
REPORT_SECONDS = 1.0


@dataclass
class TaskPosition:
    """Where a training task is, for its failure report: its worker once built (its `current_step`)."""

    worker: Worker | None = None

    @property
    def step(self) -> int | None:
        return None if self.worker is None else self.worker.current_step


def train_partition(cfg: WorkerConfig, rows: Iterator[Any]) -> list[WorkerReport]:
    """The barrier task body: materialise rows, join the relay (resuming if it says so), train, report.

    A failure (reports.WorkerFailure: the class the driver raises, rank, step, first cause) reaches the
    driver two ways. The object path: it is reported to the relay over the authenticated
    control channel (FAIL, msgpack fields); a deterministic one (`is_deterministic`) as fatal, so the
    driver cancels the job at once instead of after Spark's stage retries, which would fail the same
    way, any other as retryable, which the driver reads only if the job fails after all. The fallback:
    the task raises TrainingError whose message is the failure's text form (tag line + JSON record),
    which the driver reads back from Spark's job error when the relay never got the FAIL.
    """
    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    # Python sees no stage-attempt number; the smallest task id of this stage attempt is the same on
    # every rank and grows with every retry, which is all the relay needs of `attempt`.
    attempt = min(int(i) for i in ctx.allGather(str(ctx.taskAttemptId())))
    position = TaskPosition()
    try:
        torch.set_num_threads(max(1, int(ctx.cpus())))  # no oversubscription (docs/design.md, Spark)
        start_rss = reset_peak_rss()  # a reused Python worker remembers the peaks of earlier tasks
        report = _run(cfg, rank, attempt, rows, position)
    except BaseException as e:  # noqa: BLE001 - re-raised with the rank named, cause chained
        failure = WorkerFailure.from_exception(e, rank, position.step, attempt)
        if isinstance(e, Exception):  # not the task being killed (KeyboardInterrupt, SystemExit)
            _report_failure(cfg, failure, fatal=is_deterministic(e))
        raise TrainingError(failure.to_text()) from e
    return [report.with_(attempt=attempt, pid=os.getpid(), package=os.path.dirname(gradshare.__file__),
                         start_rss_bytes=start_rss, peak_rss_bytes=_proc_status_bytes("VmHWM"))]


def is_deterministic(exc: BaseException) -> bool:
    """Would a retried stage fail the same way? Errors of the user's model, loss, optimizer, scheduler,
    metric or data (and of unpickling them) would: they are reported at once. Transport and liveness
    problems (every GradshareError: a timeout, a rejected or failed peer), a lost connection, running out
    of memory and the task being killed may pass on a retry: Spark's stage retry and resume handle them,
    as they handle a process that dies without raising."""
    return not isinstance(exc, (GradshareError, ConnectionError, MemoryError, KeyboardInterrupt, SystemExit))


def _report_failure(cfg: WorkerConfig, failure: WorkerFailure, fatal: bool) -> None:
    """FAIL(the failure's fields) to the relay from a fresh peer (the task may have failed before it
    had one, e.g. unpickling the model), waiting briefly for the acknowledgement. Best effort: if the
    relay cannot be reached, the error still reaches the driver through Spark (its text form)."""
    try:
        # n_params only sizes a joined peer's buffers; this one never joins
        peer = Peer(cfg.relay_address, rank=failure.rank, world_size=cfg.world_size, attempt=failure.attempt,
                    key=cfg.key, job_id=cfg.job_id, n_params=1, datagram_size=cfg.datagram_size,
                    timeout=cfg.timeout, insecure=cfg.insecure)
    except (OSError, ValueError):
        return
    try:
        wait = min(cfg.timeout, FAIL_REPORT_SECONDS if fatal else REPORT_SECONDS)
        peer.report_failure(failure.error_type, failure.message, wait, fatal=fatal,
                            step=-1 if failure.step is None else failure.step,
                            error_class=failure.error_class, cause=failure.cause or "")
    finally:
        peer.close(linger=0.0, leave=False)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc malloc_trim, every arena). Freed blocks below
    glibc's mmap threshold (which grows to 32 MB as large blocks are freed) stay in the process's RSS
    until trimmed: a worker's big transients (the snapshot's datagrams, a dense message's codes and
    payloads) would otherwise sit under the next step's peak (benchmarks/worker_memory.py: ~60 MB on the
    51.6 M MLP). No-op where the C library is not glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to trim with
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


# libc's malloc_trim, False where there is none; looked up on first use
_malloc_trim: Callable[[int], int] | Literal[False] | None = None


def reset_peak_rss() -> int:
    """Restart this process's peak-RSS count (VmHWM) from its current RSS, which it returns: the task's
    baseline (interpreter, torch, pyspark). 0 where Linux's /proc is missing (no reports then).

    First hand the heap's free pages back to the OS (`release_free_memory`): a reused Python worker
    still holds the pages an earlier task freed, which would hide this task's allocations from the count."""
    release_free_memory()  # not glibc: the count may then read low in a reused worker
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: "5" resets the peak RSS
    except OSError:
        return 0
    return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run(cfg: WorkerConfig, rank: int, attempt: int, rows: Iterator[Any],
         position: TaskPosition | None = None) -> WorkerReport:
    cfg = unpack_user_objects(cfg)  # user classes resolve here, where a failure is reported (shipping.py)
    peer = None
    if cfg.n_state:
        # the peer exists before the partition is read: it says LOADING while the rows materialise, so a
        # slow partition is a live task to the relay, not a silent one
        peer = _new_peer(cfg, rank, attempt, cfg.n_state)
        peer.loading()
    data = shard = None
    try:
        # a large partition spills into the executor's Spark scratch space, not the system temp dir
        def read(part: Iterator[Any]) -> PartitionData | SpilledPartition:
            return PartitionData.from_rows(part, cfg.label_dtype, spill_bytes=cfg.spill_bytes, index=rank,
                                           spill_dir=SparkFiles.getRootDirectory())

        if cfg.shards:  # (training row, validation rows) pairs: both read in one pass (validation.py)
            data, shard = split_rows(rows, read, read, cfg.timeout)
        else:
            data = read(rows)
        expected = steps_per_epoch(len(data), cfg.batch_size, cfg.drop_last)
        if expected != cfg.steps_per_epoch[rank]:
            raise ValueError(f"partition {rank} has {len(data)} rows now but had a different count in the "
                             "driver's pre-pass: the input RDD is not deterministic (cache or checkpoint it)")
        # the shipped model is a skeleton: this task owns it, nothing is copied (values: from the relay)
        worker = Worker(cfg, rank, data, model=materialize(cfg.model))
        if position is not None:
            position.worker = worker
        if cfg.shards:
            worker.shard, worker.gather = shard, BarrierTaskContext.get().allGather
        if peer is None:
            peer = _new_peer(cfg, rank, attempt, worker.flat.n_state)
        elif worker.flat.n_state != cfg.n_state:
            raise ProtocolError(f"rank {rank}'s model has {worker.flat.n_state} state entries; the driver's "
                                f"has {cfg.n_state}")
        info = peer.join(cfg.timeout)
        start = int(info.start_step)
        # the initial parameters (start 0) or, in a retried stage, the relay's current ones
        t_load = time.monotonic()
        _load_from_relay(peer, worker.flat, start, cfg.timeout)
        notes = dict(info.notes)
        worker.inherit(notes)
        if "checkpoint" in notes:  # the relay restarted the log at a checkpoint: the rest of the state too
            load_rank(manifest_for(cfg, int(notes["checkpoint"]), rank), worker)
        t_load = time.monotonic() - t_load
        release_free_memory()  # the snapshot's datagrams and the model's first storage are garbage now
        report = worker.run(peer, start).with_(
            snapshot_seconds=t_load,
            param_hash=param_hash(worker.flat.host_state()),  # parameters and float buffers
            counters=Counters.from_dict(peer.counters()),
            spilled=data.spilled)
        if cfg.shards:  # this rank's validation shard: rows, and whether they went to a spill file
            report = report.with_(validation_rows=0 if shard is None else len(shard),
                                  validation_spilled=False if shard is None else shard.spilled)
        peer.close()
        return report
    except BaseException:
        # Vanish WITHOUT saying LEAVE: a LEAVE before FINISHED makes the relay declare the rank gone
        # and let the log go on without it, so the others would train past the failed step and the
        # retried stage would skip this rank's data (a deterministic error would vanish). Silent, the
        # rank stays expected: Spark retries the stage, which resumes at the failed step (with no
        # retry, the relay's on_rank_loss policy decides).
        if peer is not None:
            peer.close(linger=0.0, leave=False)
        raise
    finally:
        if data is not None:
            data.close()
        if shard is not None:
            shard.close()


def _new_peer(cfg: WorkerConfig, rank: int, attempt: int, n_state: int) -> Peer:
    return Peer(cfg.relay_address, rank=rank, world_size=cfg.world_size, attempt=attempt, key=cfg.key,
                job_id=cfg.job_id, n_params=n_state, datagram_size=cfg.datagram_size, timeout=cfg.timeout,
                insecure=cfg.insecure)


def _load_from_relay(peer: Peer, flat: FlatParams, start: int, timeout: float) -> None:
    """Download the relay's state (parameters, float buffers) straight into the flat buffer (no second
    copy of the model)."""
    host = flat.state if isinstance(flat.state, np.ndarray) else None  # a device state takes a host copy
    step, values = peer.fetch_snapshot(timeout, into=host)  # first (flat.load)
    if step != start - 1:
        raise ProtocolError(f"the relay's snapshot holds the log through step {step}; rank {peer.rank} "
                            f"starts at step {start} and needs it through {start - 1}")
    if host is None:
        flat.load(values)
    else:
        if flat.twin is not None:  # the twin must equal P between steps (flat.py, keep_twin)
            copy_into(flat.twin, flat.array)
        if flat.point is not None:  # the folded point: P + s·r with r = 0, a fresh start (keep_point)
            copy_into(flat.point, flat.array)
