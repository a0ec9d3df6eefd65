"""The fit's Spark side, two ways: over an RDD (`RddJob`) or over a DataFrame with no RDD (`FrameJob`).

Both run the same two stages (docs/design.md, "Spark"): a pre-pass that validates every partition and
counts its rows, then ONE barrier stage with one worker per partition whose tasks return their
`WorkerReport`. `SharedTrainer.fit` drives either through the same methods (`prepass`, `driver_host`,
`collect`, `cancel`, `settle`, `check_started`).

- `RddJob`: ``rdd.mapPartitionsWithIndex`` for the pre-pass, ``rdd.barrier().mapPartitions`` for the
  stage, cancelled by job group; slots are checked through the SparkContext before anything runs. An
  RDD, or a DataFrame on a classic session (``df.select(...).rdd``) where that measured faster.
- `FrameJob`: ``df.select(*features, label).mapInArrow(fn, schema[, barrier=True])``: each task reads
  its partition as Arrow record batches (arrow_rows.py) and returns its result as rows. It touches no
  SparkContext, so it is the path on a Spark Connect session, which has none. The job is cancelled by
  an operation tag; Connect cannot count free task slots, so a local master's slots are checked from
  its conf and for any other master the fit gives up with a clear error when no worker has reached the
  relay within the join window (`check_started`).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gradshare.checks import is_distributed, is_local
from gradshare.driver.session import busy_slots, check_barrier_slots, feature_columns, is_connect
from gradshare.errors import TransportTimeout
from gradshare.reports import WorkerReport
from gradshare.task.arrow_rows import RESULT_SCHEMA, read_results, summarise_batches, train_batches
from gradshare.task.config import WorkerConfig
from gradshare.task.partition import PartitionSummary, summarise_partition
from gradshare.task.train import train_partition

T = TypeVar("T")
# A DataFrame on a classic session goes through FrameJob (mapInArrow) when True, else through
# df.select(...).rdd as before; set from the rows/s measured side by side (docs/benchmarks/dataframe.md).
# Measured 2.1-2.7x the rows/s of the RDD path in two runs (10,000 rows of 1,024 doubles, 2 partitions,
# array or vector column, pre-pass and materialisation alike), so a classic session's DataFrames take it too.
FRAME_PATH_CLASSIC = True
Timed = list[tuple[PartitionSummary, float]]  # per partition: its summary, seconds its read took


def _timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """(fn(*args), seconds it took): the pre-pass reports each partition's read time."""
    t0 = time.monotonic()
    return fn(*args), time.monotonic() - t0


class RddJob:
    """The pre-pass and the barrier stage over an RDD of (features, label) rows."""

    def __init__(self, rdd: Any, num_workers: int | None) -> None:
        if num_workers is not None and num_workers != rdd.getNumPartitions():
            # Always a shuffle: Spark refuses a barrier stage over a coalesced RDD, whose parent has
            # another partition count (SPARK-24820), so coalesce(n) would fail once the job starts.
            rdd = rdd.repartition(num_workers)
        self.rdd = self.training = rdd  # `training`: what the stage runs over (fit may zip validation shards in)
        self.spark_context = rdd.context
        self.world: int = rdd.getNumPartitions()
        self.group = ""

    def conf(self, key: str) -> str | None:
        """The session's Spark configuration value for ``key`` (None: not set)."""
        value: str | None = self.spark_context.getConf().get(key)
        return value

    def prepass(self) -> Timed:
        """Check the barrier slots, then validate every partition and count its rows (errors come back
        as data, so the driver names partition and row instead of Spark retrying a failing task)."""
        check_barrier_slots(self.spark_context, self.world)
        timed: Timed = self.rdd.mapPartitionsWithIndex(lambda i, it: [_timed(summarise_partition, i, it)]).collect()
        return timed

    def driver_host(self, advertise_host: str | None) -> str:
        return advertise_host or str(self.spark_context.getConf().get("spark.driver.host", "127.0.0.1"))

    def thread(self, target: Callable[[], None]) -> threading.Thread:
        from pyspark import InheritableThread  # the job group is a property of the JVM thread

        return InheritableThread(target=target, name="gradshare-fit", daemon=True)

    def collect(self, cfg: WorkerConfig) -> list[WorkerReport]:
        self.group = f"gradshare-{cfg.job.job_id}"
        self.spark_context.setJobGroup(self.group, "gradshare SharedTrainer.fit", interruptOnCancel=True)
        task = functools.partial(train_partition, cfg)
        reports: list[WorkerReport] = retried(self.training.barrier().mapPartitions(task), cfg).collect()
        return reports

    def check_started(self, relay: Any, elapsed: float, window: float) -> None:
        """Slots were counted before the stage: nothing to watch."""

    def ship_file(self, path: str) -> None:
        """A file every task can read by its name (SparkFiles.get)."""
        self.spark_context.addFile(path)

    def cancel(self) -> None:
        self.spark_context.cancelJobGroup(self.group)

    def settle(self, timeout: float) -> None:
        """After cancelling: wait (at most `timeout` s) until none of the job's stages still runs tasks.
        Spark fails the job at once but kills its tasks a moment later; a fit started right after a
        failure would find their slots busy."""
        tracker = self.spark_context.statusTracker()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stages = {
                s
                for j in tracker.getJobIdsForGroup(self.group)
                if (info := tracker.getJobInfo(j)) is not None
                for s in info.stageIds
            }
            running = [tracker.getStageInfo(s) for s in stages & set(tracker.getActiveStageIds())]
            if not any(info is not None and info.numActiveTasks for info in running):
                return
            time.sleep(0.1)


