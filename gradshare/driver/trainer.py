"""SharedTrainer: the driver side of gradient-sharing training on Spark.

    trainer = SharedTrainer(model, threshold=1e-3, port=40123)
    result = trainer.fit(rdd)            # RDD of (features, label) rows
    result.model.state_dict()            # the relay's authoritative parameters, torch conventions

`fit` checks the data and the barrier slots, starts the relay (the master) with a fresh job key, ships
the key, the user's objects (cloudpickled) and a skeleton of the model inside the Spark job closure
(never over UDP; the workers fetch the initial parameters from the relay: shipping.py), runs ONE
barrier stage with one worker per partition, feeds a progress bar from the relay, then stops the relay
and verifies that every replica's parameter hash equals the relay's (a mismatch raises
ConsistencyError). A worker whose own code fails deterministically (the model, loss, optimizer or
data raised) reports it to the relay, and the driver cancels the job at once and raises that error
instead of waiting out Spark's stage retries (docs/guide/failures.md, "Fast failure").

Restart: the barrier stage is a shuffle-map stage, so Spark retries it when a worker process dies.
The new attempt joins the relay with a higher attempt number. With checkpoints (checkpoint_dir= or
resume_from=), the relay rolls the whole fit back to the last complete one: its parameters, the log
restarted after its step, and every rank loads its residual, optimizer, scheduler, RNG, τ rule and
early-stopping state from it, so at staleness 0 the retried fit ends bit-identical to an uninterrupted
one (the epochs after the checkpoint run again; their rows are the rerun's, the killed attempt's rows
of the epochs before it stay). Without one it continues from the relay's parameters and step (the
relay's `complete_through + 1`) and loses every worker's optimizer state (Adam moments, momentum
buffers), its residual (sub-threshold update mass not yet sent) and the threshold rule's adaptation;
they restart from zero / the initial τ. Either way the relay hands the new attempt rank 0's early-stopping
state and any stop already decided (WELCOME's notes), so a retried stage keeps them.

Persistent float buffers (BatchNorm running statistics, any float buffer in the state_dict) are part
of the shared state: each step's change of them travels exactly, averaged over the workers, in the same
log as the parameters (encoding/update.py), so they are bit-identical on every replica and in the relay,
the end-of-fit hash covers them, and the result model carries them. Integer buffers (num_batches_tracked)
stay local, the result model takes rank 0's; non-persistent buffers (masks, rotary caches) stay local
too, the result model has the driver's (flat.shared_buffers).
"""

from __future__ import annotations

import copy
import functools
import inspect
import ipaddress
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias, TypedDict

import numpy as np
import torch
from pyspark import RDD, SparkContext
from pyspark.sql import DataFrame
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from tqdm.auto import tqdm

from gradshare.task.batches import input_names, validation_arrays
from gradshare.driver.checkpoint import check_job, job_of, open_stores, rollback_point, start_service
from gradshare.task.checkpoint import CheckpointPlan, load_params
from gradshare.driver.ckpt_service import CheckpointService
from gradshare.config import (
    DEFAULT_WARMUP_MIN_STEPS, Aggregate, EpochCallback, Forwarding, LabelDtype, LossFn, Metric, ModelSpec, OnRankLoss,
    OptimizerFactory, Precision, SchedulerFactory, SchedulerInterval, ThresholdAlgorithm, ThresholdRule, TrainConfig,
    TrainStep,
    ValidationData, check_checkpoint_staleness as _check_checkpoint_staleness, is_calibrated as _is_calibrated,
)
from gradshare.driver.job import FrameJob, RddJob, check_connect, check_rdd, frame_path
from gradshare.encoding import (
    AdaptiveThreshold, CalibratedThreshold, FixedThreshold, ResidualClipping, apply_update, decode_update,
)
from gradshare.encoding.aggregate import AggregateState
from gradshare.encoding.threshold import DEFAULT_DENSITY, DEFAULT_WARMUP_DENSITY
from gradshare.errors import ConsistencyError, GradshareError, TrainingError, TransportTimeout
from gradshare.replica.flat import FlatParams, load_int_buffers
from gradshare.replica.losses import accuracy, accuracy_sums, plan_loss
from gradshare.driver.plotting import plot_result
from gradshare.reports import Counters, EpochStats, Progress, WorkerFailure, WorkerReport
from gradshare.task.shipping import pack_user_objects, skeleton
from gradshare.driver.session import check_summaries, dataframe_to_rdd, is_connect, is_dataframe
from gradshare.task.partition import summarise_partition
from gradshare.stopping import EarlyStopping
from gradshare.driver.tracking import tracked
from gradshare.transport import Relay, new_job_key
from gradshare.transport.events import Fail, Incident
from gradshare.transport.relay_core import RollbackPoint
from gradshare.transport.wire import MAX_DATAGRAM_SIZE
from gradshare.driver.validation import check_shards, is_distributed, shards_of, validation_rows, zip_shards
from gradshare.task.worker import WorkerConfig
from gradshare.task.worker import steps_per_epoch as steps_in

