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

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal

import torch
from pyspark import RDD
from pyspark.sql import DataFrame
from torch import nn

from gradshare.config import (
    Aggregate, Elastic, EpochCallback, Forwarding, LabelDtype, LossFn, LrScaling, Metric, ModelSpec, OnRankLoss,
    OptimizerFactory, OptimizerMomentum, Precision, RelayPlace, SchedulerFactory, SchedulerInterval,
    ThresholdAlgorithm, TrainConfig, TrainStep, ValidationData,
)
from gradshare.driver.fit import collect_result, plan_run, prepare_data, run_job, start_relay
from gradshare.driver.elastic import fit_elastic
from gradshare.driver.in_job import fit_in_job, in_job
from gradshare.driver.plan import FitSpec
from gradshare.driver.result import FitResult
from gradshare.driver.tracking import tracked
from gradshare.stopping import EarlyStopping


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam, lr 1e-3, fused: the default `optimizer` factory. The fused kernel updates each parameter in
    one pass: on this machine's CPU an Adam step over 8.4 M parameters takes 5 ms instead of the
    multi-tensor (foreach) kernel's 46 ms, and it allocates no temporaries the size of a layer (a
    worker's peak memory on the 51.6 M MLP: 7.85 instead of 8.63 × the parameter bytes;
    docs/benchmarks/memory.md)."""
    return torch.optim.Adam(params, lr=1e-3, fused=True)


# The trainer's attributes of these options' names are TrainConfig's checked forms of them
CHECKED = {"warmup": "warmup_epochs", "early_stopping": "stopping", "on_epoch_end": "callbacks",
           "worker_options": "worker_flags", "device": "device_name", "mlflow": "mlflow_config",
           "checkpoint_dir": "checkpoint_root"}
# read through trainer.config (`optimizer` is a property: the option or its default); `auto` is derived
OPTIONS = frozenset(f.name for f in fields(TrainConfig) if f.init) - {"optimizer"} | {"auto"}


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
        ``warmup_density`` (default 0.2 ÷ the number of workers, at most 0.07) to ``density`` (Deep Gradient
        Compression's warm-up; default 3 epochs but at least 24 steps, 0 disables; a number given is taken
        as given). A small model sends at least 768 entries a step (up to 5 % of them) whatever the density
        (`CalibratedThreshold.min_entries`: one datagram's worth); pass a `CalibratedThreshold` as
        threshold_algorithm to change that.
    decay_from: with threshold="auto", the density the run starts from, falling geometrically to
        ``density`` over the whole run while each worker's lr is × (density ÷ that density) ** 0.35
        (a floor under the warm-up; docs/guide/convergence.md, "Run-long decay"). Default: 0.02 from 32
        workers on, off (0) below, as measured in lock step; 0 turns it off at any N. Under a step cap the
        lr is not lowered (the cap measured better than the lower lr).
    step_cap: every replica (and the relay) scales each parameter tensor's share of a step's summed
        messages down to at most this share of the tensor's norm at the start of training: N workers'
        updates summed overshoot, most on models initialised small (docs/guide/convergence.md, "Step
        cap"). "auto" (default): 0.06 below 32 workers, 0.1 from 32 on, as measured in lock step
        (gradshare/driver/policy.py); None: none at any N. A resumed fit keeps its checkpoint's bounds.
    lr_batch_size: the batch size the optimizer's lr was tuned at, when that is not ``batch_size``
        (e.g. a published recipe's batch, now split over N workers): each worker's lr is then scaled
        by (batch_size ÷ lr_batch_size) ** 0.5, or by the ratio itself with lr_scaling="linear"
        (docs/guide/convergence.md, "Learning rate and batch size"). The lr a worker's optimizer is
        built with is the lr of one process at ``batch_size`` rows: each worker steps its own optimizer
        and the N updates are summed. Default None: the lr as given.
    lr_scaling: "sqrt" (default: the square-root rule for Adam-like optimizers, Malladi et al. 2022)
        or "linear" (SGD's linear rule, Goyal et al. 2017), used with lr_batch_size.
    optimizer_momentum: "off": each worker steps its optimizer with its momentum off (Adam-like
        optimizers with β1 = 0, SGD and RMSprop with momentum 0): a worker's residual already averages
        its past updates (error feedback), and a second average on top makes learning lag
        (docs/guide/convergence.md, "The workers' momentum"); a number in [0, 1): the most momentum each
        worker steps with; "keep": the optimizer as given. Default "auto": at most 0.5 below 32 workers,
        off from 32 on, as measured in lock step (gradshare/driver/policy.py). The optimizer, its
        scheduler and a checkpoint keep the values as given. "off" or a number with an optimizer that has
        no momentum is refused.
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
        accuracy after 6 epochs at N = 4 and 8) or "auto" (default: "aggregate" from 16
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
    port / bind: where the relay listens (port 0: ephemeral); advertise_host: the address executors use to
        reach this process (default: spark.driver.host; on Spark Connect 127.0.0.1 for a local master on
        this machine: docs/guide/connect.md).
    relay: where the relay runs: "client" (in this process; the executors send it UDP), "in-job" (in
        rank 0's task, beside its worker: the executors reach only each other, and the relay's status
        reaches this process when it can, at advertise_host), or "auto" (in-job on a Spark Connect
        session, client on a classic one). In the job, a failed stage is run again by the driver from
        the last checkpoint, or from scratch without one (extra["restarts"]).
    batch_size: rows per step per worker; epochs: passes over each partition.
    num_workers: barrier tasks (default: the RDD's partitions; otherwise the RDD is re-partitioned).
    elastic: ``Elastic(min_workers, max_workers)``: the job follows the cluster, shrinking when an
        executor is lost for good and growing at an epoch's end when slots are free; it starts at
        num_workers, or at the free slots up to max_workers (docs/guide/elastic.md). extra["reforms"]
        lists each re-form; each history row's "workers" says how many trained that epoch.
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
    verbose: 0 quiet, 1 a progress bar fed by the relay and a line per finished epoch (mean loss, score).
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
        relay: RelayPlace = TrainConfig.relay,
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
        decay_from: float | None = TrainConfig.decay_from,
        step_cap: float | Literal["auto"] | None = TrainConfig.step_cap,
        lr_batch_size: int | None = TrainConfig.lr_batch_size,
        lr_scaling: LrScaling = TrainConfig.lr_scaling,
        optimizer_momentum: OptimizerMomentum = TrainConfig.optimizer_momentum,
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
        elastic: Elastic | None = TrainConfig.elastic,
    ) -> None:
        # Every default is TrainConfig's (the one place they are written; tests/test_config.py), and
        # TrainConfig checks every option: a bad one fails here, naming it, before any Spark job.
        options = {k: v for k, v in locals().items() if k != "self"}  # as given: MLflow's params
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "config", TrainConfig(**{k: v for k, v in options.items() if k != "model"}))
        object.__setattr__(self, "model", model)

    options: dict[str, object]
    config: TrainConfig
    model: ModelSpec

    @property
    def optimizer(self) -> OptimizerFactory:
        """The optimizer factory the workers build: the option, or `default_optimizer`."""
        return self.config.optimizer or default_optimizer

    def __getattr__(self, name: str) -> Any:
        """An option's name reads the config: ``trainer.epochs`` is ``trainer.config.epochs``, and where
        TrainConfig derives a checked form (``trainer.device`` is ``config.device_name``) that form."""
        if name in OPTIONS:
            return getattr(self.config, CHECKED.get(name, name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        # an option set here would not reach the config the fit reads: make a new trainer instead
        if name in OPTIONS or name in ("config", "optimizer"):
            raise AttributeError(f"SharedTrainer's options are fixed when it is made (trainer.config is frozen); "
                                 f"make a new SharedTrainer to change {name!r}")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------------------------ fit
    @tracked  # with mlflow=..., the fit is one MLflow run (gradshare/driver/tracking.py)
    def fit(self, data: DataFrame | RDD[tuple[object, object]], features_col: str | list[str] | None = None,
            label_col: str | None = None, resume_from: str | None = None) -> FitResult:
        """Train on an RDD of ``(features, label)`` rows or a DataFrame; return a `FitResult`. A DataFrame is
        read through mapInArrow, with no RDD: the only way on a Spark Connect session (docs/guide/connect.md).

        features: one array per row, or a tuple of arrays (several inputs: model(x1, x2, ...)); for a
        DataFrame, features_col names one column or a list of columns (one input each). Every input
        keeps its dtype; rows and partitions must agree on dtypes and shapes (errors name partition and
        row). `FitResult.extra` (a `FitExtras`, read by attribute or by key like a dict: extra.loss or
        extra["loss"]): "loss" (the loss or train step used), "label_dtype", "inputs" (dtype and
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
        extra["relay"]: "client" or "in-job", where the relay ran; with it in the job, extra["restarts"] (each
        run of the stage again: {"error", "from"}) and extra["relay_statuses"] (its statuses that reached
        this process; docs/guide/connect.md). extra["step_cap"]: the step cap that ran (None: none).
        extra["reforms"]: each time the job re-formed at another size (an elastic fit's shrink or grow, a
        resume at another world size; docs/guide/elastic.md).

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
        spec = FitSpec(self.config, self.model, self.optimizer)  # what the stages (fit.py) read
        if in_job(self.config, data):  # the relay in rank 0's task (in_job.py)
            prep, run, outcome, restarts = fit_in_job(spec, data, features_col, label_col, resume_from)
            return collect_result(prep, run, outcome, t_start, relay="in-job", restarts=restarts)
        if self.config.elastic is not None:  # the job re-forms as the cluster changes (elastic.py)
            return fit_elastic(spec, data, features_col, label_col, resume_from, t_start)
        prep = prepare_data(spec, data, features_col, label_col, resume_from)  # every check before training
        run = plan_run(self.config, prep)
        started = start_relay(self.config, prep, run)
        outcome = run_job(spec, prep, run, started)  # closes the relay
        return collect_result(prep, run, outcome, t_start, relay="client")