class FrameJob:
    """The pre-pass and the barrier stage over a DataFrame's columns, through mapInArrow (no RDD)."""

    def __init__(
        self, df: Any, features_col: str | list[str] | tuple[str, ...], label_col: str, num_workers: int | None
    ) -> None:
        cols = feature_columns(df, features_col, label_col)
        self.names = (*cols, label_col)  # the columns the tasks read, in order
        self.multi = not isinstance(features_col, str)
        frame = df.select(*cols, label_col)
        if num_workers is not None:
            # a round-robin shuffle, sorted first by default (spark.sql.execution.sortBeforeRepartition),
            # so the pre-pass and the stage see the same rows in the same partitions
            frame = frame.repartition(num_workers)
        self.frame, self.session = frame, df.sparkSession
        # the job never uses it; a classic session's serves its slot count and a Hadoop-FS checkpoint
        # store; on Connect there is none (check_connect refused what would need one)
        self.spark_context = None if is_connect(df) else df.sparkSession.sparkContext
        self.world = 0  # known after the pre-pass: Connect has no getNumPartitions
        self.tag = ""

    def conf(self, key: str) -> str | None:
        """The session's Spark configuration value for ``key`` (None: not set, or not readable on Connect)."""
        return _conf(self.session, key)

    def prepass(self) -> Timed:
        rows = self.frame.mapInArrow(
            functools.partial(summarise_batches, self.names, self.multi), RESULT_SCHEMA
        ).collect()
        timed: Timed = [read_results(rows)[p] for p in sorted(read_results(rows))]
        self.world = len(timed)
        self._check_local_slots()
        return timed

    def _check_local_slots(self) -> None:
        """A classic session: its SparkContext's count of free slots, as RddJob. Connect: a local[N] master
        has N slots (÷ spark.task.cpus), readable from the session's conf; any other master's free slots
        are not visible to a Connect client (`check_started` watches instead)."""
        if self.spark_context is not None:
            check_barrier_slots(self.spark_context, self.world)
            return
        master = _conf(self.session, "spark.master") or ""
        cores = master[len("local[") : -1] if master.startswith("local[") and master.endswith("]") else ""
        if not cores.isdigit() and master != "local":
            return
        slots = (int(cores) if cores.isdigit() else 1) // max(int(_conf(self.session, "spark.task.cpus") or 1), 1)
        if slots < self.world:
            raise ValueError(
                f"not enough task slots for the barrier stage: {self.world} workers (the DataFrame's "
                f"partitions) need {self.world} slots, but master {master!r} has {slots}; "
                "use fewer partitions (num_workers) or more cores"
            )

    def driver_host(self, advertise_host: str | None) -> str:
        if advertise_host:
            return advertise_host
        if not is_connect(self.frame):
            return _conf(self.session, "spark.driver.host") or "127.0.0.1"
        # Connect: the relay runs in this client, which Spark knows nothing about. The executors of a
        # local master on a server at a loopback address run on this machine and reach it there.
        server = getattr(getattr(self.session.client, "_builder", None), "host", None)
        master = _conf(self.session, "spark.master") or ""
        if server is not None and _loopback(str(server).strip("[]")) and master.startswith("local"):
            return "127.0.0.1"
        raise ValueError(
            f"advertise_host= is needed on this Spark Connect session (server {server!r}, master "
            f"{master!r}): the relay runs in this client, and only a local master on a server on this "
            "machine is known to reach it; pass an address of this machine that the executors can "
            "send UDP to"
        )

    def thread(self, target: Callable[[], None]) -> threading.Thread:
        return threading.Thread(target=target, name="gradshare-fit", daemon=True)

    def collect(self, cfg: WorkerConfig) -> list[WorkerReport]:
        self.tag = f"gradshare-{cfg.job.job_id}"
        self.session.addTag(self.tag)  # tags are per thread: this one's operations carry it
        try:
            stage = self.frame.mapInArrow(
                functools.partial(train_batches, cfg, self.names, self.multi), RESULT_SCHEMA, barrier=True
            )
            rows = retried(stage, cfg).collect()
        finally:
            self.session.removeTag(self.tag)
        reports = read_results(rows)
        return [r for p in sorted(reports) for r in reports[p]]

    def check_started(self, relay: Any, elapsed: float, window: float) -> None:
        """No task of the stage reached the relay `window` s after the job began: too few free slots (the
        barrier stage waits for all of them), or executors that cannot reach the relay. A relay in the job
        whose status cannot reach this client (`watched` false) tells nothing: Spark's own barrier slot
        check then fails the job."""
        if getattr(relay, "watched", True) and elapsed > window and int(relay.progress().get("attempt", -1)) < 0:
            raise TransportTimeout(
                f"no worker of the barrier stage reached the relay within {window:.0f} s (the join window): the "
                f"cluster may have fewer than {self.world} free task slots (a Spark Connect client cannot count "
                f"them), or the executors cannot reach the relay at {relay.address} (advertise_host, port)"
            )

    def cancel(self) -> None:
        self.session.interruptTag(self.tag)

    def ship_file(self, path: str) -> None:
        """A file every task can read by its name (SparkFiles.get): a Connect session's artifact, a classic
        one's SparkContext file."""
        if self.spark_context is not None:
            self.spark_context.addFile(path)
        else:
            self.session.addArtifacts(path, file=True)

    def settle(self, timeout: float) -> None:
        """After cancelling, on a classic session: wait (at most `timeout` s) until no stage runs tasks (a
        tag names no job group to narrow it to). Connect has no status tracker: the interrupt is all."""
        deadline = time.monotonic() + timeout
        while self.spark_context is not None and busy_slots(self.spark_context) and time.monotonic() < deadline:
            time.sleep(0.1)