# a checkpoint's manifest (checkpoint.py: JSON, read by key), and the driver's stores by source
Manifest: TypeAlias = dict[str, Any]
Stores: TypeAlias = dict[str, object]
# (rank, epoch) -> the relay's tally of the applied log (Relay.epoch_tallies, EpochTally.as_dict)
Tallies: TypeAlias = Mapping[tuple[int, int], Mapping[str, float | None]]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam, lr 1e-3, fused: the default `optimizer` factory. The fused kernel updates each parameter in
    one pass: on this machine's CPU an Adam step over 8.4 M parameters takes 5 ms instead of the
    multi-tensor (foreach) kernel's 46 ms, and it allocates no temporaries the size of a layer (a
    worker's peak memory on the 51.6 M MLP: 7.85 instead of 8.63 × the parameter bytes;
    docs/benchmarks/memory.md)."""
    return torch.optim.Adam(params, lr=1e-3, fused=True)


@dataclass
class FitResult:
    """What `fit` returns. `history` has one dict per epoch (see `SharedTrainer.fit`)."""

    model: nn.Module
    # EpochStats.as_dict() rows: plain dicts users index, JSON-dump and log. Values are of the row's
    # several types (int, float, str, bool, None), read by key: Any, as the bare `dict` said before.
    history: list[dict[str, Any]]
    counters: Counters  # the relay's transport counters (read like a dict: counters["applied"])
    worker_reports: list[WorkerReport]  # one per rank (read like a dict: report["param_hash"])
    param_hash: str
    world_size: int
    n_params: int
    steps: int  # steps of the longest-running rank
    resumed_from: int  # 0, or the step a retried stage continued from
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)  # fit's docstring lists the keys; values of several types
    # steps of data the log went on without (only on_rank_loss="continue" skips any)
    skipped_steps: int = 0

    @property
    def bytes_sent(self) -> int:
        """UDP bytes the workers sent (datagrams incl. headers, acks and retransmits)."""
        return sum(r.counters.bytes_sent for r in self.worker_reports)

    @property
    def bytes_received(self) -> int:
        """UDP bytes the workers received for training (the model's snapshot downloads apart)."""
        return sum(r.counters.training_bytes_in for r in self.worker_reports)

    @property
    def snapshot_bytes(self) -> int:
        """UDP bytes of the model's downloads from the relay: every worker's initial state (4 B × the
        state's entries, plus headers) and a resumed attempt's. Not in `bytes_received`/`traffic_ratio`:
        it is the model's distribution, once per task, not the training's traffic."""
        return sum(r.counters.snapshot_bytes_in for r in self.worker_reports)

    @property
    def dense_bytes(self) -> int:
        """What dense float32 sharing would move for the same steps: each worker sends 4·N bytes per
        step and receives every other worker's 4·N (a parameter-server / relay layout)."""
        steps = sum(r.last_step + 1 for r in self.worker_reports)
        return 4 * self.n_params * steps * self.world_size

    @property
    def traffic_ratio(self) -> float:
        """dense bytes ÷ bytes actually moved (sent + received by the workers)."""
        moved = self.bytes_sent + self.bytes_received
        return self.dense_bytes / moved if moved else math.inf

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Write a PNG of loss, validation metric and traffic per epoch to `path` (gradshare/driver/plotting.py;
        needs matplotlib). Returns the path."""
        return plot_result(self, path)


# forwarding="auto" aggregates from this many workers on: below it per-rank forwarding's N·(N−1) messages
# cost the relay about as much as one re-encode of the whole model a step, and aggregation costs some
# accuracy (measured at 10 M params: N = 8 per-rank 10.5 ms/step vs aggregate 8.9 ms; N = 16: 35 vs
# 14 ms, per-rank retransmitting; docs/benchmarks/scale.md, docs/bench-scale*.json)
AGGREGATE_FROM = 16


def forwarding_for(forwarding: str, world_size: int, checkpointed: bool = False) -> str:
    """The forwarding mode a fit of ``world_size`` workers runs: "auto" resolved by AGGREGATE_FROM, and
    per-rank for a checkpointed fit (a checkpoint does not hold the relay's aggregation residual)."""
    if forwarding == "auto":
        return "aggregate" if world_size >= AGGREGATE_FROM and not checkpointed else "per-rank"
    return forwarding


# The warm-up's first density, shared by the workers: each starts at this ÷ N. Every replica applies all N
# workers' messages, so at N = 4 four workers at 0.1 each moved the model as one at ~0.4 and the digits MLP
# was slower in its first epochs than at 0.05 each (seeds 0-2 after epoch 3: 89.5 against 90.9 %, DDP's
# 90.5 %); at N = 2 this is the 0.1 that measured best (docs/benchmarks/convergence.md, lock step).
DEFAULT_WARMUP_SHARED_DENSITY = 0.2


def warmup_start(world: int) -> float:
    """The default warm-up's first density per worker among ``world`` (never above the single worker's)."""
    return min(DEFAULT_WARMUP_DENSITY, DEFAULT_WARMUP_SHARED_DENSITY / max(world, 1))


class SharedTrainer:
    """Data-parallel training of a PyTorch model on Spark with threshold-encoded shared updates.

    model: an ``nn.Module`` or a zero-argument factory returning one (called once on the driver, after
        ``torch.manual_seed(seed)``; every replica starts from those same parameters).
    loss: ``(outputs, labels) -> tensor``. Default: chosen from the labels and the model's output on one
        row, run once on the driver (gradshare/replica/losses.py): CrossEntropyLoss for int labels (and for
        whole-number double labels, e.g. StringIndexer's, when the output is (B, C) with C > 1), else
        MSELoss. Float targets are shaped like the output where unambiguous ((B,) against a (B, 1)
        output is unsqueezed); any other output/label shape difference is an error naming both shapes,
        for a given loss too. The choice is in ``FitResult.extra["loss"]`` and each history row's
        "loss_fn".
    train_step: instead of `loss`, a hook ``train_step(model, batch) -> scalar loss tensor`` for losses
        that are not ``loss(model(x), y)`` (several outputs, sample weights, auxiliary losses). `batch` is
        a tuple of tensors ``(x1, ..., xn, labels)``: the row's inputs in order (one for plain rows),
        then the labels; the worker calls ``backward()`` and the optimizer. Gradient clipping goes with
        the optimizer: ``optimizer=gradshare.replica.losses.clip_grad_norm(factory, max_norm)``. Without a
        `metric`, validation reports the hook's loss. Giving both `loss` and `train_step` is an error.
    optimizer: a factory taking the parameter list; default ``Adam(lr=1e-3, fused=True)`` (`default_optimizer`).
        Optimizer state stays on each worker (DL4J's design) and is lost on a restart without a checkpoint.
    threshold: "auto" (default): each worker derives τ before every step from a sample of its residual
        so that about ``density`` of the entries cross it (`CalibratedThreshold`; no tuning, no silent
        step). A number: τ itself, the initial threshold (Strom 2015), meant for the optimizer's initial
        learning rate; threshold_algorithm then says how it moves: "adaptive" (default: τ moves to keep
        the share of sent entries in DL4J's band), "fixed", or a threshold-rule object.
    density: with threshold="auto", the share of entries each step sends after the warm-up (default
        2e-3, docs/benchmarks/convergence.md).
    warmup: with threshold="auto", epochs over which the density falls geometrically from
        ``warmup_density`` (default 0.2 ÷ the number of workers, at most 0.1) to ``density`` (Deep Gradient
        Compression's warm-up; default 3 epochs but at least 24 steps, 0 disables; a number given is taken
        as given). A small model sends at least 768 entries a step (up to 5 % of them) whatever the density
        (`CalibratedThreshold.min_entries`: one datagram's worth); pass a `CalibratedThreshold` as
        threshold_algorithm to change that.
    lr_scheduler: a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``, built on every worker
        for its optimizer and stepped alike on all of them: after every step (scheduler_interval="step",
        default) or after every epoch ("epoch"). ReduceLROnPlateau is refused (its decisions would
        depend on each worker's own metric).
    follow_lr: when the learning rate changes from η to η', rescale each worker's residual by η'/η and
        scale a numeric τ by η'/η₀, so annealing reaches the model (corrected error feedback,
        encoding/sharing.py). On by default.
    local_view: each worker takes its gradient at the shared parameters plus its own residual (the
        updates it has not sent yet), not at the shared parameters alone, so a direction it has already
        pushed stops being pushed (gradshare/replica/local_view.py; docs/guide/convergence.md). On by default; on
        the direct update path under aggregate="sum" it is folded into the residual and costs nothing more,
        elsewhere one more float32 copy of the parameters per worker and one add per step.
    drop_last: what happens to a partition's final batch when it is shorter than batch_size: True drops
        it, False keeps it, "auto" (default) drops it only when it is a single row and the model has a
        BatchNorm layer (training-mode BatchNorm cannot normalise one row). A partition left with no
        batch is an error naming it.
    aggregate: "sum" (default, DL4J's SharedTrainingMaster: every replica adds every worker's ±τ) or
        "mean" (each message is applied × 1/N, so N workers that agree move the model as far as one
        step of DDP's averaged gradient would; docs/guide/convergence.md).
    forwarding: how the relay shares a step's messages (docs/guide/cluster.md, "Many workers:
        aggregated forwarding"): "per-rank" (each rank's message goes to every other rank, N·(N−1) messages a
        step), "aggregate" (the relay adds the step's N messages into a residual of its own and sends ONE
        re-encoded message of about one rank's size to every rank: N messages a step; two-level error
        feedback, gradshare/encoding/aggregate.py; it delays some update mass, ~2 points of digits
        accuracy after 6 epochs at N = 4 and 8) or "auto" (default: "aggregate" from AGGREGATE_FROM = 16
        workers on, where it measured faster, "per-rank" below and for a checkpointed fit).
        ``result.extra["forwarding"]`` says which ran.
    precision: "32" (default), "bf16-mixed" or "fp16-mixed" (Lightning's names): the forward and the loss
        run under torch.autocast with that dtype; parameters, gradients, optimizer, residual and messages
        stay float32 (the model's parameters must be float32). "fp16-mixed" scales the loss
        (torch.amp.GradScaler, local to each worker); a step whose gradients overflow is skipped and sends
        an empty message (worker reports count them as skipped_steps). gradshare/replica/precision.py.
    device: where each worker trains: "auto" (default: the GPU Spark assigned to the task, from
        TaskContext.resources()["gpu"], else CUDA's current device when torch has CUDA, else the CPU),
        "cpu", "cuda" or "cuda:N". On a GPU the model, its batches, the flat state, the residual, the
        encode and the apply log all live there (torch ops); only the sparse messages cross to the host.
        On the CPU the NumPy state and the Numba kernels run, as before. The model is given on the CPU;
        a CUDA device torch cannot use on an executor is a ValueError naming it. Worker reports say
        where each rank trained (report["device"]).
    residual_clip: clip |residual| to this many τ every few steps (ResidualClipping); None disables.
    port / bind: where the relay listens on the driver (port 0: ephemeral); advertise_host: the address
        executors use to reach it (default: spark.driver.host; on Spark Connect 127.0.0.1 for a local
        master on this machine, and required otherwise: docs/guide/connect.md).
    batch_size: rows per step per worker; epochs: passes over each partition.
    num_workers: barrier tasks (default: the RDD's partitions; otherwise the RDD is re-partitioned).
    staleness: k ≥ 0; before step t a worker has applied the whole log through t-1-k. k ≥ 1 overlaps
        communication with compute but each step's gradient is taken at parameters missing the last k
        steps of every worker: stale updates. That is an optimisation effect, not a transport one (the
        replicas still apply the same log bit for bit), and it is strong for Adam at lr 1e-3: on the
        benchmark MLP (10.5 M params, 2 workers) k = 1 reaches ~19 % test accuracy after 4 epochs where
        k = 0 reaches ~89 %, and the same happens with dense, uncompressed updates (docs/guide/convergence.md, "Staleness").
        Prefer k = 0 unless the link is the bottleneck; with k ≥ 1 keep `lookahead` on and lower the
        learning rate (the gap closes as lr falls).
    lookahead: with k ≥ 1, run each step at P + this worker's own sent messages that the log has not
        applied yet, so a worker never re-pushes what it already sent (exact for one worker: k ≥ 1 then
        follows the k = 0 trajectory bit for bit). P itself still changes only through the log. On by
        default; it has no effect at k = 0.
    validation_data: optional ``(X, y)`` arrays (X a tuple of arrays for multi-input rows, same dtypes
        and shapes as the training features): rank 0 evaluates `metric` (default: accuracy for int
        labels, else the loss) on its replica after every epoch. Or a DataFrame (the columns fit's
        features_col/label_col name, of the training columns' types; checked before any Spark job) or an
        RDD of (features, label) rows: cut into one shard per worker, read like the training partitions
        (memory or spill file), and scored by EVERY worker on its replica at the same log point (the
        epoch's last step); the partial sums are all-gathered through Spark's barrier and reduced, so
        every rank holds the same val_metric (gradshare/driver/validation.py). The reduction: a metric returning
        a number is a mean over the batch's rows (summed as value × rows), one returning ``(sum, count)``
        is summed as it is; val_metric = Σ sum / Σ count (exact for accuracy, the mean loss, MSE; not for
        AUC or F1: use the in-memory pair for those). Needs on_rank_loss other than "continue".
    early_stopping: None, or ``dict(patience=0, min_delta=0.0, mode="min"|"max", monitor="val_metric"|"loss")``
        (or a `gradshare.stopping.EarlyStopping`): Keras's rule, applied by rank 0 to its epoch rows. The
        decision travels in rank 0's next message of the log, so every rank stops after the same epoch
        E — usually the epoch after the one that decided (gradshare/stopping.py) — at a step that is a
        function of the log: replicas stay bit-identical and a rerun with the same seed stops at the
        same epoch. ``result.extra["stopped_epoch"]`` is E (None: every epoch ran); history has epochs
        0..E only. extra["stop_requested_epoch"]: the epoch whose end asked for the stop; a request that
        comes too late for every rank to end after a common epoch before the last is not carried out and
        shows only there. A retried stage (a worker's process died) keeps the rule's state and a stop
        decided before it: the relay records both from rank 0's messages and hands them to the new
        attempt (a checkpoint holds them too). Without a checkpoint, an epoch whose end the killed
        attempt reached but whose score no applied message carried yet is not scored.
    on_epoch_end: a callable or a list of them, ``fn(row) -> stop?``, run on rank 0 (inside its Spark
        task, so prints go to the executor's log) after each epoch is scored, with rank 0's history row
        (its own loss, val_metric, τ, ...). A truthy return asks for a stop, carried as early_stopping's.
        Rank 0 rather than the driver because the driver sees the log only late and the decision must
        travel in it.
    label_dtype: None (default: int labels → "int64"; float labels → "float32", or "int64" when they are
        whole numbers and the model is a classifier, see `loss`), or "int64" / "float32" to force
        class indices or regression targets. Features need no such option: each input keeps its dtype
        (ints → int64, floats → float32, bools; gradshare/task/batches.py), so token ids reach nn.Embedding
        exact; a row's features may be a tuple of arrays, the model is then called as model(x1, x2, ...).
    verbose: 0 quiet, 1 a progress bar fed by the relay.
    timeout: seconds any single wait (join, receive, snapshot) may take before a clear error; also how
        long the relay waits for a suspected rank (on_rank_loss="wait") before it gives up with an error
        naming the rank, its step and how long it was silent.
    liveness_timeout: a rank silent this long is *suspected* (docs/guide/failures.md, "Liveness"). A rank that
        comes back (a GC pause, a stopped process) carries on with nothing lost or repeated.
    on_rank_loss: what a suspected rank costs: "wait" (default: the log waits for it, at most `timeout`;
        a task that really died fails the barrier stage and Spark's retry resumes from the relay),
        "restart" (the relay fails the stage's live tasks so that Spark retries it at once; nothing is
        skipped) or "continue" (the rank is declared gone and the log goes on without its data:
        `FitResult.skipped_steps` and each history row's "skipped_steps" say how much was skipped).
    step_timeout: seconds a worker's training thread may spend in one step (forward, backward,
        optimizer, encode) while its process still answers; past it the fit stops with an error naming
        the rank and the step (default 600).
    worker_options: {"profile": True} adds per-phase step timers to each worker report
        (gradshare/task/profiling.py); {"direct_update": False} makes the optimizer's update be measured as
        P_after - P_before even where it could write it into the residual directly (capture.py);
        {"step_in_backward": True/False} steps each parameter's optimizer as its gradient is ready, where
        nothing needs every gradient at once / never (capture.py; the same bits; default: where that
        frees at least 64 MiB of gradients);
        {"tensor_state": True} runs the device code path (torch state, residual and codec) on the CPU,
        for tests and benchmarks of the GPU path without a GPU (slower than the default Numba path).
        {"folded_view": False} keeps the local view's two buffers where it would fold the residual into
        the point (local_view.py; an A/B of the two: they learn the same up to rounding).
    mlflow: None (default) or True or ``{"experiment", "run_name", "tags", "log_model"}``: each fit is one
        MLflow run, logged from the driver: these options as params, the history's per-epoch metrics,
        the model's state_dict as an artifact (gradshare/driver/tracking.py; needs ``gradshare[mlflow]``).
    checkpoint_dir: None, a local directory (or file: URI) shared by the executors (local[N],
        local-cluster, a shared mount), or any Hadoop-FS URI (hdfs://, s3a://, ...: written through
        Spark's FileSystem API on the driver, the workers stream their files to it; ckpt_service.py):
        after every `checkpoint_every`-th epoch and the last, each worker writes its residual, optimizer,
        lr scheduler, CPU RNG and integer buffers, its τ rule, loss scaler and early-stopping state, and
        rank 0 the shared parameters and a sha256 manifest, last (gradshare/task/checkpoint.py).
        `fit(resume_from=...)` continues from one bit-identically (staleness 0, same seed), and a retried
        stage restarts at the last one (module docstring, "Restart"). Needs staleness 0 and the same
        steps per epoch on every partition.
    checkpoint_every: epochs between checkpoints (default 1).
    """

    def __init__(
        self,
        model: ModelSpec,
        loss: LossFn | None = TrainConfig.loss,
        optimizer: OptimizerFactory | None = TrainConfig.optimizer,
        *,
        train_step: TrainStep | None = TrainConfig.train_step,
        threshold: float | Literal["auto"] = TrainConfig.threshold,
        port: int = TrainConfig.port,
        bind: str = TrainConfig.bind,
        advertise_host: str | None = TrainConfig.advertise_host,
        threshold_algorithm: ThresholdAlgorithm = TrainConfig.threshold_algorithm,
        batch_size: int = TrainConfig.batch_size,
        epochs: int = TrainConfig.epochs,
        num_workers: int | None = TrainConfig.num_workers,
        staleness: int = TrainConfig.staleness,
        lookahead: bool = TrainConfig.lookahead,
        residual_clip: float | None = TrainConfig.residual_clip,
        seed: int = TrainConfig.seed,
        verbose: int = TrainConfig.verbose,
        validation_data: ValidationData | None = TrainConfig.validation_data,
        metric: Metric | None = TrainConfig.metric,
        early_stopping: dict[str, object] | EarlyStopping | None = TrainConfig.early_stopping,
        on_epoch_end: EpochCallback | Sequence[EpochCallback] | None = TrainConfig.on_epoch_end,
        label_dtype: LabelDtype | None = TrainConfig.label_dtype,
        datagram_size: int = TrainConfig.datagram_size,
        timeout: float = TrainConfig.timeout,
        liveness_timeout: float = TrainConfig.liveness_timeout,
        on_rank_loss: OnRankLoss = TrainConfig.on_rank_loss,
        step_timeout: float = TrainConfig.step_timeout,
        spill_bytes: int = TrainConfig.spill_bytes,
        insecure: bool = TrainConfig.insecure,
        worker_options: Mapping[str, bool] | None = TrainConfig.worker_options,
        density: float | None = TrainConfig.density,
        warmup: float | None = TrainConfig.warmup,
        warmup_density: float | None = TrainConfig.warmup_density,
        lr_scheduler: SchedulerFactory | None = TrainConfig.lr_scheduler,
        scheduler_interval: SchedulerInterval = TrainConfig.scheduler_interval,
        follow_lr: bool = TrainConfig.follow_lr,
        local_view: bool = TrainConfig.local_view,
        aggregate: Aggregate = TrainConfig.aggregate,
        forwarding: Forwarding = TrainConfig.forwarding,
        drop_last: bool | Literal["auto"] = TrainConfig.drop_last,
        precision: Precision = TrainConfig.precision,
        device: str | torch.device = TrainConfig.device,
        mlflow: bool | dict[str, object] | None = TrainConfig.mlflow,
        checkpoint_dir: str | None = TrainConfig.checkpoint_dir,
        checkpoint_every: int = TrainConfig.checkpoint_every,
    ) -> None:
        # Every default is TrainConfig's (the one place they are written; tests/test_config.py), and
        # TrainConfig checks every option: a bad one fails here, naming it, before any Spark job.
        self.options = {k: v for k, v in locals().items() if k != "self"}  # as given: MLflow's params
        self.config = config = TrainConfig(**{k: v for k, v in self.options.items() if k != "model"})
        self.mlflow = config.mlflow_config
        self.auto = config.auto
        self.device = config.device_name
        self.on_rank_loss, self.step_timeout = on_rank_loss, float(step_timeout)
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, config.checkpoint_root
        self.model, self.loss, self.optimizer = model, loss, optimizer or default_optimizer
        self.train_step = train_step
        self.threshold = threshold if config.auto else float(threshold)
        self.threshold_algorithm = threshold_algorithm
        self.density = density  # None: CalibratedThreshold's default
        self.warmup = config.warmup_epochs
        self.warmup_density = warmup_density
        self.lr_scheduler, self.scheduler_interval = lr_scheduler, scheduler_interval
        self.follow_lr = bool(follow_lr)
        self.local_view = bool(local_view)
        self.aggregate = aggregate
        self.forwarding = forwarding
        self.drop_last = drop_last
        self.precision = precision
        self.port, self.bind, self.advertise_host = port, bind, advertise_host
        self.batch_size, self.epochs, self.num_workers = batch_size, epochs, num_workers
        self.lookahead = bool(lookahead)
        self.staleness, self.residual_clip, self.seed, self.verbose = staleness, residual_clip, seed, verbose
        self.validation_data, self.metric, self.label_dtype = validation_data, metric, label_dtype
        self.early_stopping = config.stopping
        self.on_epoch_end = config.callbacks
        self.datagram_size, self.timeout, self.liveness_timeout = datagram_size, timeout, liveness_timeout
        self.spill_bytes, self.insecure = spill_bytes, insecure
        self.worker_options = config.worker_flags

    # ------------------------------------------------------------------------------------ helpers
    def _build_model(self) -> nn.Module:
        spec: object = self.model  # the user's: checked here, whatever the annotation promises
        if isinstance(spec, nn.Module):
            return copy.deepcopy(spec)
        if callable(spec):
            torch.manual_seed(self.seed)
            model: object = spec()
            if not isinstance(model, nn.Module):
                raise TypeError(f"model factory returned {type(model).__name__}, not a torch.nn.Module")
            return model
        raise TypeError(f"model must be a torch.nn.Module or a factory returning one, got {type(spec).__name__}")

    def _rule_for(self, steps_per_epoch: int, world: int = 2) -> ThresholdRule:
        """The threshold rule each of ``world`` workers starts from (deep-copied per worker)."""
        algo = self.threshold_algorithm
        if _is_calibrated(algo):
            return copy.deepcopy(algo)
        if self.auto:
            steps = round(self.warmup * steps_per_epoch)
            if self.options["warmup"] is None and steps > 0:  # a warm-up the user gave is taken as given
                steps = max(steps, DEFAULT_WARMUP_MIN_STEPS)
            # None: CalibratedThreshold's own defaults
            return CalibratedThreshold(
                density=DEFAULT_DENSITY if self.density is None else self.density, warmup_steps=steps,
                warmup_density=warmup_start(world) if self.warmup_density is None else self.warmup_density)
        tau = float(self.threshold)  # not "auto" here: the number TrainConfig checked
        if isinstance(algo, str):  # TrainConfig checked it: "fixed" or "adaptive"
            return FixedThreshold(tau) if algo == "fixed" else AdaptiveThreshold(initial=tau)
        if not (hasattr(algo, "threshold") and hasattr(algo, "update")):
            raise TypeError("threshold_algorithm object must have .threshold and .update(n_entries, n_params)")
        return copy.deepcopy(algo)

    def _check_optimizer(self, model: nn.Module) -> None:
        """Build the optimizer and the scheduler once on the driver: a bad factory fails here, before
        any Spark job, not on every executor after the data is loaded."""
        sparse = [name for name, m in model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        if sparse:
            raise ValueError(f"module {sparse[0]!r} is an embedding with sparse=True: gradshare needs dense gradients "
                             "(its updates are sparse on the wire already); build it with sparse=False and use a "
                             "dense optimizer such as Adam or AdamW")
        trainable = [p for p in copy.deepcopy(model).parameters() if p.requires_grad]
        if not trainable:  # FlatParams names it: nothing to train or share
            return
        optimizer = self.optimizer(trainable)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ValueError("optimizer: SparseAdam needs sparse gradients, and gradshare trains with dense ones (its "
                             "updates are sparse on the wire already); use Adam or AdamW")
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(f"optimizer: {type(optimizer).__name__}.step needs a closure (it re-evaluates the loss), "
                             "which a step of gradshare cannot give it; use an optimizer whose step takes none, such "
                             "as Adam, AdamW or SGD")
        if self.lr_scheduler is None:
            return
        scheduler = self.lr_scheduler(optimizer)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("lr_scheduler: ReduceLROnPlateau is not supported: it steps on a metric, and "
                             "each worker would see its own; use a schedule of steps or epochs")
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"lr_scheduler must return a torch.optim.lr_scheduler.LRScheduler for the optimizer "
                            f"it is given, got {type(scheduler).__name__}")
        if scheduler.optimizer is not optimizer:
            raise ValueError("lr_scheduler returned a scheduler bound to another optimizer; it must schedule "
                             "the optimizer it is given (e.g. lambda opt: StepLR(opt, 100))")

    def _drop_rule(self, model: nn.Module) -> str:
        """drop_last as the worker's rule ("never" | "single" | "partial", worker.steps_per_epoch)."""
        if self.drop_last == "auto":
            return "single" if any(isinstance(m, _BatchNorm) for m in model.modules()) else "never"
        return "partial" if self.drop_last else "never"

    def _clipping(self) -> ResidualClipping | None:
        if self.residual_clip is None:
            return None
        return ResidualClipping(clip=float(self.residual_clip))

    def _job(self, data: object, features_col: str | list[str] | None, label_col: str | None,
             resume_from: str | None) -> RddJob | FrameJob:
        """The Spark side of the fit (job.py): a DataFrame on Spark Connect, or on a classic session
        where it measured faster (job.frame_path), goes through mapInArrow; an RDD as it is."""
        if is_dataframe(data):
            if features_col is None or label_col is None:
                raise ValueError("fit(df) needs features_col= and label_col= naming the DataFrame columns")
            if is_connect(data):
                check_connect(self.validation_data, self.checkpoint_dir, resume_from)
                return FrameJob(data, features_col, label_col, self.num_workers)
            if frame_path(self.validation_data):
                return FrameJob(data, features_col, label_col, self.num_workers)
            return RddJob(dataframe_to_rdd(data, features_col, label_col), self.num_workers)
        if features_col is not None or label_col is not None:
            raise ValueError("features_col/label_col apply to a DataFrame; an RDD holds (features, label) rows "
                             "(features: one array, or a tuple of arrays for several inputs)")
        check_rdd(data)
        return RddJob(data, self.num_workers)

    # ------------------------------------------------------------------------------------ fit
    @tracked  # with mlflow=..., the fit is one MLflow run (gradshare/driver/tracking.py)
    def fit(self, data: DataFrame | RDD[tuple[object, object]], features_col: str | list[str] | None = None,
            label_col: str | None = None, resume_from: str | None = None) -> FitResult:
        """Train on an RDD of ``(features, label)`` rows or a DataFrame; return a `FitResult`. A DataFrame is
        read through mapInArrow, with no RDD: the only way on a Spark Connect session (docs/guide/connect.md).

        features: one array per row, or a tuple of arrays (several inputs: model(x1, x2, ...)); for a
        DataFrame, features_col names one column or a list of columns (one input each). Every input
        keeps its dtype; rows and partitions must agree on dtypes and shapes (errors name partition and
        row). `FitResult.extra`: "loss" (the loss or train step used), "label_dtype", "inputs" (dtype and
        shape per input) and "probe" (the driver's one-row forward: its output shape, or why it was
        skipped; losses.py).

        The data is read twice: a validation pass (row counts, shapes, label types; errors name the
        partition and row) before anything starts, then once by the training tasks, which keep their
        partition in memory or a spill file for every epoch. Cache an expensive RDD first; its
        partitions must be deterministic (a retried stage re-reads them).

        History rows: epoch, steps, loss (mean over workers' steps), sparsity (sent entries ÷ params),
        payload_bytes, bytes_sent/bytes_received (UDP, all workers), tau (mean of the workers' τ at their
        epoch's last step), lr (rank 0's at the epoch's first step), silent_steps (steps that sent no
        entry, all workers), seconds (slowest worker), val_metric (None without validation_data),
        loss_fn (the loss's name, as extra["loss"]), resumed (the epoch's steps span stage attempts: a
        retried stage resumed inside it; its loss/sparsity/τ/payload/lr then come from the relay's tally
        of the applied log, which holds the killed attempt's steps), skipped_steps (steps of data the log
        went on without, on_rank_loss="continue" only). extra["incidents"]: the relay's liveness
        incidents (docs/guide/failures.md, "Liveness"). extra["forwarding"]: "per-rank" or "aggregate", what ran.

        resume_from: a checkpoint directory (``<checkpoint_dir>/epoch-<E>``) or a checkpoint_dir (its
        latest complete checkpoint), a local path or a Hadoop-FS URI: the fit continues after epoch E-1 up to `epochs` in all, from the
        saved parameters and each worker's residual, optimizer, scheduler, τ rule, loss scaler and RNG
        state (gradshare/task/checkpoint.py). History rows and extra["stopped_epoch"] then count epochs from
        the start of the whole training; extra["resumed_from"] names the checkpoint. extra["rolled_back"]:
        each time a retried stage restarted at a checkpoint ({"attempt", "from", "to"}: log steps).
        extra["checkpoint_service_errors"]: connections the driver's checkpoint service (a Hadoop-FS
        checkpoint_dir) refused or lost, at most 100.
        """
        t_start = time.monotonic()
        job = self._job(data, features_col, label_col, resume_from)
        shards: RDD[tuple[object, object]] | None = None
        if is_distributed(self.validation_data):  # its columns are checked here, before any Spark job
            shards = validation_rows(self.validation_data, data, features_col, label_col)
        stores, resume = self._open_checkpoints(resume_from, job.spark_context)  # a corrupt one fails here, before any Spark job
        model = self._build_model()
        self._check_optimizer(model)
        # Pre-pass: barrier slots, then every partition validated and its rows counted (errors come back
        # as data, so the driver names partition and row instead of Spark retrying a failing task).
        timed = job.prepass()
        world = job.world
        summaries = [s for s, _ in timed]
        load_seconds = max(seconds for _, seconds in timed)
        layout = check_summaries(summaries)
        features, label_kind, label_shape = layout.features, layout.label_kind, layout.label_shape
        # check_summaries raised for any partition with an error, and an empty one is an error
        assert features is not None and label_kind is not None and label_shape is not None
        names = input_names(features, (features_col,) if isinstance(features_col, str)
                            else tuple(features_col or ()))
        plan = plan_loss(model, layout.sample, label_kind, layout.labels_whole, loss=self.loss,
                         train_step=self.train_step, label_dtype=self.label_dtype, input_names=names,
                         label_range=layout.label_range)
        label_dtype = plan.label_dtype
        validation: tuple[tuple[np.ndarray, ...], np.ndarray] | None = None
        if shards is not None:
            assert isinstance(job, RddJob)  # _job keeps a fit with validation shards on the RDD path
            shards = shards_of(shards, world)
            shard_rows = check_shards(shards.mapPartitionsWithIndex(lambda i, it: [summarise_partition(i, it)])
                                      .collect(), layout, names)
            job.training = zip_shards(job.rdd, shards, [s.rows for s in sorted(summaries, key=lambda s: s.index)],
                                 shard_rows)
        elif self.validation_data is not None:
            validation = validation_arrays(self.validation_data, features, label_dtype, label_shape)
        # a train_step hook may call the model its own way: no default metric that calls model(*inputs)
        classes = label_dtype == "int64" and self.train_step is None
        default = accuracy if validation is not None else accuracy_sums if shards is not None else None
        metric = self.metric or (default if classes else None)

        flat = FlatParams(model)  # raises on a model with no trainable parameters
        initial = flat.host_state().copy()  # parameters, then float buffers (the state itself here: NumPy)
        drop_last = self._drop_rule(model)
        # The job ships a skeleton: the flat state's tensors are meta tensors; the workers take their
        # values from the relay's snapshot (shipping.py: the weights never sit twice in a worker).
        shipped = skeleton(model, flat.tensors)
        rows = {s.index: s.rows for s in summaries}
        steps_per_epoch = tuple(steps_in(rows[r], self.batch_size, drop_last) for r in range(world))
        empty = [r for r in range(world) if steps_per_epoch[r] == 0]
        if empty:
            raise ValueError(f"partition {empty[0]} has {rows[empty[0]]} row(s): no batch of batch_size="
                             f"{self.batch_size} is left with drop_last={self.drop_last!r}; repartition the "
                             "data or lower batch_size")
        rule, clip = self._rule_for(max(steps_per_epoch), world), self._clipping()
        saving, first_epoch, epochs = self._checkpoint_plan(model, world, steps_per_epoch, resume)
        if resume is not None:
            initial = load_params(stores["resume"], resume)  # shapes checked by _checkpoint_plan, contents by the manifest

        key, job_id = new_job_key(), secrets.randbits(31)
        scale = 1.0 / world if self.aggregate == "mean" else 1.0
        # checkpoints hold the replicas' state, not the relay's aggregation residual: "auto" keeps a
        # checkpointed fit per-rank, so that a resumed one stays bit-identical
        checkpointed = self.checkpoint_dir is not None or resume is not None
        forwarding = forwarding_for(self.forwarding, world, checkpointed)
        if checkpointed and forwarding == "aggregate":
            raise ValueError("forwarding='aggregate' cannot be checkpointed or resumed yet (the relay's aggregation "
                             "residual is not in the checkpoint); use forwarding='per-rank' or 'auto'")
        aggregator = None
        if forwarding == "aggregate":
            # the relay's τ rule: the workers' calibrated one (same density and warm-up) or the default
            agg_rule = copy.deepcopy(rule) if _is_calibrated(rule) else None
            aggregator = AggregateState(flat.n_params, flat.n_buffers, agg_rule)
        host = job.driver_host(self.advertise_host)
        relay = Relay(initial, world_size=world, key=key, job_id=job_id, port=self.port, bind=self.bind,
                      datagram_size=self.datagram_size, liveness_timeout=self.liveness_timeout,
                      insecure=self.insecure, decode_update=functools.partial(decode_update, n_params=flat.n_params),
                      apply_update=functools.partial(apply_update, scale=scale),
                      on_rank_loss=self.on_rank_loss, give_up_after=self.timeout, step_timeout=self.step_timeout,
                      join_window=self._join_window(load_seconds),
                      rollback=_rollback(saving, resume, stores, first_epoch, steps_per_epoch),
                      forwarding=forwarding, aggregator=aggregator,
                      **_snapshot_options(host, self.datagram_size)).start()
        service = None
        try:
            saving, resume, service = _serve_checkpoints(stores, saving, resume, key, self.bind, host, self.timeout)
            assert relay.address is not None  # start() bound it
            cfg = pack_user_objects(WorkerConfig(
                relay_address=(host, relay.address[1]), key=key, job_id=job_id, world_size=world,
                model=shipped, loss=getattr(plan.step, "loss", None), optimizer=self.optimizer,
                threshold_rule=rule, residual_clip=clip, steps_per_epoch=steps_per_epoch,
                epochs=epochs, batch_size=self.batch_size, staleness=self.staleness, seed=self.seed,
                label_dtype=label_dtype, datagram_size=self.datagram_size, timeout=self.timeout,
                insecure=self.insecure, spill_bytes=self.spill_bytes, validation=validation,
                metric=metric, lookahead=self.lookahead, **self.worker_options,
                lr_scheduler=self.lr_scheduler, scheduler_interval=self.scheduler_interval,
                follow_lr=self.follow_lr, local_view=self.local_view, apply_scale=scale, drop_last=drop_last,
                precision=self.precision, train_step=plan.step, device=self.device, n_state=int(initial.size),
                early_stopping=self.early_stopping, on_epoch_end=self.on_epoch_end,
                checkpoint=saving, resume=resume, first_epoch=first_epoch, shards=shards is not None,
            ))
            reports = self._run_job(job, cfg, relay, self._join_window(load_seconds))
            relay.wait_finished(self.timeout)
            final = relay.params
            relay_hash = relay.param_hash()
            counters = Counters.from_dict(relay.counters())
            tallies, incidents, rolled_back = relay.epoch_tallies(), relay.incidents(), relay.rolled_back()
        finally:
            relay.close()
            if service is not None:
                service.close()
        # connections the checkpoint service refused or lost (a worker's own failed call raises in it)
        service_errors = [] if service is None else list(service.errors)

        bad = [(r.rank, r.param_hash) for r in reports if r.param_hash != relay_hash]
        if bad:
            raise ConsistencyError(f"replicas diverged from the relay (hash {relay_hash}): "
                                   + ", ".join(f"rank {r} has {h}" for r, h in bad))
        flat.load(final)
        with torch.no_grad():  # give the result its own per-tensor storages (see `shipped`)
            for t in flat.tensors:
                t.data = t.data.clone()
        reports.sort(key=lambda r: r.rank)
        load_int_buffers(model, dict(reports[0].int_buffers))
        stopped = reports[0].stopped_epoch  # the log carried it: every rank has the same one
        epochs_run = epochs if stopped is None else stopped + 1
        merged, skipped = _merge_history(reports, tallies, steps_per_epoch, epochs_run)
        # a resumed fit's log counts its own epochs from 0; its rows count from the training's start
        history = [replace(row, epoch=row.epoch + first_epoch, loss_fn=plan.name).as_dict() for row in merged]
        return FitResult(
            model=model, history=history, counters=counters, worker_reports=reports,
            param_hash=relay_hash, world_size=world, n_params=flat.n_params, steps=max(r.last_step for r in reports) + 1,
            resumed_from=max(r.start_step for r in reports), seconds=time.monotonic() - t_start,
            extra={"loss": plan.name, "label_dtype": label_dtype, "inputs": features.describe(),
                   "probe": plan.probe, "incidents": [i.describe() for i in incidents],
                   "stopped_epoch": _offset(stopped, first_epoch),
                   "stop_requested_epoch": _offset(reports[0].stop_requested_epoch, first_epoch),
                   "resumed_from": None if resume is None else resume["directory"],
                   # a retried stage restarted at a checkpoint: the steps it went back from and to
                   "rolled_back": rolled_back,
                   "checkpoint_service_errors": service_errors,
                   "forwarding": forwarding},
            skipped_steps=skipped,
        )

    def _open_checkpoints(self, resume_from: str | None, sc: SparkContext | None) -> tuple[Stores, Manifest | None]:
        """The driver's checkpoint stores and resume_from's manifest, every file checked against it
        (checkpoint.py); ({}, None) without checkpoints."""
        if resume_from is None and self.checkpoint_dir is None:
            return {}, None
        if resume_from is not None:
            _check_checkpoint_staleness("resume_from", self.staleness)
        return open_stores(self.checkpoint_dir, resume_from, sc)

    def _checkpoint_plan(self, model: nn.Module, world: int, steps_per_epoch: tuple[int, ...],
                         resume: Manifest | None) -> tuple[CheckpointPlan | None, int, int]:
        """(CheckpointPlan or None, epochs done before this fit, epochs this fit runs)."""
        if self.checkpoint_dir is None and resume is None:
            return None, 0, self.epochs
        if len(set(steps_per_epoch)) > 1:
            raise ValueError(f"checkpoints need the same steps per epoch on every partition (an epoch's end is then "
                             f"one step of the log); got {list(steps_per_epoch)}: repartition the data evenly")
        shapes = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
        job = job_of(world, steps_per_epoch, self.batch_size, self.seed, shapes)
        first = 0
        if resume is not None:
            check_job(resume, job)
            first = resume["epochs_done"]
            if first >= self.epochs:
                raise ValueError(f"resume_from={resume['directory']!r} has {first} epoch(s) done; epochs={self.epochs} "
                                 "leaves none to train (epochs counts from the start of the training)")
        plan = None if self.checkpoint_dir is None else CheckpointPlan(self.checkpoint_dir, self.checkpoint_every, job)
        return plan, first, self.epochs - first

    def _join_window(self, load_seconds: float) -> float:
        """How long after a stage attempt starts the relay waits for a rank it has not heard at all:
        `timeout`, plus a generous multiple of the slowest partition's read in the pre-pass
        (the training read also builds arrays or a spill file). A task that is loading says so anyway."""
        return max(self.timeout, self.liveness_timeout) + JOIN_LOAD_FACTOR * load_seconds

    def _run_job(self, job: RddJob | FrameJob, cfg: WorkerConfig, relay: Relay, window: float) -> list[WorkerReport]:
        """Run the barrier stage in a thread (Spark's collect blocks) while the bar follows the relay."""
        # what the job's thread leaves: collect's list, or the error it raised
        collected: list[list[WorkerReport]] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                collected.append(job.collect(cfg))
            except BaseException as e:  # noqa: BLE001 - handed to the driver thread below
                errors.append(e)

        thread = job.thread(target)
        t_job = time.monotonic()
        thread.start()
        bar = _ProgressBar(cfg.final_step + 1, enabled=self.verbose > 0)
        try:
            while thread.is_alive():
                thread.join(0.25)
                bar.update(relay.progress())
                failed = relay.failure()
                if failed is not None:  # a worker's deterministic error: retries would repeat it
                    raise _reported_error(failed)  # the handler below cancels the job
                given_up = relay.fatal_incident()
                if given_up is not None:  # a rank silent past `timeout`, or stuck past step_timeout
                    raise _incident_error(given_up)
                job.check_started(relay, time.monotonic() - t_job, window)  # FrameJob: slots it could not count
        except BaseException:
            job.cancel()
            thread.join(30.0)
            job.settle(30.0)
            raise
        finally:
            bar.close()
        if errors:
            failed = relay.failure()  # a task fails only after its FAIL was acknowledged (or given up)
            if failed is not None:
                raise _reported_error(failed) from errors[0]
            raise _driver_error(errors[0], relay, relay.reported_failure()) from errors[0]
        return collected[0]


JOIN_LOAD_FACTOR = 4.0  # join window = timeout + this × the slowest pre-pass partition read (_join_window)


def _rollback(saving: CheckpointPlan | None, resume: Manifest | None, stores: Stores, first_epoch: int,
              steps_per_epoch: tuple[int, ...]) -> Callable[[int], RollbackPoint | None] | None:
    """The relay's `rollback` (relay_core): with checkpoints, a retried stage restarts at the last one."""
    if saving is None and resume is None:
        return None
    return functools.partial(rollback_point, saving, resume, stores, first_epoch, steps_per_epoch[0])


def _serve_checkpoints(stores: Stores, saving: CheckpointPlan | None, resume: Manifest | None, key: bytes, bind: str,
                       host: str, timeout: float) -> tuple[CheckpointPlan | None, Manifest | None, CheckpointService | None]:
    """A Hadoop-FS checkpoint_dir or resume_from: start the driver's checkpoint service and tell the
    workers where it is (checkpoint.py); local ones need none. (plan, resume manifest, service or None)."""
    service: CheckpointService | None = start_service(stores, key, bind, timeout)
    if service is None:
        return saving, resume, None
    assert service.address is not None  # start_service started it
    address = (host, service.address[1])
    saving = None if saving is None else replace(saving, service=address)
    resume = None if resume is None else {**resume, "service": address}
    return saving, resume, service


def _offset(epoch: int | None, first_epoch: int) -> int | None:
    return None if epoch is None else epoch + first_epoch


# Every worker takes the initial weights from the relay's snapshot (shipping.py), so its speed is
# start-up time: 50 MB/s in 1.4 kB datagrams made a 206 MB model wait 9-14 s on loopback with 2 workers.
SNAPSHOT_RATE_LOOPBACK = 1e9   # the CPU (sealing, opening) is the limit there, not the link
SNAPSHOT_RATE_NETWORK = 100e6  # about what 1 Gbit/s Ethernet carries


class _SnapshotOptions(TypedDict):
    """The relay's snapshot tunables (RelayOptions) that depend on how the workers reach it."""

    snapshot_rate: float
    snapshot_datagram_size: int


def _snapshot_options(host: str, datagram_size: int) -> _SnapshotOptions:
    """Relay options for snapshot transfers to workers that reach it at `host`: on loopback (MTU 64 kB,
    nothing to fragment) the largest datagrams and a CPU-bound rate; otherwise `datagram_size` and a rate
    a gigabit link carries (a lost fragment would lose a whole large datagram)."""
    try:
        loopback = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0][4][0]).is_loopback
    except (OSError, ValueError):
        loopback = False
    if loopback:
        return {"snapshot_rate": SNAPSHOT_RATE_LOOPBACK, "snapshot_datagram_size": MAX_DATAGRAM_SIZE}
    return {"snapshot_rate": SNAPSHOT_RATE_NETWORK, "snapshot_datagram_size": datagram_size}


