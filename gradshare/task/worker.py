"""What runs inside one Spark barrier task: a model replica, its residual, the step loop, the apply log.

One step t on rank w (docs/design.md, "One training step"):

    batch → forward/backward → optimizer.step() on the flat buffer P
    u = P_after − P_before ; P = P_before          # DL4J's "post-updater" update
    m = encode(residual, u, τ)                     # r += u; entries with |r_i| ≥ τ leave r as ±τ
      (direct path, capture.py: when the optimizer's update does not depend on P (SGD, Adam, ... without
       weight decay, or AdamW's decoupled decay, added as −lr·λ·P) optimizer.step() runs with the
       parameters aliased to the residual, so it adds u to r itself and P is never moved. General path: one fused pass;
       P_before is a twin copy of P that the apply log keeps equal to it, and the pass also writes P_before back over
       the live buffer, so no copy of P and no u vector per step)
    send m as (t, w)
    P changes only by applying decoded messages of the log, in (step, sender) order, own included

Staleness k: before step t the log is applied through step t-1-k, and never further, so the trajectory
of every replica is a function of the data and the seed alone (k = 0 is synchronous).

Own-update lookahead (k ≥ 1, `Compression.lookahead`): with stale parameters the step's gradient is taken
at P, which lacks every worker's last k messages, so a worker keeps pushing in directions already-sent
updates have covered (with Adam at lr 1e-3, k = 1 falls from ~89 % to ~19 % on the benchmark MLP after
4 epochs; docs/research/convergence.md, "Staleness"). Its OWN missing messages are known locally, so the
forward/backward and optimizer step run at P + (own sent messages the log has not applied yet), and u is
measured from that point; afterwards P is restored bit for bit (exact for one worker, partial for several). P
itself still changes only by applying the log, so replicas stay bit-identical (the lookahead is a local
evaluation point, like the residual is local state). The residual and
the optimizer state (e.g. Adam moments) stay local to the worker, as in DL4J; a resumed attempt starts
them from zero — that is what a restart loses — unless there is a checkpoint (gradshare/task/checkpoint.py),
which holds them: a fit resumed from one, or a retried stage, which the relay restarts at the last one.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradshare.encoding import SharingState, StepUpdate, buffer_change, skipped_step
from gradshare.errors import ConsistencyError, NonFiniteError, TrainingError
from gradshare.replica.capture import (
    DirectPath,
    UpdatePath,
    frees_enough,
    needs_all_gradients,
    update_path,
    writes_update_only,
)
from gradshare.replica.device import resolve_device, select
from gradshare.replica.flat import FlatParams, frozen_digest, int_buffers
from gradshare.replica.local_view import FoldedView, LocalView, NoView
from gradshare.replica.lookahead import look_ahead, look_back
from gradshare.replica.losses import LossStep
from gradshare.replica.momentum import lower_momentum, put_back
from gradshare.replica.precision import Precision
from gradshare.reports import EpochStats, WorkerReport
from gradshare.task.apply_log import ApplyLog
from gradshare.task.checkpoint import worker_store, write_manifest, write_rank
from gradshare.task.config import TrainStep, WorkerConfig
from gradshare.task.epochs import EpochTally, current_lr
from gradshare.task.partition import PartitionData
from gradshare.task.profiling import OFF, StepProfile
from gradshare.task.reader import BatchReader
from gradshare.task.scoring import Scorer
from gradshare.task.spill import SpilledPartition
from gradshare.task.stops import StopNotes
from gradshare.transport import Peer
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.vectors import Vector, copy_into, copy_of


def non_finite_cause(batch: tuple[torch.Tensor, ...], loss: torch.Tensor) -> str:
    """The likely cause of a step's non-finite update, for its error: the batch, the loss, or the step."""
    for i, x in enumerate(batch):
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            rows = torch.nonzero(~torch.isfinite(x).reshape(len(x), -1).all(dim=1)).flatten()[:5].tolist()
            what = "the labels" if i == len(batch) - 1 else f"input {i}"
            return f"{what} of the batch hold NaN or inf (batch rows {rows}): clean the data"
    value = float(loss.detach())
    if not math.isfinite(value):
        return (
            f"the loss is {value} on finite inputs: the model diverged or the loss overflowed; lower the "
            "learning rate or clip gradients (gradshare.clip_grad_norm)"
        )
    return (
        f"the loss is finite ({value:.4g}) but the optimizer's update is not: a gradient overflowed or the "
        "learning rate is too high; lower it or clip gradients (gradshare.clip_grad_norm)"
    )


