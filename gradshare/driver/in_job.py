"""The fit with the relay inside the Spark job (relay="in-job"; docs/guide/connect.md, "Where the relay runs").

Rank 0's task hosts the relay (task/relay_host.py); this process ships it the first state and how it runs,
follows its status when the executors can reach this process (a `StatusInbox`), and reads the relay's end
state from rank 0's report. Nothing of a relay survives its task, so Spark does not retry the stage: a
failed stage whose cause may pass (a task or executor that died, a timeout, a lost connection) is run
again by the fit's loop (loop.py, `InJobRuns`) from the last checkpoint of this fit, or from scratch
without one; an error a retry would repeat (the user's model, data or code) is raised at once.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import warnings

import numpy as np

from gradshare.checks import is_local
from gradshare.config import TrainConfig
from gradshare.driver.checkpoint import find
from gradshare.driver.fit import worker_config
from gradshare.driver.job import FrameJob, RddJob
from gradshare.driver.plan import FitSpec
from gradshare.driver.records import Outcome, Prepared, RunPlan, Started
from gradshare.driver.reform import JobStart, Reformed, Retry, Stop
from gradshare.driver.relay_setup import join_window, relay_tuning
from gradshare.driver.result import FitResult
from gradshare.driver.session import is_connect
from gradshare.driver.stage import run_stage
from gradshare.errors import CheckpointError, GradshareError
from gradshare.reports import EpochLine
from gradshare.task.checkpoint import MANIFEST
from gradshare.task.relay_host import HostedRelay
from gradshare.task.stores import LocalStore
from gradshare.transport import new_job_key
from gradshare.transport.protocol.status_wire import Status
from gradshare.transport.sockets.status import StatusInbox, StatusReads

INLINE_STATE_BYTES = 16 << 20  # a larger first state is shipped as a file (ship_state)
MAX_RESTARTS = 3  # runs of the stage after the first, as Spark's default stage attempts (4 in all)
# the worker's error types a run of the stage again may pass (task/train.py, is_deterministic)
PASSING_TYPES = frozenset(
    {
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "MemoryError",
        "KeyboardInterrupt",
        "SystemExit",
        "OSError",
        "TimeoutError",
    }
)
# the classes the driver raises for an error of the user's code or data (reports.error_class_name)
USER_CLASSES = frozenset({"TrainingError", "ValueError", "TypeError", "InputTypeError"})


def in_job(config: TrainConfig, data: object) -> bool:
    """Where the relay runs: relay="in-job", or "auto" on a Spark Connect session."""
    return config.network.relay == "in-job" or (config.network.relay == "auto" and is_connect(data))


def check_in_job(config: TrainConfig, resume_from: str | None) -> None:
    """What the in-job relay cannot do, refused before any Spark job, naming the option: a Hadoop-FS
    checkpoint store is written through the driver's checkpoint service, which the tasks may not reach."""
    for name, path in (("checkpoint_dir", config.fault_tolerance.checkpoint_dir), ("resume_from", resume_from)):
        if path is not None and not is_local(str(path)):
            raise ValueError(
                f"{name}={path!r} is a Hadoop-FS URI, written through this process, which the tasks "
                "may not reach with relay='in-job'; give a directory the executors share, or "
                "relay='client'"
            )


class JobRelay(StatusReads):
    """The reads the stage loop (stage.run_stage) makes of a relay, answered from the in-job relay's
    status (`StatusInbox`), or as a relay that heard nothing when its status cannot reach this process."""

    def __init__(self, inbox: StatusInbox | None, host: str | None) -> None:
        self.inbox = inbox
        self.watched = inbox is not None  # FrameJob.check_started: no status, no verdict on slots
        self.address = (
            "the relay in rank 0's task"
            if inbox is None
            else f"the relay in rank 0's task (its status to this client at {host}:{inbox.address[1]})"
        )

    def status(self) -> Status | None:
        return None if self.inbox is None else self.inbox.status()

    def epoch_lines(self) -> list[EpochLine]:
        return [EpochLine(*row) for row in self._read().epochs]


def status_host(job: RddJob | FrameJob, advertise_host: str | None) -> str | None:
    """Where the relay host sends its status: the address the client relay would be reached at, or None
    when no address of this process is known to reach the executors (Connect to a remote server without
    advertise_host: the client then hears nothing until the job ends)."""
    try:
        return job.driver_host(advertise_host)
    except ValueError:
        return None


