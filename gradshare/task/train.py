"""The Spark barrier task's body (`train_partition`): materialise the partition, join the relay
(resuming where it says), build the Worker (worker.py), train, report; and a failure's way to the
driver."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from pyspark import BarrierTaskContext, SparkFiles

from gradshare.errors import GradshareError, ProtocolError, TrainingError
from gradshare.replica.flat import FlatParams
from gradshare.reports import Counters, WorkerFailure, WorkerReport
from gradshare.task.checkpoint import load_rank, manifest_for
from gradshare.task.config import WorkerConfig
from gradshare.task.memory import proc_status_bytes, release_free_memory, reset_peak_rss
from gradshare.task.partition import PartitionData
from gradshare.task.relay_host import RelayHost, executor_host, gather_relay
from gradshare.task.shipping import materialize, unpack_user_objects
from gradshare.task.spill import SpilledPartition
from gradshare.task.validation import split_rows
from gradshare.task.worker import Worker
from gradshare.transport import Peer, param_hash
from gradshare.transport.sockets.peer import LINGER

# where this task imported gradshare from (its report's `package`): gradshare/, two levels above this
# module. Not `gradshare.__file__`: importing the package root, which names the driver's trainer for its
# lazy re-exports, made the task and the driver an import cycle.
PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))

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
    host = None  # relay="in-job": rank 0 hosts the relay (relay_host.py)
    try:
        if cfg.job.hosted is not None and rank == 0:
            host = RelayHost(
                cfg.job.hosted,
                executor_host(ctx, rank),
                cfg.job.world_size,
                cfg.job.key,
                cfg.job.job_id,
                cfg.network.datagram_size,
                cfg.network.insecure,
            )
        # Python sees no stage-attempt number; the smallest task id of this stage attempt is the same on
        # every rank and grows with every retry, which is all the relay needs of `attempt`.
        attempt, hosted_at = gather_relay(ctx, rank, host)
        if hosted_at is not None:
            cfg = replace(cfg, job=replace(cfg.job, relay_address=hosted_at))
        report = _attempt(cfg, ctx, rank, attempt, rows)
        if host is not None:  # the relay goes with this task: the log complete, and every rank gone from it
            report = report.with_(relay=host.finish(cfg.fault_tolerance.timeout))
            # not a barrier(): Spark answers one in whole seconds (measured 1.0 s each, local[2])
            host.wait_left(min(cfg.fault_tolerance.timeout, LINGER + 1.0))
        return [report]
    finally:
        if host is not None:
            host.close()


def _attempt(cfg: WorkerConfig, ctx: BarrierTaskContext, rank: int, attempt: int, rows: Iterator[Any]) -> WorkerReport:
    """One rank's training in this stage attempt, its failure reported and raised with the rank named."""
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
    return report.with_(
        attempt=attempt,
        pid=os.getpid(),
        package=PACKAGE_DIR,
        start_rss_bytes=start_rss,
        peak_rss_bytes=proc_status_bytes("VmHWM"),
    )


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
        peer = Peer(
            cfg.job.relay_address,
            rank=failure.rank,
            world_size=cfg.job.world_size,
            attempt=failure.attempt,
            key=cfg.job.key,
            job_id=cfg.job.job_id,
            n_params=1,
            datagram_size=cfg.network.datagram_size,
            timeout=cfg.fault_tolerance.timeout,
            insecure=cfg.network.insecure,
        )
    except (OSError, ValueError):
        return
    try:
        wait = min(cfg.fault_tolerance.timeout, FAIL_REPORT_SECONDS if fatal else REPORT_SECONDS)
        peer.report_failure(
            failure.error_type,
            failure.message,
            wait,
            fatal=fatal,
            step=-1 if failure.step is None else failure.step,
            error_class=failure.error_class,
            cause=failure.cause or "",
        )
    finally:
        peer.close(linger=0.0, leave=False)


def _run(
    cfg: WorkerConfig, rank: int, attempt: int, rows: Iterator[Any], position: TaskPosition | None = None
) -> WorkerReport:
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
            return PartitionData.from_rows(
                part,
                cfg.data.label_dtype,
                spill_bytes=cfg.network.spill_bytes,
                index=rank,
                spill_dir=SparkFiles.getRootDirectory(),
            )

        if cfg.data.shards:  # (training row, validation rows) pairs: both read in one pass (validation.py)
            data, shard = split_rows(rows, read, read, cfg.fault_tolerance.timeout)
        else:
            data = read(rows)
        # the rows the pre-pass counted (not the steps: a checkpointed fit may run fewer than they fill,
        # fit.even_steps)
        if len(data) != cfg.data.rows[rank]:
            raise ValueError(
                f"partition {rank} has {len(data)} rows now but had a different count in the "
                "driver's pre-pass: the input RDD is not deterministic (cache or checkpoint it)"
            )
        # the shipped model is a skeleton: this task owns it, nothing is copied (values: from the relay)
        worker = Worker(cfg, rank, data, model=materialize(cfg.code.model))
        if position is not None:
            position.worker = worker
        if cfg.data.shards:
            worker.scoring.shard, worker.scoring.gather = shard, BarrierTaskContext.get().allGather
        if peer is None:
            peer = _new_peer(cfg, rank, attempt, worker.flat.n_state)
        elif worker.flat.n_state != cfg.n_state:
            raise ProtocolError(
                f"rank {rank}'s model has {worker.flat.n_state} state entries; the driver's has {cfg.n_state}"
            )
        info = peer.join(cfg.fault_tolerance.timeout)
        start = int(info.start_step)
        # the initial parameters (start 0) or, in a retried stage, the relay's current ones
        t_load = time.monotonic()
        _load_from_relay(peer, worker.flat, start, cfg.fault_tolerance.timeout)
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
            spilled=data.spilled,
        )
        if cfg.data.shards:  # this rank's validation shard: rows, and whether they went to a spill file
            report = report.with_(
                validation_rows=0 if shard is None else len(shard),
                validation_spilled=False if shard is None else shard.spilled,
            )
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
    return Peer(
        cfg.job.relay_address,
        rank=rank,
        world_size=cfg.job.world_size,
        attempt=attempt,
        key=cfg.job.key,
        job_id=cfg.job.job_id,
        n_params=n_state,
        datagram_size=cfg.network.datagram_size,
        timeout=cfg.fault_tolerance.timeout,
        insecure=cfg.network.insecure,
    )


def _load_from_relay(peer: Peer, flat: FlatParams, start: int, timeout: float) -> None:
    """Download the relay's state (parameters, float buffers) straight into the flat buffer (no second
    copy of the model)."""
    host = flat.state if isinstance(flat.state, np.ndarray) else None  # a device state takes a host copy
    step, values = peer.fetch_snapshot(timeout, into=host)  # first (flat.load)
    if step != start - 1:
        raise ProtocolError(
            f"the relay's snapshot holds the log through step {step}; rank {peer.rank} "
            f"starts at step {start} and needs it through {start - 1}"
        )
    if host is None:
        flat.load(values)
    else:  # the twin must equal P between steps; the folded point: P + s·r with r = 0, a fresh start
        flat.sync_followers()
