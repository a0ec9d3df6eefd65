"""A fit's job as five stages (loop.py runs them, job after job), each a plain function of the trainer's
options (its TrainConfig, or plan.FitSpec where the model or the optimizer factory is read too):

    prepare_data    the Spark job for the data, checkpoints opened, the model built, the pre-pass run and
                    checked, the loss planned on one row, validation shards zipped in (before any training)
    plan_run        the flat state, steps per epoch, the threshold rule, checkpoints and forwarding
    start_relay     the relay (the master), with a fresh job key, on the host the workers reach
    run_job         the barrier stage with one worker per partition; the relay's end state
    collect_result  the replicas checked against the relay, the result model and the merged history
                    (collect.py)

The stages hand each other frozen records (records.py: Prepared, RunPlan, Started, Outcome); the relay is
closed by run_job whatever happens.
"""

from __future__ import annotations

import copy
import functools
import secrets
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from pyspark import RDD
from torch import nn

from gradshare.checks import is_dataframe, is_distributed
from gradshare.config import TrainConfig, check_checkpoint_staleness
from gradshare.config.options import is_calibrated
from gradshare.driver.capacity import check_worker_memory
from gradshare.driver.checkpoint import (
    Manifest,
    job_of,
    open_for_fit,
    plan_for_fit,
    relay_rollback,
    serve_checkpoints,
)
from gradshare.driver.job import FrameJob, RddJob, check_connect, check_rdd, frame_path
from gradshare.driver.plan import (
    FitSpec,
    build_model,
    check_optimizer,
    clipping,
    drop_rule,
    forwarding_for,
    plan_steps,
)
from gradshare.driver.records import Outcome, Prepared, RunPlan, Started
from gradshare.driver.reform import Left, Reformed, Restart, Stop
from gradshare.driver.relay_setup import join_window, relay_tuning
from gradshare.driver.session import check_summaries, dataframe_to_rdd, is_connect
from gradshare.driver.stage import run_stage
from gradshare.driver.validation import check_shards, shards_of, validation_rows, zip_shards
from gradshare.encoding import apply_update, decode_update
from gradshare.encoding.aggregate import AggregateState
from gradshare.encoding.step_cap import StepCap, step_applier
from gradshare.replica.flat import FlatParams, frozen_digest
from gradshare.replica.losses import accuracy, accuracy_sums, plan_loss
from gradshare.reports import Counters, epoch_lines
from gradshare.task.batches import input_names, validation_arrays
from gradshare.task.checkpoint import load_params
from gradshare.task.config import (
    CheckpointPlan,
    DataPlan,
    JobIdentity,
    StepRule,
    UserCode,
    WorkerConfig,
    shipped_runtime,
)
from gradshare.task.config import steps_per_epoch as steps_in
from gradshare.task.partition import summarise_partition
from gradshare.task.relay_host import HostedRelay
from gradshare.task.shipping import pack_user_objects, skeleton
from gradshare.task.tallies import TrainingLog
from gradshare.transport import Relay, new_job_key
from gradshare.transport.sockets.snapshot_rate import snapshot_options


def job_for(
    config: TrainConfig,
    data: object,
    features_col: str | list[str] | None,
    label_col: str | None,
    resume_from: str | None,
) -> RddJob | FrameJob:
    """The Spark side of the fit (job.py): a DataFrame on Spark Connect, or on a classic session
    where it measured faster (job.frame_path), goes through mapInArrow; an RDD as it is."""
    if is_dataframe(data):
        if features_col is None or label_col is None:
            raise ValueError("fit(df) needs features_col= and label_col= naming the DataFrame columns")
        if is_connect(data):
            check_connect(config.validation_data, config.fault_tolerance.checkpoint_root, resume_from)
            return FrameJob(data, features_col, label_col, config.num_workers)
        if frame_path(config.validation_data) and config.elastic is None:  # an elastic fit watches its RDD job
            return FrameJob(data, features_col, label_col, config.num_workers)
        return RddJob(dataframe_to_rdd(data, features_col, label_col), config.num_workers)
    if features_col is not None or label_col is not None:
        raise ValueError(
            "features_col/label_col apply to a DataFrame; an RDD holds (features, label) rows "
            "(features: one array, or a tuple of arrays for several inputs)"
        )
    check_rdd(data)
    return RddJob(data, config.num_workers)