class _ProgressBar:
    """tqdm on the driver: step (the relay's complete_through + 1), loss, sparsity, τ, KB/step."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: tqdm | None = None
        if enabled:
            self.bar = tqdm(total=total, desc="gradshare", unit="step")

    def update(self, progress: Mapping[str, Any]) -> None:
        """`progress`: Relay.progress(); each rank's latest step summary is the worker's `Progress`."""
        if self.bar is None or not progress:
            return
        done = int(progress.get("complete_through", -1)) + 1
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        ranks = (progress.get("ranks") or {}).values()
        latest = [p for r in ranks if isinstance(r, dict) and (p := Progress.from_meta(r.get("meta"))) is not None]
        if latest:
            def mean(values: list[float | None]) -> float:
                vals = [v for v in values if v is not None]
                return sum(vals) / len(vals) if vals else float("nan")

            self.bar.set_postfix(loss=f"{mean([p.loss for p in latest]):.4f}",
                                 sparsity=f"{mean([p.sparsity for p in latest]):.2e}",
                                 tau=f"{mean([p.tau for p in latest]):.2e}",
                                 kb_step=f"{mean([p.bytes for p in latest]) / 1024:.2f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# the closing line of a Python traceback: "ModuleNotFoundError: No module named 'x'" (dotted names too)
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): (.*)$", re.M)


def _failure_of(fail: Fail) -> WorkerFailure:
    """The WorkerFailure a FAIL carried (transport.events.Fail: its msgpack fields)."""
    return WorkerFailure(fail.rank, None if fail.step < 0 else fail.step, fail.error_type, fail.message,
                         fail.error_class, fail.cause or None, fail.attempt)


def _reported_error(failed: Fail) -> Exception:
    """The error for a fatal FAIL a worker reported to the relay: the class the worker raised."""
    return _failure_of(failed).error()


def _incident_error(incident: Incident) -> Exception:
    """The error for an incident after which the relay gave up on a rank (transport.events.Incident)."""
    return _incident_class(incident)(f"worker {incident.describe()}")


def _incident_class(incident: Incident) -> type[GradshareError]:
    """A rank that went silent is a timeout; any other incident a training error."""
    return TransportTimeout if incident.kind == "silent" else TrainingError


def _driver_error(exc: BaseException, relay: Relay | None, reported: Fail | None = None) -> Exception:
    """Turn Spark's job failure into one clear error naming the rank and the cause: the relay's first
    incident (the rank it suspected, cut or gave up on first, with its step) before the
    tasks' errors, which are often symptoms of it (a rank rejected because another was cut).

    The worker's error (reports.WorkerFailure) comes from the relay, which the failing task reported it
    to (FAIL, retryable or not: `reported`, Relay.reported_failure); only when none arrived (the relay unreachable, the report lost) from
    its text form in Spark's error. It is raised as the class the worker raised, or, after an incident,
    as the incident's class (the worker's error is then a symptom; it stays in the message and in
    the error's `worker_failure`)."""
    text = str(exc)
    failure = _failure_of(reported) if reported is not None else WorkerFailure.from_text(text)
    cause = None if relay is None else relay.first_cause()
    first = "" if cause is None else f"first cause: {cause.describe()}; "
    if failure is not None:
        return failure.error(first, None if cause is None else _incident_class(cause))
    if cause is not None:
        return _incident_class(cause)(f"{first}the Spark training job failed: {_first_line(text)}")
    if isinstance(exc, GradshareError):
        return exc
    # Spark failed the task before our code ran (e.g. unpickling the closure): the root cause is the
    # LAST line of the Python traceback in its text; the first lines are Spark's own wrappers.
    tail = text[text.rfind("Traceback (most recent call last)"):]
    causes = _PY_ERROR.findall(tail)
    if causes:
        kind, message = causes[-1]
        return TrainingError(f"the Spark training job failed: {kind}: {message.strip()[:500]}")
    return TrainingError(f"the Spark training job failed: {_first_line(text)}")


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if "Exception" in line or "Error" in line), text[:300]).strip()[:500]


