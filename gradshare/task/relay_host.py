"""The relay inside the Spark job (relay="in-job", docs/guide/connect.md): rank 0's task hosts it beside its
worker, so the executors never send to the client.

Rank 0 starts the relay on its executor's address before the stage's first `allGather`, which takes the
address to every task; the relay's status goes to the client's inbox when the client gave one
(transport/sockets/status.py), and its end state (the parameters, their hash, counters, the log's epoch
tallies and incidents) comes back in rank 0's report (`RelayResult`), as the job's result rows. The relay
lives and dies with rank 0's task: a failed stage is not retried by Spark (nothing of the relay would
survive the retry) but restarted by the driver from the last checkpoint (driver/fit.py).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradshare.encoding import apply_update, decode_update
from gradshare.encoding.aggregate import AggregateState
from gradshare.encoding.step_cap import StepCap, step_applier
from gradshare.errors import ProtocolError
from gradshare.reports import Counters, RelayResult, epoch_lines
from gradshare.task.tallies import RollbackPoint, TrainingLog
from gradshare.transport import Relay, RelayTuning
from gradshare.transport.protocol.status_wire import Status
from gradshare.transport.sockets.snapshot_rate import snapshot_options
from gradshare.transport.sockets.status import StatusSender


@dataclass(frozen=True)
class HostedRelay:
    """What rank 0 needs to host the relay: its first state and how it runs (the job's key, id and
    world size are the WorkerConfig's)."""

    # parameters, then float buffers: the model's, or a resumed checkpoint's; None: in `initial_file`
    initial: np.ndarray | None
    n_params: int
    port: int
    bind: str
    tuning: RelayTuning  # without the snapshot options, which depend on the host (relay_options)
    scale: float  # apply scale (aggregate="mean": 1/N)
    aggregator: AggregateState | None
    inbox: tuple[str, int] | None  # the client's StatusInbox; None: the client hears nothing until the end
    resumed: int | None = None  # a resumed fit: the checkpoint's epochs done (the workers load their state)
    # a large state: the .npy file shipped with the session's files (SparkFiles) and its sha256
    initial_file: tuple[str, str] | None = None
    steps_per_epoch: tuple[int, ...] = ()  # per rank: the status's finished epochs (reports.epoch_lines)
    step_cap: StepCap | None = None  # the step cap (encoding/step_cap.py), None: none

    def first_state(self) -> np.ndarray:
        """The initial state: the shipped array, or the shipped file's, checked against its digest."""
        if self.initial is not None:
            return self.initial
        assert self.initial_file is not None
        from pyspark import SparkFiles

        name, digest = self.initial_file
        with open(SparkFiles.get(name), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ProtocolError(
                f"the initial state shipped as {name} does not match its sha256 (a stale or "
                "damaged file of the session)"
            )
        state: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
        return state


class RelayHost:
    """The relay on rank 0's executor and its status sender; `finish` waits for the log and reads the
    end state; `close` stops both (always, in a finally)."""

    def __init__(
        self, plan: HostedRelay, host: str, world_size: int, key: bytes, job_id: int, datagram_size: int, insecure: bool
    ) -> None:
        tuning = RelayTuning(**{**plan.tuning.__dict__, **snapshot_options(host, datagram_size)})
        initial = plan.first_state()
        self.relay = Relay(
            initial,
            world_size=world_size,
            key=key,
            job_id=job_id,
            port=plan.port,
            bind=plan.bind,
            datagram_size=datagram_size,
            insecure=insecure,
            tuning=tuning,
            decode_update=functools.partial(decode_update, n_params=plan.n_params),
            apply_update=functools.partial(apply_update, scale=plan.scale),
            apply_step=step_applier(plan.scale, plan.step_cap),
            observer=TrainingLog(
                None if plan.resumed is None else functools.partial(resume_point, initial, plan.resumed)
            ),
            aggregator=plan.aggregator,
        ).start()
        assert self.relay.address is not None  # start() bound it
        self.address = (host, int(self.relay.address[1]))
        self.steps_per_epoch = plan.steps_per_epoch
        self.sender: StatusSender | None = None
        try:
            if plan.inbox is not None:
                self.sender = StatusSender(self.status, plan.inbox, key, job_id, insecure)
        except BaseException:
            self.relay.close()
            raise

    def status(self) -> Status:
        r = self.relay
        progress = r.progress()
        ranks = progress.get("ranks")
        if isinstance(ranks, dict):  # the bar reads each rank's latest step summary only
            progress["ranks"] = {k: {"meta": v.get("meta")} for k, v in ranks.items() if isinstance(v, dict)}
        lines = epoch_lines(r.epoch_tallies(), self.steps_per_epoch) if self.steps_per_epoch else []
        return Status(
            progress=progress,
            failure=r.failure(),
            reported=r.reported_failure(),
            first_cause=r.first_cause(),
            fatal=r.fatal_incident(),
            epochs=tuple((line.epoch, line.loss, line.val_metric) for line in lines),
        )

    def finish(self, timeout: float) -> RelayResult:
        """Wait (at most `timeout` s) until every rank FINISHED and the log is applied, then read it."""
        r = self.relay
        r.wait_finished(timeout)
        return RelayResult(
            params=r.params,
            param_hash=r.param_hash(),
            counters=Counters.from_dict(r.counters()),
            tallies=r.epoch_tallies(),
            incidents=tuple(r.incidents()),
            rolled_back=tuple(r.rolled_back()),
        )

    def wait_left(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) for every rank's LEAVE, its last acknowledgements received."""
        return self.relay.wait_left(timeout)

    def close(self) -> None:
        try:
            if self.sender is not None:
                self.sender.close()
        finally:
            self.relay.close()


def resume_point(initial: np.ndarray, epochs_done: int, complete_through: int) -> RollbackPoint:
    """The relay's rollback in a resumed fit, as the driver's (driver/checkpoint.rollback_point) answers
    its first attempt: the log starts after the checkpoint (through step -1) at its parameters, and the
    checkpoint's epochs count goes to the workers in WELCOME, which then load their own state from it.
    The stage is never retried in the job, so no later checkpoint is asked for."""
    return -1, initial, 0, float(epochs_done)


def gather_relay(ctx: Any, rank: int, host: RelayHost | None) -> tuple[int, tuple[str, int] | None]:
    """One `allGather` of the stage: (the attempt: the smallest task attempt id, the same on every rank and
    growing with every retry), and the relay's address that rank 0 hosts (None: the client's relay)."""
    mine = {"task": int(ctx.taskAttemptId()), "relay": None if host is None else list(host.address)}
    told = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
    attempt = min(int(m["task"]) for m in told)
    hosted = [m["relay"] for m in told if m["relay"] is not None]
    if not hosted:
        return attempt, None
    address = hosted[0]
    return attempt, (str(address[0]), int(address[1]))


def executor_host(ctx: Any, rank: int) -> str:
    """The host Spark reaches this task's executor at (its BlockManager's address): other executors reach it
    there too."""
    infos = ctx.getTaskInfos()
    address = str(infos[rank].address) if rank < len(infos) else ""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"