def capture(
    cfg: WorkerConfig, flat: FlatParams, optimizer: torch.optim.Optimizer, precision: Precision
) -> tuple[SharingState, UpdatePath, FoldedView | LocalView | NoView]:
    """Where a replica's update goes and where its gradient is taken: its sharing state (residual,
    threshold rule, clipping, lr correction, own pending messages: encoding/sharing.py), its update
    path (capture.py) and its local view (local_view.py)."""
    direct = bool(cfg.flag("direct_update")) and writes_update_only(optimizer)
    # The local view folded into one buffer, P + r kept instead of r (local_view.py), where the
    # update goes straight into it (the direct path) and messages apply at scale 1 (aggregate="sum");
    # the two-buffer view elsewhere, or with worker_options={"folded_view": False} (an A/B)
    folded = cfg.compression.local_view and direct and cfg.rule.apply_scale == 1.0 and bool(cfg.flag("folded_view"))
    point = flat.keep_point() if folded else None
    fold = (flat.array, point, cfg.rule.apply_scale) if point is not None else None
    state = SharingState(
        flat.n_params,
        copy.deepcopy(cfg.rule.threshold_rule),
        cfg.rule.residual_clip,
        follow_lr=cfg.compression.follow_lr,
        keep_pending=cfg.compression.lookahead and cfg.compression.staleness > 0,
        device=flat.device,
        fold=fold,
    )
    # The optimizer writes its update straight into the residual where it can; otherwise the step
    # measures it against a twin of P that the apply log keeps (capture.py).
    # and on that direct path it steps each parameter as its gradient is ready, so that gradients do
    # not all live at once, unless something needs them all (capture.py, needs_all_gradients); by
    # default only where that frees enough memory to pay for the per-parameter steps
    wanted = cfg.flag("step_in_backward")
    in_backward = (frees_enough(flat) if wanted is None else wanted) and needs_all_gradients(
        optimizer, precision
    ) is None
    path = update_path(
        flat,
        optimizer,
        state.target,
        allow_direct=bool(cfg.flag("direct_update")),
        in_backward=in_backward,
        folded=folded,
    )
    # the gradient is taken at P + this worker's unsent residual (local_view.py)
    view: FoldedView | LocalView | NoView
    if point is not None and isinstance(path, DirectPath):  # folded (update_path: the direct path)
        view = FoldedView(flat, point, path.stepped)
    else:
        view = LocalView(flat, cfg.rule.apply_scale) if cfg.compression.local_view else NoView()
    return state, path, view


def train_step_of(cfg: WorkerConfig) -> TrainStep:
    """losses.py: what a batch is, the loss of it."""
    if cfg.code.train_step is not None:
        return cfg.code.train_step
    if cfg.code.loss is not None:
        return LossStep(cfg.code.loss)
    raise ValueError("WorkerConfig needs a loss or a train_step")


class UpdateSink(Protocol):
    """What a step needs of its peer: somewhere to send its message (transport.Peer; or a LogPeer,
    transport/testing/shared_log.py)."""

    def send_update(self, step: int, payload: bytes, meta: StepMeta | None = None) -> None: ...