def _rank_rows(reports: list[WorkerReport], tallies: Tallies, steps_per_epoch: tuple[int, ...],
               epochs: int) -> dict[tuple[int, int], EpochStats]:
    """(rank, epoch) -> that rank's history row. The last attempt's own row where it trained the whole
    epoch; otherwise (a retried stage resumed inside it, or after it) a row made from the relay's tally
    of the applied log, which holds the killed attempts' steps too. "resumed" says which."""
    own = {(r.rank, h.epoch): h for r in reports for h in r.history}
    rows: dict[tuple[int, int], EpochStats] = {}
    for rank, spe in enumerate(steps_per_epoch):
        for e in range(epochs):
            row, tally = own.get((rank, e)), tallies.get((rank, e))
            if tally is None and row is None:  # the log went on without this rank (on_rank_loss="continue")
                rows[(rank, e)] = EpochStats(epoch=e, steps=0, loss=0.0, sparsity=0.0, payload_bytes=0,
                                             bytes_sent=0, bytes_received=0, tau=None, lr=None, silent_steps=0,
                                             seconds=0.0, val_metric=None, resumed=False, skipped_steps=spe)
                continue
            if row is not None and (tally is None or (not tally["resumed"] and row.steps == tally["steps"])):
                rows[(rank, e)] = replace(row, resumed=False, skipped_steps=spe - row.steps)
                continue
            assert tally is not None  # no tally: continued above, with or without a row
            steps = int(_tallied(tally, "steps"))
            n = max(steps, 1)
            rows[(rank, e)] = EpochStats(
                epoch=e, steps=steps, loss=_tallied(tally, "loss") / n, sparsity=_tallied(tally, "sparsity") / n,
                payload_bytes=int(_tallied(tally, "payload")), tau=tally["tau"], lr=tally["lr"],
                silent_steps=int(_tallied(tally, "silent")),
                # the workers' own counters and clocks: only the attempt that finished the epoch reported them
                bytes_sent=row.bytes_sent if row else 0, bytes_received=row.bytes_received if row else 0,
                seconds=row.seconds if row else 0.0,
                # rank 0's score: its own row's, or the one its next message carried (a killed attempt's)
                val_metric=row.val_metric if row and row.val_metric is not None else tally.get("val_metric"),
                resumed=bool(tally["resumed"]),  # its steps were applied in more than one attempt
                skipped_steps=spe - steps,
            )
    return rows