def prepare_data(
    spec: FitSpec,
    data: object,
    features_col: str | list[str] | None,
    label_col: str | None,
    resume_from: str | None,
    restart: Restart | None = None,
) -> Prepared:
    """Everything checked before training: the data, its validation shards, checkpoints, model, loss.
    `restart`: a re-formed elastic job's start (elastic.py)."""
    config = spec.config
    job = job_for(config, data, features_col, label_col, resume_from)
    shards: RDD[tuple[object, object]] | None = None
    if is_distributed(config.validation_data):  # its columns are checked here, before any Spark job
        shards = validation_rows(config.validation_data, data, features_col, label_col)
    if resume_from is not None:
        check_checkpoint_staleness("resume_from", config.compression.staleness)
    # a corrupt checkpoint fails here, before any Spark job
    stores, resume = open_for_fit(
        config.fault_tolerance.checkpoint_root,
        resume_from,
        job.spark_context,
        0 if restart is None else restart.epochs_done,
    )
    model = build_model(spec.model, config.seed)
    check_optimizer(spec.optimizer, config.lr_scheduler, model, config.compression.optimizer_momentum)
    # Pre-pass: barrier slots, then every partition validated and its rows counted (errors come back
    # as data, so the driver names partition and row instead of Spark retrying a failing task).
    timed = job.prepass()
    summaries = [s for s, _ in timed]
    layout = check_summaries(summaries)
    # a model too large for a worker fails here, naming the sizes, not as an executor the OS kills
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    check_worker_memory(trainable, spec.optimizer, job.conf, job.world)
    features, label_kind, label_shape = layout.features, layout.label_kind, layout.label_shape
    # check_summaries raised for any partition with an error, and an empty one is an error
    assert features is not None and label_kind is not None and label_shape is not None
    names = input_names(features, (features_col,) if isinstance(features_col, str) else tuple(features_col or ()))
    plan = plan_loss(
        model,
        layout.sample,
        label_kind,
        layout.labels_whole,
        loss=config.loss,
        train_step=config.train_step,
        label_dtype=config.runtime.label_dtype,
        input_names=names,
        label_range=layout.label_range,
    )
    validation: tuple[tuple[np.ndarray, ...], np.ndarray] | None = None
    if shards is not None:
        assert isinstance(job, RddJob)  # job_for keeps a fit with validation shards on the RDD path
        shards = shards_of(shards, job.world)
        shard_rows = check_shards(
            shards.mapPartitionsWithIndex(lambda i, it: [summarise_partition(i, it)]).collect(), layout, names
        )
        job.training = zip_shards(
            job.rdd, shards, [s.rows for s in sorted(summaries, key=lambda s: s.index)], shard_rows
        )
    elif config.validation_data is not None:
        validation = validation_arrays(config.validation_data, features, plan.label_dtype, label_shape)
    # a train_step hook may call the model its own way: no default metric that calls model(*inputs)
    classes = plan.label_dtype == "int64" and config.train_step is None
    default = accuracy if validation is not None else accuracy_sums if shards is not None else None
    return Prepared(
        job=job,
        summaries=summaries,
        load_seconds=max(seconds for _, seconds in timed),
        features=features,
        model=model,
        plan=plan,
        validation=validation,
        shards=shards is not None,
        metric=config.metric or (default if classes else None),
        stores=stores,
        resume=resume,
    )


