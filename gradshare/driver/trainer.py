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
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, Literal

import torch
from pyspark import RDD
from pyspark.sql import DataFrame
from torch import nn

from gradshare.config import (
    LossFn,
    Metric,
    ModelSpec,
    OptimizerFactory,
    SchedulerFactory,
    TrainConfig,
    TrainStep,
    ValidationData,
)
from gradshare.config.grouping import grouped
from gradshare.config.options import Compression, Elastic, FaultTolerance, Network, Runtime
from gradshare.driver.loop import fit_loop
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
CHECKED = {"early_stopping": "stopping"}
# read through trainer.config (`optimizer` is a property: the option or its default); `auto` is derived
OPTIONS = frozenset(f.name for f in fields(TrainConfig) if f.init) - {"optimizer"} | {"auto"}


class SharedTrainer:
    """Data-parallel training of a PyTorch model on Spark with threshold-encoded shared updates.

    The everyday options are flat; the rest are in four groups, `Compression`, `Network`,
    `FaultTolerance` and `Runtime` (gradshare/config/options.py), plus `Elastic`. docs/guide/options.md lists
    every option with its default and meaning (generated from the dataclasses' fields); `trainer.config`
    is the checked `TrainConfig`, and ``trainer.epochs`` (any flat option's name, or a group's keyword)
    reads it.

    model: an ``nn.Module`` or a zero-argument factory returning one (called once on the driver, after
        ``torch.manual_seed(seed)``; every replica starts from those same parameters).
    loss / train_step: ``(outputs, labels) -> tensor``, or a hook ``train_step(model, batch) -> loss``
        for anything else (docs/guide/data.md); None chooses the loss from the labels and one probe
        forward pass (gradshare/replica/losses.py). ``FitResult.extra["loss"]`` says which ran.
    optimizer: a factory taking the parameter list; default ``Adam(lr=1e-3, fused=True)``
        (`default_optimizer`). Its state stays on each worker (DL4J's design).
    threshold: "auto" (default: τ calibrated before every step to send ``compression.density`` of the
        entries, `CalibratedThreshold`) or a number, τ itself (Strom 2015), moved by
        ``compression.threshold_algorithm``.
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
        batch_size: int = TrainConfig.batch_size,
        epochs: int = TrainConfig.epochs,
        num_workers: int | None = TrainConfig.num_workers,
        lr_scheduler: SchedulerFactory | None = TrainConfig.lr_scheduler,
        validation_data: ValidationData | None = TrainConfig.validation_data,
        metric: Metric | None = TrainConfig.metric,
        early_stopping: dict[str, object] | EarlyStopping | None = TrainConfig.early_stopping,
        seed: int = TrainConfig.seed,
        verbose: int = TrainConfig.verbose,
        elastic: Elastic | None = TrainConfig.elastic,
        compression: Compression = TrainConfig.compression,
        network: Network = TrainConfig.network,
        fault_tolerance: FaultTolerance = TrainConfig.fault_tolerance,
        runtime: Runtime = TrainConfig.runtime,
    ) -> None:
        # Every default is TrainConfig's or its groups' (the one place they are written), and they check
        # every option: a bad one fails here, naming it, before any Spark job.
        given = {k: v for k, v in locals().items() if k != "self"}
        options = grouped(given)
        object.__setattr__(self, "options", options)  # as given, the groups made: MLflow's params
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
        """An option's name reads the config: ``trainer.epochs`` is ``trainer.config.epochs`` (and
        ``trainer.early_stopping`` its checked rule), ``trainer.compression`` the group."""
        if name in OPTIONS:
            return getattr(self.config, CHECKED.get(name, name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        # an option set here would not reach the config the fit reads: make a new trainer instead
        if name in OPTIONS or name in ("config", "optimizer"):
            raise AttributeError(
                f"SharedTrainer's options are fixed when it is made (trainer.config is frozen); "
                f"make a new SharedTrainer to change {name!r}"
            )
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------------------------ fit
    @tracked  # with runtime=Runtime(mlflow=...), the fit is one MLflow run (gradshare/driver/tracking.py)
    def fit(
        self,
        data: DataFrame | RDD[tuple[object, object]],
        features_col: str | list[str] | None = None,
        label_col: str | None = None,
        resume_from: str | None = None,
    ) -> FitResult:
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
        latest complete checkpoint), a local path or a Hadoop-FS URI: the fit continues after epoch E-1 up to `epochs`
        in all, from the saved parameters and each worker's residual, optimizer, scheduler, τ rule, loss scaler and RNG
        state (gradshare/task/checkpoint.py). History rows and extra["stopped_epoch"] then count epochs from
        the start of the whole training; extra["resumed_from"] names the checkpoint. extra["rolled_back"]:
        each time a retried stage restarted at a checkpoint ({"attempt", "from", "to"}: log steps).
        extra["checkpoint_service_errors"]: connections the driver's checkpoint service (a Hadoop-FS
        checkpoint_dir) refused or lost, at most 100.
        """
        t_start = time.monotonic()
        spec = FitSpec(self.config, self.model, self.optimizer)  # what the stages (fit.py) read
        # one loop of jobs (loop.py): a plain fit's one, the in-job relay's runs again, an elastic fit's re-forms
        return fit_loop(spec, data, features_col, label_col, resume_from, t_start)