def _tallied(tally: Mapping[str, float | None], key: str) -> float:
    """One of a tally's counts or sums (EpochTally.as_dict: those are never None; tau, lr, val_metric may be)."""
    value = tally[key]
    assert value is not None
    return value


def _merge_history(reports: list[WorkerReport], tallies: Tallies, steps_per_epoch: tuple[int, ...],
                   epochs: int) -> tuple[list[EpochStats], int]:
    """One row per epoch across workers: sums for bytes, means for loss/sparsity/τ, max for time; and
    the steps of data skipped in all (on_rank_loss="continue")."""
    by_rank = _rank_rows(reports, tallies, steps_per_epoch, epochs)
    merged = []
    for e in sorted({e for _, e in by_rank}):
        rows = [by_rank[k] for k in sorted(by_rank) if k[1] == e]
        steps = sum(h.steps for h in rows)
        val = [h.val_metric for h in rows if h.val_metric is not None]
        taus = [h.tau for h in rows if h.tau is not None]
        merged.append(EpochStats(
            epoch=e,
            steps=steps,
            loss=sum(h.loss * h.steps for h in rows) / max(steps, 1),
            sparsity=sum(h.sparsity * h.steps for h in rows) / max(steps, 1),
            payload_bytes=sum(h.payload_bytes for h in rows),
            bytes_sent=sum(h.bytes_sent for h in rows),
            bytes_received=sum(h.bytes_received for h in rows),
            tau=float(np.mean(taus)) if taus else float("nan"),
            lr=next((h.lr for h in rows if h.lr is not None), None),  # rank 0's unless it had none
            silent_steps=sum(h.silent_steps for h in rows),
            seconds=max(h.seconds for h in rows),
            val_metric=val[0] if val else None,
            resumed=any(h.resumed for h in rows),
            skipped_steps=sum(h.skipped_steps or 0 for h in rows),
        ))
    return merged, sum(h.skipped_steps or 0 for h in merged)