def plan_run(config: TrainConfig, prep: Prepared, restart: Restart | None = None) -> RunPlan:
    """The shared state and how the fit runs it: steps per epoch, the rule, checkpoints, forwarding.
    `restart`: a re-formed elastic job's start, from the relay's parameters after `epochs_done` epochs."""
    world, model = prep.job.world, prep.model
    flat = FlatParams(model)  # raises on a model with no trainable parameters
    # parameters, then float buffers: the model's own flat state (NumPy), not a copy. The relay copies it,
    # and nothing on the driver moves it before the fit's end loads the relay's parameters into it
    initial = flat.host_state()
    drop_last = drop_rule(config, model)
    # The job ships a skeleton: the flat state's tensors are meta tensors; the workers take their
    # values from the relay's snapshot (shipping.py: the weights never sit twice in a worker).
    shipped = skeleton(model, flat.tensors)
    rows = {s.index: s.rows for s in prep.summaries}
    steps_per_epoch = tuple(steps_in(rows[r], config.batch_size, drop_last) for r in range(world))
    empty = [r for r in range(world) if steps_per_epoch[r] == 0]
    if empty:
        raise ValueError(
            f"partition {empty[0]} has {rows[empty[0]]} row(s): no batch of batch_size="
            f"{config.batch_size} is left with drop_last={config.runtime.drop_last!r}; repartition the "
            "data or lower batch_size"
        )
    steps_per_epoch = even_steps(steps_per_epoch, rows, config, prep.resume is not None)
    if prep.resume is not None and config.compression.step_cap == "auto":
        # "auto" goes on with the cap its checkpoint's fit ran with (a default may have moved since)
        config = replace(config, compression=replace(config.compression, step_cap=prep.resume["job"].get("step_cap")))
    steps = plan_steps(config, world, max(steps_per_epoch))
    rule, share = steps.rule, steps.cap_share
    # a resumed checkpoint's model and job are checked before its step cap is read for this model
    saving, first_epoch, epochs = checkpoint_plan(config, model, world, steps_per_epoch, prep.resume, share)
    if restart is not None:
        initial, first_epoch, epochs = restart.params, restart.epochs_done, config.epochs - restart.epochs_done
    step_cap = None if share is None else cap_of(share, steps.cap_norm, flat, prep.resume, restart)
    if saving is not None and step_cap is not None:  # this fit's checkpoints keep the cap it runs with
        saving = replace(saving, job={**saving.job, "step_shares": step_cap.to_json()})
    if prep.resume is not None:  # shapes checked by checkpoint_plan, contents by the manifest
        initial = load_params(prep.stores["resume"], prep.resume)
        saved_world = prep.resume["job"]["world_size"]
        if saved_world != world and config.verbose:
            print(
                f"gradshare: resuming {prep.resume['directory']} (written by {saved_world} workers) at {world} "
                "workers: each rank's state is mapped (docs/guide/elastic.md)",
                flush=True,
            )
    # checkpoints hold the replicas' state, not the relay's aggregation residual: "auto" keeps a
    # checkpointed fit per-rank, so that a resumed one stays bit-identical
    checkpointed = config.fault_tolerance.checkpoint_root is not None or prep.resume is not None
    forwarding = forwarding_for(config.network.forwarding, world, checkpointed)
    if checkpointed and forwarding == "aggregate":
        raise ValueError(
            "forwarding='aggregate' cannot be checkpointed or resumed yet (the relay's aggregation "
            "residual is not in the checkpoint); use forwarding='per-rank' or 'auto'"
        )
    aggregator = None
    if forwarding == "aggregate":
        # the relay's τ rule: the workers' calibrated one (same density and warm-up) or the default
        agg_rule = copy.deepcopy(rule) if is_calibrated(rule) else None
        aggregator = AggregateState(flat.n_params, flat.n_buffers, agg_rule)
    return RunPlan(
        flat=flat,
        initial=initial,
        shipped=shipped,
        drop_last=drop_last,
        steps_per_epoch=steps_per_epoch,
        steps=steps,
        clip=clipping(config),
        saving=saving,
        first_epoch=first_epoch,
        epochs=epochs,
        forwarding=forwarding,
        aggregator=aggregator,
        step_cap=step_cap,
        inherited=() if restart is None else restart.notes,
    )