def retried(stage: T, cfg: WorkerConfig) -> T:
    """The barrier stage as Spark runs it. With the relay in the driver, a shuffle after it: that makes it
    a shuffle-map stage, which Spark retries as a whole when a task dies (a barrier *result* stage is
    never retried), and the relay's log resumes the retry. With the relay in rank 0's task nothing of the
    relay survives a failed attempt: the result stage fails the job, and the driver runs it again from
    the last checkpoint (in_job.py)."""
    if cfg.job.hosted is not None:
        return stage
    return stage.repartition(1)  # type: ignore[attr-defined, no-any-return]


def _conf(session: Any, key: str) -> str | None:
    try:
        value = session.conf.get(key, None)
    except Exception:  # noqa: BLE001 - a static conf a session does not expose
        return None
    return None if value is None else str(value)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0][4][0]).is_loopback
    except (OSError, ValueError):
        return False


def frame_path(validation_data: object) -> bool:
    """Whether a DataFrame on a classic session goes through FrameJob: FRAME_PATH_CLASSIC, unless
    validation shards must zip into its RDD (validation.py) or pandas/pyarrow (mapInArrow's) are missing."""
    from importlib.util import find_spec

    return (
        FRAME_PATH_CLASSIC
        and not is_distributed(validation_data)
        and find_spec("pyarrow") is not None
        and find_spec("pandas") is not None
    )


def check_connect(validation_data: object, checkpoint_dir: str | None, resume_from: str | None) -> None:
    """What a fit on a Spark Connect session cannot do yet, refused before any Spark job, naming the option."""
    if is_distributed(validation_data):
        raise ValueError(
            "validation_data as a DataFrame or RDD (scored in shards on every worker) does not work on a "
            "Spark Connect session yet: its shards ride in the training RDD, and Connect has no RDDs; "
            "pass an in-memory (X, y) pair (e.g. from val_df.toPandas()), scored by rank 0"
        )
    for name, path in (("checkpoint_dir", checkpoint_dir), ("resume_from", resume_from)):
        if path is not None and not is_local(str(path)):
            raise ValueError(
                f"{name}={path!r} is a Hadoop-FS URI, written through the driver's SparkContext, which a "
                f"Spark Connect client does not have; on Connect give {name} a local directory the "
                "executors share"
            )


def check_rdd(data: object) -> None:
    """fit(rdd): an RDD of a live SparkContext, on a classic session; otherwise say what to pass instead."""
    from pyspark import RDD
    from pyspark.sql.utils import is_remote

    alternative = (
        "pass a DataFrame instead: fit(df, features_col=..., label_col=...) trains over mapInArrow, "
        "without RDDs (docs/guide/connect.md)"
    )
    if not isinstance(data, RDD):
        raise TypeError(
            f"fit() takes a pyspark RDD of (features, label) rows or a DataFrame, got "
            f"{type(data).__name__}; on Spark Connect, which has no RDDs, {alternative}"
        )
    if is_remote():
        raise ValueError(
            f"fit(rdd) with a Spark Connect session active: Connect has no RDDs or SparkContext; {alternative}"
        )
    if getattr(data.context, "_jsc", None) is None:
        raise ValueError(f"fit(rdd): the RDD's SparkContext is stopped; {alternative}")