def run_in_job(spec: FitSpec, prep: Prepared, run: RunPlan) -> Outcome | Retry:
    """The barrier stage with the relay in rank 0's task: its `Outcome` from rank 0's report, or `Retry`
    for a failure a new run of the stage may pass (any other error is raised as it is)."""
    config, net, limits = spec.config, spec.config.network, spec.config.fault_tolerance
    key, job_id = new_job_key(), secrets.randbits(31)
    host = status_host(prep.job, net.advertise_host)
    inbox = None if host is None else StatusInbox(key, job_id, bind=net.bind, insecure=net.insecure)
    relay = JobRelay(inbox, host)
    folder = tempfile.mkdtemp(prefix="gradshare-state-")
    try:
        initial, initial_file = ship_state(prep.job, run.initial, job_id, folder)
        hosted = HostedRelay(
            initial=initial,
            initial_file=initial_file,
            n_params=run.flat.n_params,
            port=config.port,
            bind=net.bind,
            tuning=relay_tuning(config, prep.load_seconds, run.forwarding),
            scale=run.steps.apply_scale,
            step_cap=run.step_cap,
            aggregator=run.aggregator,
            inbox=None if inbox is None else (str(host), inbox.address[1]),
            resumed=None if prep.resume is None else int(prep.resume["epochs_done"]),
            steps_per_epoch=run.steps_per_epoch,
        )
        cfg = worker_config(spec, prep, run, prep.resume, ("", 0), key, job_id, hosted)
        window = join_window(limits.timeout, limits.liveness_timeout, prep.load_seconds)
        ended = run_stage(prep.job, cfg, relay, window, config.verbose, relay.epoch_lines)
    except Exception as e:
        if relay.failure() is None and relay.fatal_incident() is None and restartable(e):
            return Retry(e)
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if inbox is not None:
            inbox.close()
    assert not isinstance(ended, Stop)  # no watch: the stage runs to its end
    reports = ended
    hosts = [r.relay for r in reports if r.relay is not None]
    if len(hosts) != 1:
        raise GradshareError(f"the job's reports hold {len(hosts)} relay results (rank 0's task hosts the relay)")
    end = hosts[0]
    return Outcome(
        reports=[r.with_(relay=None) for r in reports],
        final=end.params,
        relay_hash=end.param_hash,
        counters=end.counters,
        tallies=end.tallies,
        incidents=list(end.incidents),
        rolled_back=[dict(r) for r in end.rolled_back],
        service_errors=[],
        resume=prep.resume,
        statuses=None if inbox is None else inbox.received,
    )


def ship_state(
    job: RddJob | FrameJob, initial: np.ndarray, job_id: int, folder: str, inline: int | None = None
) -> tuple[np.ndarray | None, tuple[str, str] | None]:
    """How the relay's first state reaches rank 0's task: in the job's closure up to INLINE_STATE_BYTES
    (`inline`), else as a .npy file shipped with the session's files, named by the job and checked by its
    sha256 there, so that a large model does not swell the job itself (a Spark Connect plan is one gRPC
    message, 128 MiB at most by default). Spark keeps a shipped file until the session ends."""
    if initial.nbytes <= (INLINE_STATE_BYTES if inline is None else inline):
        return initial, None
    name = f"gradshare-initial-{job_id}.npy"
    path = os.path.join(folder, name)
    np.save(path, initial, allow_pickle=False)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    job.ship_file(path)
    return None, (name, digest)


def restartable(error: BaseException) -> bool:
    """Whether a failed in-job stage may pass when run again: a task that died without a gradshare failure
    record (a killed process or executor), or one whose error was a timeout, a lost connection or memory;
    not the user's model, data or code (nor, checked by the caller, a fatal FAIL or a rank the relay
    gave up on)."""
    failure = getattr(error, "worker_failure", None)
    if failure is None:
        return not isinstance(error, (ValueError, TypeError))
    return failure.error_type in PASSING_TYPES or failure.error_class not in USER_CLASSES


class InJobRuns:
    """The jobs of a fit with the relay in the job (driver/loop.py): the stage run again after a `Retry`, at
    most MAX_RESTARTS times, from this fit's last checkpoint, else from where the fit began (resume_from, or
    scratch), each run again said in a warning and in extra["restarts"]."""

    relay = "in-job"

    def __init__(self, config: TrainConfig, data: object, resume_from: str | None) -> None:
        if not is_connect(data):  # on Connect, job.check_connect refuses the same, naming Connect
            check_in_job(config, resume_from)
        self.config, self.resume_from = config, resume_from
        self.restarts: list[dict[str, str | None]] = []

    def first(self) -> JobStart:
        return JobStart(self.config, self.resume_from)

    def planned(self, prep: Prepared, start: JobStart) -> None:
        pass

    def watch(self, prep: Prepared, started: Started, run: RunPlan) -> None:
        return None  # the relay runs in the stage (run_in_job): no client relay to watch

    def after(self, end: Retry | Reformed, prep: Prepared, run: RunPlan) -> JobStart:
        assert isinstance(end, Retry)  # no watch stops an in-job stage
        if len(self.restarts) >= MAX_RESTARTS:
            raise end.error from end.error.__cause__
        start = restart_point(self.config.fault_tolerance.checkpoint_root, self.resume_from)
        line = str(end.error).splitlines()[0][:300] if str(end.error) else type(end.error).__name__
        self.restarts.append({"error": line, "from": start})
        warnings.warn(
            f"the training stage failed ({line}); running it again (relay='in-job': nothing of the "
            f"relay survives its task) from {start or 'scratch (no checkpoint_dir)'}",
            RuntimeWarning,
            stacklevel=4,
        )
        return JobStart(self.config, start)

    def finish(self, result: FitResult) -> FitResult:
        return result


def restart_point(checkpoint_root: str | None, resume_from: str | None) -> str | None:
    """Where a restarted stage begins: checkpoint_dir when it holds a complete checkpoint of this fit (the
    resume takes its latest), else the fit's own resume_from (None: scratch). A checkpoint the failure cut
    short (an epoch directory without its manifest, written last) is removed first: no fit resumes from
    it, and the restarted fit would refuse to write over it."""
    if checkpoint_root is not None:
        store = LocalStore(checkpoint_root)
        for name in store.list() if store.is_dir() else []:
            if name.startswith("epoch-") and not store.exists(f"{name}/{MANIFEST}"):
                shutil.rmtree(store.where(name), ignore_errors=True)
        try:
            find(store)
            return checkpoint_root
        except (CheckpointError, FileNotFoundError):
            pass
    return resume_from