def even_steps(steps: tuple[int, ...], rows: dict[int, int], config: TrainConfig, resumed: bool) -> tuple[int, ...]:
    """A checkpointed or resumed fit's steps per epoch: an epoch's end must be one step of the log, so where
    an even split of the rows left some ranks one batch more than others (a repartition gives partitions
    that differ by one row), every rank runs the fewest; a rank with one more drops its epoch order's last
    batch, a different part of its rows each epoch. Skewed partitions (more than one batch apart) stay as
    they are, and checkpoint_plan refuses them."""
    if (config.fault_tolerance.checkpoint_root is None and not resumed) or max(steps) - min(steps) != 1:
        return steps
    fewest = min(steps)
    if config.verbose:
        dropped = sum(max(rows[r] - fewest * config.batch_size, 0) for r in range(len(steps)))
        print(
            f"gradshare: every rank runs {fewest} steps an epoch (checkpoints need one epoch end for all): "
            f"{dropped} row(s) an epoch beyond those, each rank's last in its epoch order, are not trained",
            flush=True,
        )
    return (fewest,) * len(steps)


def cap_of(
    share: float, norm: str, flat: FlatParams, resume: Manifest | None, restart: Restart | None = None
) -> StepCap:
    """The fit's step cap: ``share`` of each tensor's norm, for the tensors whose norm is not 0 in the model as
    it starts, or the cap a resumed checkpoint's fit or the re-formed job's first had (which tensors are
    capped comes from the training's start, not this job's)."""
    if restart is not None and restart.step_cap is not None:
        return restart.step_cap
    saved = None if resume is None else resume["job"].get("step_shares")
    if saved is not None:
        return StepCap.from_json(saved, flat.n_params)
    return StepCap.of([p.numel() for p in flat.params], flat.array, share, norm)


def checkpoint_plan(
    config: TrainConfig,
    model: nn.Module,
    world: int,
    steps_per_epoch: tuple[int, ...],
    resume: Manifest | None,
    share: float | None = None,
) -> tuple[CheckpointPlan | None, int, int]:
    """(CheckpointPlan or None, epochs done before this fit, epochs this fit runs); a resumed checkpoint's
    model and job checked against this fit's."""
    if config.fault_tolerance.checkpoint_root is None and resume is None:
        return None, 0, config.epochs
    if len(set(steps_per_epoch)) > 1:
        raise ValueError(
            f"checkpoints need the same steps per epoch on every partition (an epoch's end is then "
            f"one step of the log); got {list(steps_per_epoch)}: repartition the data evenly"
        )
    shapes = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    job = job_of(world, steps_per_epoch, config.batch_size, config.seed, shapes, share)
    saving = config.fault_tolerance
    return plan_for_fit(saving.checkpoint_root, saving.checkpoint_every, config.epochs, job, resume)


def start_relay(config: TrainConfig, prep: Prepared, run: RunPlan) -> Started:
    """The relay (the master) with a fresh job key and id, and the host the workers reach it at."""
    key, job_id = new_job_key(), secrets.randbits(31)
    net = config.network
    host = prep.job.driver_host(net.advertise_host)
    tuning = relay_tuning(config, prep.load_seconds, run.forwarding, **snapshot_options(host, net.datagram_size))
    relay = Relay(
        run.initial,
        world_size=prep.job.world,
        key=key,
        job_id=job_id,
        port=config.port,
        bind=net.bind,
        datagram_size=net.datagram_size,
        insecure=net.insecure,
        tuning=tuning,
        decode_update=functools.partial(decode_update, n_params=run.flat.n_params),
        apply_update=functools.partial(apply_update, scale=run.steps.apply_scale),
        apply_step=step_applier(run.steps.apply_scale, run.step_cap),
        observer=TrainingLog(
            relay_rollback(run.saving, prep.resume, prep.stores, run.first_epoch, run.steps_per_epoch)
        ),
        aggregator=run.aggregator,
    )
    relay.inherit(run.inherited)  # a re-formed elastic job's first attempt starts with them
    relay.start()
    return Started(relay, key, job_id, host)