class Worker:
    """One replica. `run(peer)` trains this rank's steps and returns its report for the driver."""

    def __init__(
        self, cfg: WorkerConfig, rank: int, data: PartitionData | SpilledPartition, model: nn.Module | None = None
    ) -> None:
        """`model`: a module this worker owns and trains in place (the Spark task's, built from the
        shipped skeleton); None trains a deep copy of ``cfg.code.model`` (drivers that step workers
        themselves)."""
        self.cfg, self.rank = cfg, rank
        self.device = select(resolve_device(cfg.runtime.device_name))  # auto: the GPU Spark gave this task, if any
        torch.manual_seed(cfg.data.seed * 1_000_003 + rank)  # dropout etc.: seeded per rank
        self.model = (copy.deepcopy(cfg.code.model) if model is None else model).to(self.device)
        own = None if cfg.frozen_digest is None else frozen_digest(self.model)  # one pass over the frozen bytes
        if own != cfg.frozen_digest:
            raise ConsistencyError(
                f"rank {rank}: the frozen parameters (requires_grad=False) of {type(self.model).__name__} differ "
                f"from the driver's (digest {own} here, {cfg.frozen_digest} there): every "
                "replica must start from the driver's model; build the frozen weights once, on the driver"
            )
        # A GPU keeps the state, residual and twin as torch tensors there; on the CPU they are NumPy arrays
        # for the Numba kernels, unless a test or benchmark asks for the torch path there ("tensor_state").
        on_tensors = self.device.type != "cpu" or cfg.flag("tensor_state")
        self.flat = FlatParams(self.model, device=self.device if on_tensors else None)
        self.optimizer = cfg.code.optimizer(self.flat.params)
        self.precision = Precision(cfg.runtime.precision, self.flat.params[0].device.type)  # its loss scaler: local
        self.scheduler = cfg.code.lr_scheduler(self.optimizer) if cfg.code.lr_scheduler is not None else None
        self.state, self.path, self.view = capture(cfg, self.flat, self.optimizer, self.precision)
        self.log: ApplyLog | None = None  # set by run(), or by a driver that steps the worker itself
        self.stops = StopNotes(copy.deepcopy(cfg.early_stopping))  # rank 0's rule state, its stop request
        self.restored = False  # state loaded from a checkpoint: the schedule and counters are where it left them
        self.checkpoint_seconds = 0.0  # spent writing checkpoints (checkpoint.py)
        self.checkpoint_store: Any = None  # where they go: the directory, or the driver's service (checkpoint.py)
        self.current_step: int | None = None  # the step `run` is in (a failure report names it)
        self.profile = StepProfile() if cfg.flag("profile") else OFF  # benchmarks: per-phase timers
        self.train_step = train_step_of(cfg)
        self.batches = BatchReader(cfg, rank, data, self.device)
        self.scoring = Scorer(cfg, rank, self.model, self.train_step, self.device)  # validation (its shard)

    def _log(self) -> ApplyLog:
        """The apply log that `run` (or a driver stepping this worker itself) set."""
        if self.log is None:
            raise TrainingError(f"rank {self.rank} has no apply log: run() sets it before the first step")
        return self.log

    @property
    def evaluates(self) -> bool:
        return self.scoring.evaluates

    @property
    def closes_epochs(self) -> bool:
        """Rank 0 runs the epoch's end (score, early-stopping rule, callbacks) once the log reaches it."""
        return self.rank == 0 and (self.evaluates or self.stops.rule is not None or bool(self.cfg.code.on_epoch_end))

    def inherit(self, notes: Mapping[str, Any]) -> None:
        """What a retried stage's attempt inherits from the log before it (the relay's WELCOME notes,
        gradshare/task/tallies.py AttemptNotes): rank 0's rule state and stop request, every rank's stop epoch."""
        self.stops.inherit(StepMeta.from_notes(notes), self.rank)

    def _score(self, scores: deque[tuple[int, int]], upto: int, history: list[EpochStats]) -> None:
        """Score the epochs whose log step is <= `upto` (scoring.py); rank 0 then runs each one's end."""
        self.scoring.score(
            scores,
            upto,
            self._log(),
            history,
            self.profile,
            lambda row: self.stops.epoch_end(row, self.cfg.code.on_epoch_end),
        )

    def step(self, peer: UpdateSink, t: int) -> tuple[float, int, int]:
        """Global step ``t`` of this rank: docs/design.md's step (batch → forward/backward → optimizer step into
        the residual → encode → send), then the lr schedule's step when it steps per step. The caller
        applies the log through t − 1 − k first. Returns (loss, entries sent, payload bytes)."""
        out = self._step(peer, t, *divmod(self._global(t), self.cfg.data.steps_per_epoch[self.rank]))
        if self.scheduler is not None and self.cfg.runtime.scheduler_interval == "step":
            self.scheduler.step()
        return out

    def _step(self, peer: UpdateSink, t: int, epoch: int, b: int) -> tuple[float, int, int]:
        prof, flat, state = self.profile, self.flat, self.state
        batch = self.batches.read(epoch, b)
        prof.lap("batch")
        # None: no own message pending, the step runs at P itself (lookahead.py)
        looked = look_ahead(
            flat, state, self.log.applied_through if self.log is not None else -1, self.cfg.rule.apply_scale
        )
        versions = flat.versions()
        buffers_before = copy_of(flat.buffer_array) if flat.n_buffers else None
        prof.lap("lookahead")
        lr = current_lr(self.optimizer)  # the schedule steps after the step: one lr for all of it
        state.set_lr(lr)  # rescales the residual if a schedule moved the lr
        restore = self._step_settings(self._global(t))  # lr factors, the momentum lowered (replica/momentum.py)
        self.optimizer.zero_grad(set_to_none=True)
        with self.view.around(state.residual):  # the gradient at P + own residual (local_view.py)
            with self.precision.autocast():
                loss = self.train_step(self.model, batch)  # the user's train_step or loss(model(*x), y)
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
        put_back(restore)
        self.optimizer.zero_grad(set_to_none=True)  # nothing reads them now: free them before the encode
        prof.lap("optimizer")
        try:
            msg = self.path.encode(state, self._global(t)) if taken else skipped_step(state)  # P is P_before again here
        except NonFiniteError as e:
            raise NonFiniteError(
                f"rank {self.rank}, step {t} (epoch {epoch}, batch {b}): the update is not finite: "
                f"{non_finite_cause(batch, loss)} ({e})"
            ) from e
        if looked is not None:
            look_back(flat, looked)
        payload = StepUpdate(msg, *changed).to_bytes(flat.n_buffers)
        loss_value = float(loss.detach())
        prof.lap("encode")
        # the relay tallies these per (rank, epoch) as it applies the log: a retried stage's history
        # then still has the steps of the attempts before it
        # (a skipped fp16 step's empty message carries a placeholder τ, not one that was used: no τ)
        meta = StepMeta(
            loss=loss_value,
            sparsity=msg.n_entries / flat.n_params,
            bytes=float(len(payload)),
            epoch=epoch - self.cfg.data.first_epoch,
            tau=msg.threshold if taken else None,
            lr=lr,
        )
        meta = meta.with_(self.stops.take_meta(t, self.cfg))  # rank 0's epoch end and stop request, if any
        peer.send_update(t, payload, meta)
        prof.lap("send")
        return loss_value, msg.n_entries, len(payload)

    def _step_settings(self, step: int) -> list[tuple[dict[str, Any], str, Any]]:
        """For this step's optimizer step only: every parameter group's lr × the fit's `lr_factor`
        (lr_batch_size) and the threshold rule's (not a change of rate: the residual is not rescaled),
        and the optimizer's momentum lowered when the fit says so (replica/momentum.py). A scheduler and a
        checkpoint see the values as given; returns what to put back."""
        factor_of = getattr(self.state.rule, "lr_factor", None)
        factor = self.cfg.rule.lr_factor * (1.0 if factor_of is None else float(factor_of(step, self.flat.n_params)))
        saved: list[tuple[dict[str, Any], str, Any]] = []
        if factor != 1.0:
            for group in self.optimizer.param_groups:
                saved.append((group, "lr", group["lr"]))
                group["lr"] = group["lr"] * factor
        if self.cfg.rule.momentum_ceiling is not None:
            saved += lower_momentum(self.optimizer, self.cfg.rule.momentum_ceiling)
        return saved

    def _global(self, t: int) -> int:
        """Step t of this fit's log as a step of the whole training (a resumed fit's log starts at 0):
        what the data order and a calibrated τ's warm-up count in, so they go on where they stopped."""
        return t + self.cfg.data.first_epoch * self.cfg.data.steps_per_epoch[self.rank]

    def _take_buffer_change(self, before: Vector | None) -> tuple[np.ndarray, ...]:
        """The step's forward moved the float buffers (BatchNorm running statistics) of this replica:
        take that change out of them (it reaches every replica, this one included, through the log,
        encoding/update.py) and return it as (indices, values ÷ world size)."""
        if before is None:
            return ()
        flat = self.flat
        flat.check_buffers()
        # `before` is a copy of the buffers: the same kind (mypy cannot tie the two to one SameVector)
        changed = buffer_change(
            before,
            flat.buffer_array,
            self.cfg.job.world_size,  # type: ignore[type-var]
            flat.buffer_entry_name,
        )
        copy_into(flat.buffer_array, before)
        return changed

    def run(self, peer: Peer, start_step: int) -> WorkerReport:
        cfg, rank = self.cfg, self.rank
        spe, total = cfg.data.steps_per_epoch[rank], cfg.total_steps(rank)
        prof = self.profile
        log = ApplyLog(
            peer,
            self.flat,
            start_step,
            cfg.fault_tolerance.timeout,
            prof,
            scale=cfg.rule.apply_scale,
            cap=cfg.rule.step_cap,
        )
        self.log = log
        log.stop_epoch = self.stops.inherited
        if log.stop_epoch is not None:  # decided before this attempt: this rank may even be done already
            total = min(total, (log.stop_epoch + 1) * spe)
        history: list[EpochStats] = []
        if not self.restored:  # a checkpoint's state already has them where its step left them
            self._resume_schedule(start_step, spe)
            self._resume_counters(start_step)
        tally = EpochTally.start(peer)
        # (epoch, the log step that scores it)
        scores: deque[tuple[int, int]] = deque(self.scoring.shard_points(start_step))
        t0 = time.monotonic()
        t = start_step
        while t < total:
            self._score(scores, t - 1 - cfg.compression.staleness, history)  # before the step: the log is there anyway
            prof.begin()
            self.current_step = t
            log.apply_through(t - 1 - cfg.compression.staleness)
            if log.stop_epoch is not None:  # early stop: this rank ends after its epoch stop_epoch
                total = min(total, (log.stop_epoch + 1) * spe)  # never before t (stopping.stop_epoch)
            epoch, b = divmod(t, spe)
            tally.lr = current_lr(self.optimizer) if tally.lr is None else tally.lr
            peer.begin_step(t)  # until its send_update: the relay's step_timeout watches this
            out = self.step(peer, t)
            prof.end()
            tally.add(*out)
            if b == spe - 1:
                # τ: the last encoded step's
                history.append(
                    tally.close(
                        peer, epoch, self.flat.n_params, None if self.state.tau is None else float(self.state.tau)
                    )
                )
                prof.epoch(None)  # the training time of the epoch's end; the score comes with _score
                if (
                    self.closes_epochs and not cfg.data.shards
                ):  # the last epoch: on the whole log, the model fit returns
                    scores.append((epoch, cfg.final_step if t == total - 1 else t))
                if self.scheduler is not None and cfg.runtime.scheduler_interval == "epoch":
                    self.scheduler.step()
                self._checkpoint(epoch + cfg.data.first_epoch, t, total, scores, history)
                tally = EpochTally.start(peer)
            t += 1
        prof.finish()
        # a rank whose last step the log held before this attempt's start has nothing to send in it
        peer.finish(max(total, start_step) - 1)
        self._score(scores, cfg.final_step, history)
        log.apply_through(cfg.final_step)  # everyone's remaining messages: the replicas meet again
        return self._report(start_step, total, history, time.monotonic() - t0)

    def _report(self, start_step: int, total: int, history: list[EpochStats], seconds: float) -> WorkerReport:
        log, prof, rank = self._log(), self.profile, self.rank
        return WorkerReport(
            rank=rank,
            start_step=start_step,
            last_step=total - 1,
            stopped_epoch=log.stop_epoch,  # None: every epoch ran
            stop_requested_epoch=self.stops.requested,  # rank 0: the epoch that asked (None elsewhere)
            history=tuple(history),
            applied=log.applied,
            train_seconds=seconds,
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
            profile=prof.report() if isinstance(prof, StepProfile) else None,  # OFF: not profiled
        )

    def _resume_counters(self, start_step: int) -> None:
        """A resumed attempt's BatchNorm layers count the batches the attempts before it ran (one
        training forward a step): integer buffers are local, not in the relay's snapshot, and
        BatchNorm(momentum=None) averages with 1/num_batches_tracked."""
        for m in self.model.modules():
            if isinstance(m, _BatchNorm) and m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(start_step)

    def _checkpoint(
        self, epoch: int, t: int, total: int, scores: deque[tuple[int, int]], history: list[EpochStats]
    ) -> None:
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
        write_rank(plan, epoch + 1, self, self.cfg.job.job_id, self.checkpoint_store)
        if self.rank == 0:
            write_manifest(
                plan, epoch + 1, self.cfg.fault_tolerance.timeout, self.cfg.job.job_id, self.checkpoint_store
            )
        self.checkpoint_seconds += time.monotonic() - t0

    def _resume_schedule(self, start_step: int, spe: int) -> None:
        """A resumed attempt starts at `start_step`: bring the lr schedule to where it was then."""
        if self.scheduler is None or start_step == 0:
            return
        done = start_step if self.cfg.runtime.scheduler_interval == "step" else start_step // spe
        with warnings.catch_warnings():  # torch warns when a scheduler steps before its optimizer
            warnings.simplefilter("ignore")
            for _ in range(done):
                self.scheduler.step()