def run_job(
    spec: FitSpec, prep: Prepared, run: RunPlan, started: Started, watch: Callable[[], Stop | None] | None = None
) -> Outcome | Reformed:
    """The barrier stage against the started relay, then the relay's end state; closes the relay (and
    the checkpoint service) whatever happens. `watch`: run_stage's; a job it stops ends `Reformed`, with the
    relay's state as the cancelled job left it."""
    config, limits = spec.config, spec.config.fault_tolerance
    relay, service = started.relay, None
    try:
        saving, resume, service = serve_checkpoints(
            prep.stores, run.saving, prep.resume, started.key, config.network.bind, started.host, limits.timeout
        )
        assert relay.address is not None  # start() bound it
        cfg = worker_config(
            spec,
            prep,
            replace(run, saving=saving),
            resume,
            (started.host, relay.address[1]),
            started.key,
            started.job_id,
        )
        window = join_window(limits.timeout, limits.liveness_timeout, prep.load_seconds)
        reports = run_stage(
            prep.job,
            cfg,
            relay,
            window,
            config.verbose,
            lambda: epoch_lines(relay.epoch_tallies(), run.steps_per_epoch),
            watch,
        )
        if isinstance(reports, Stop):  # the job is cancelled and settled: no task sends any more
            done = relay.complete_through
            return Reformed(reports, Left(relay.params, done, relay.epoch_tallies(), relay.notes_at(done)))
        relay.wait_finished(limits.timeout)
        relay_hash = relay.param_hash()
        counters = Counters.from_dict(relay.counters())
        tallies, incidents, rolled_back = relay.epoch_tallies(), relay.incidents(), relay.rolled_back()
        relay.close()
        # the relay's own array, not a copy of it: one copy of P fewer at the end (a copy if its thread
        # outlived close's join)
        final = relay.params if relay.running else relay.take_params()
    finally:
        relay.close()
        if service is not None:
            service.close()
    # connections the checkpoint service refused or lost (a worker's own failed call raises in it)
    service_errors = [] if service is None else list(service.errors)
    return Outcome(
        reports=reports,
        final=final,
        relay_hash=relay_hash,
        counters=counters,
        tallies=tallies,
        incidents=incidents,
        rolled_back=rolled_back,
        service_errors=service_errors,
        resume=resume,
    )


def worker_config(
    spec: FitSpec,
    prep: Prepared,
    run: RunPlan,
    resume: Manifest | None,
    relay_address: tuple[str, int],
    key: bytes,
    job_id: int,
    hosted: HostedRelay | None = None,
) -> WorkerConfig:
    """What every task gets in the job's closure, the user's objects cloudpickled (shipping.py). `hosted`:
    the relay runs in rank 0's task (relay="in-job"), which tells the others its address."""
    config = spec.config
    return pack_user_objects(
        WorkerConfig(
            job=JobIdentity(relay_address, key, job_id, prep.job.world, hosted),
            user=UserCode(
                model=run.shipped,
                optimizer=spec.optimizer,
                loss=getattr(prep.plan.step, "loss", None),
                train_step=prep.plan.step,
                lr_scheduler=config.lr_scheduler,
                metric=prep.metric,
                on_epoch_end=config.runtime.callbacks,
            ),
            rule=StepRule(
                threshold_rule=run.steps.rule,
                residual_clip=run.clip,
                lr_factor=run.steps.lr_factor,
                momentum_ceiling=run.steps.momentum_ceiling,
                apply_scale=run.steps.apply_scale,
                step_cap=run.step_cap,
            ),
            data=DataPlan(
                steps_per_epoch=run.steps_per_epoch,
                epochs=run.epochs,
                batch_size=config.batch_size,
                seed=config.seed,
                label_dtype=prep.plan.label_dtype,
                rows=tuple(s.rows for s in sorted(prep.summaries, key=lambda s: s.index)),
                drop_last=run.drop_last,
                validation=prep.validation,
                shards=prep.shards,
                first_epoch=run.first_epoch,
            ),
            compression=config.compression,
            network=config.network,
            fault_tolerance=config.fault_tolerance,
            runtime=shipped_runtime(config.runtime),
            early_stopping=config.stopping,
            checkpoint=run.saving,
            resume=resume,
            n_state=int(run.initial.size),
            frozen_digest=frozen_digest(prep.model),
        )
    )
