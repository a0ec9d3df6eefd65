"""The relay (master) as a background thread around :class:`RelayCore` (a thin I/O shell: the core decides).

The thread only moves datagrams between the socket and the core, arms one timer, and hands events to
waiters. Every public accessor takes the core's lock, so ``params``/``counters`` are consistent snapshots.
What the shell knows of the job (failures, incidents, rollbacks, whether the log is complete) it learns
from the core's events, and it asks the core only through its methods.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, cast

import numpy as np
from numpy.typing import NDArray

from gradshare.errors import GradshareError, TransportTimeout
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.relay.liveness import MAX_INCIDENTS
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE, DEFAULT_PORT
from gradshare.transport.sockets import quiet_gc, udp

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack  # in typing from Python 3.11 on; 3.10 is supported

    # the encoding package loads Numba: the transport imports it where used (relay/core.py, its seam)
    from gradshare.encoding.aggregate import AggregateState
    from gradshare.transport.protocol.relay.attempt import Decoded
    from gradshare.transport.protocol.relay.observer import LogObserver


class RelayPlugins(TypedDict, total=False):
    """RelayCore's plug-ins, which Relay hands on unchanged (their meaning and defaults: RelayCore)."""

    decode_update: Callable[[bytes, int], Decoded]
    apply_update: Callable[[Decoded, NDArray[np.float32]], None]
    apply_step: Callable[[list[Decoded], NDArray[np.float32]], None] | None
    observer: LogObserver | None
    aggregator: AggregateState | None


DRAIN_BATCH = 512
MAX_WAIT = 0.02


class Relay:
    """``Relay(params, world_size=W, key=key, job_id=J, port=0).start()``; a context manager."""

    def __init__(
        self,
        initial_params: np.ndarray,
        world_size: int,
        key: bytes | None,
        job_id: int | str,
        port: int = DEFAULT_PORT,
        bind: str = "0.0.0.0",
        datagram_size: int = DEFAULT_DATAGRAM_SIZE,
        insecure: bool = False,
        tuning: RelayTuning = RelayTuning(),
        **plugins: Unpack[RelayPlugins],
    ) -> None:
        """tuning: the core's tunables (tuning.RelayTuning); plugins: RelayCore's update codec, training
        observer and aggregator, handed on unchanged. The shell applies after sending
        (RelayCore's defer_apply)."""
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (got {port!r})")
        self._core = RelayCore(
            initial_params,
            world_size,
            key,
            job_id,
            now=time.monotonic(),
            datagram_size=datagram_size,
            insecure=insecure,
            tuning=tuning,
            defer_apply=True,
            **plugins,
        )
        self._port, self._bind = port, bind
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._io_drops: Counter[str] = Counter()
        # what the events said: the log is complete (this attempt), the ranks ended in it, each rank's
        # latest FAIL (first reporter first), the first incidents, the rollbacks
        self._world_size = world_size
        self._log_complete = False
        self._ended: set[int] = set()
        self._failures: dict[int, ev.Fail] = {}  # fatal FAILs: the driver stops the job
        self._reports: dict[int, ev.Fail] = {}  # every FAIL, in arrival order (one per rank, the latest)
        self._incidents: list[ev.Incident] = []
        self._rolled_back: list[dict[str, int]] = []
        self.address: tuple[str, int] | None = None
        self._holds_gc = False

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Relay:
        if self._thread is not None:
            raise GradshareError("relay already started")
        self._sock = udp.open_udp(self._bind, self._port, "relay")
        try:
            # A snapshot burst must fit a peer's receive buffer; peers ask the kernel for the same size
            # as we do (udp.py), so ours is the best guess of theirs. Linux reports twice the payload it
            # holds (the rest is bookkeeping): a quarter leaves room for two concurrent transfers' bursts.
            rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            with self._lock:
                self._core.cap_snapshot_burst(max(rcvbuf // 4, 1 << 16))
            host, port = self._sock.getsockname()[:2]
            self.address = (host, port)
            self._thread = threading.Thread(target=self._run, name=f"gradshare-relay-{port}", daemon=True)
            quiet_gc.hold()  # a full collection would stall every rank's step (quiet_gc.py)
            self._holds_gc = True
            self._thread.start()
        except BaseException:
            self._release_gc()
            self._sock.close()
            raise
        return self

    def _release_gc(self) -> None:
        if self._holds_gc:
            self._holds_gc = False
            quiet_gc.release()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._sock is not None:
            self._sock.close()
        self._release_gc()

    def __enter__(self) -> Relay:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the I/O loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        core, sock, lock, drops = self._core, self._sock, self._lock, self._io_drops
        assert sock is not None  # start() opened it before starting this thread
        try:
            while not self._stop.is_set():
                udp.wait_for_work(sock, lock, core, MAX_WAIT)
                for run, addr in udp.received(sock, drops, DRAIN_BATCH):
                    self._feed(run, addr)
                with lock:
                    out = self._settle_locked()
                udp.send_all(sock, out, drops)
        except BaseException as exc:  # the thread must not die silently: waiters re-raise this
            with lock:
                self._failure = exc
                self._changed.notify_all()

    def _feed(self, run: list[bytes], addr: ev.Address) -> None:
        """The datagrams of one read (one, or a GSO run of one rank's): under the lock up to the first that
        leaves something to send or apply, then forward at once (latency before batching)."""
        core, sock, lock, drops = self._core, self._sock, self._lock, self._io_drops
        assert sock is not None  # _run's: start() opened it
        i = 0
        while i < len(run):
            with lock:
                i = core.receive_run(run, i, addr, time.monotonic())
                out = core.datagrams_to_send()
                due = core.apply_due
                self._take_events_locked()
            if out:
                udp.send_all(sock, out, drops)
            if due:
                # applied once its forwards left and before the next datagram is read: the applied log then
                # trails what the ranks run on by the staleness rule's steps, and a slow apply slows the ranks
                # (back-pressure) instead of letting them run up to a drain batch ahead of it
                with lock:
                    out = self._settle_locked()
                udp.send_all(sock, out, drops)

    def _settle_locked(self) -> list[tuple[bytes, ev.Address]]:
        """(Lock held.) Apply what completed to the authoritative copy (after the forwards left), run the
        timer if it is due (so that a drain kept busy by applies still trims and repairs); what to send."""
        core = self._core
        core.apply_pending()
        now = time.monotonic()
        if now >= core.next_timer():
            core.handle_timer(now)
        out = core.datagrams_to_send()
        self._take_events_locked()
        return out

    def _take_events_locked(self) -> None:
        """(Lock held.) Act on the core's events and wake the waiters if there were any."""
        changed = False
        while (e := self._core.next_event()) is not None:
            changed = True
            if isinstance(e, ev.LogComplete):
                self._log_complete = True
            elif isinstance(e, ev.AttemptStarted):  # a new attempt's log starts over
                self._log_complete = False
                self._ended.clear()
            elif isinstance(e, ev.PeerEnded):
                self._ended.add(e.rank)
            elif isinstance(e, ev.PeerFailed):
                fail = ev.Fail(e.rank, e.attempt, e.error_type, e.message, e.step, e.fatal, e.error_class, e.cause)
                # a newer attempt's report of a rank replaces its older one (at most one per rank)
                self._reports.pop(e.rank, None)
                self._reports[e.rank] = fail
                if e.fatal:
                    self._failures[e.rank] = fail
            elif isinstance(e, ev.Incident):
                if len(self._incidents) < MAX_INCIDENTS:
                    self._incidents.append(e)
            elif isinstance(e, ev.RolledBack):
                self._rolled_back.append({"attempt": e.attempt, "from": e.from_step, "to": e.to_step})
        if changed:
            self._changed.notify_all()

    def _check(self) -> None:
        if self._failure is not None:
            raise GradshareError(f"relay thread failed: {self._failure!r}") from self._failure

    # --- accessors ----------------------------------------------------------------------------------
    @property
    def params(self) -> NDArray[np.float32]:
        with self._lock:
            return self._core.copy_params()

    @property
    def running(self) -> bool:
        """Whether the relay's I/O thread is alive (started, and not stopped by `close`)."""
        return self._thread is not None and self._thread.is_alive()

    def take_params(self) -> NDArray[np.float32]:
        """The authoritative parameters handed over without a copy, once the relay is closed: the relay
        then holds none (its `params` and `param_hash` fail), so the fit's end holds P once less."""
        if self.running:
            raise GradshareError("take_params needs a closed relay: close() it first")
        with self._lock:
            return self._core.take_params()

    @property
    def complete_through(self) -> int:
        with self._lock:
            return self._core.complete_through

    def param_hash(self) -> str:
        with self._lock:
            return self._core.param_hash()

    def progress(self) -> dict[str, object]:
        with self._lock:
            return self._core.progress()

    def counters(self) -> ev.Counters:
        with self._lock:
            d = self._core.counters()
            core_drops = cast("dict[str, int]", d["drops"])  # counters() puts the core's drops there
            d["drops"] = dict(Counter(core_drops) + self._io_drops)
            return d

    def failure(self) -> ev.Fail | None:
        """The first fatal FAIL a worker reported (a deterministic error: its rank, attempt, error type
        and message), or None."""
        with self._lock:
            return next(iter(self._failures.values()), None)

    def reported_failure(self) -> ev.Fail | None:
        """The first FAIL, fatal or not, that a rank of the latest attempt that reported any sent: the
        error the failed job's task raised, as the worker saw it (reports.WorkerFailure), or None."""
        with self._lock:
            if not self._reports:
                return None
            latest = max(f.attempt for f in self._reports.values())
            return next(f for f in self._reports.values() if f.attempt == latest)

    def first_cause(self) -> ev.Incident | None:
        """The earliest incident (suspicion, cut, give-up) that still explains a failure."""
        with self._lock:
            return ev.first_cause(self._incidents)

    def fatal_incident(self) -> ev.Incident | None:
        """The first incident after which the relay gave up on a rank (silent past give_up_after, stuck
        past step_timeout): the driver stops the job with it."""
        with self._lock:
            return ev.first_fatal(self._incidents)

    def incidents(self) -> list[ev.Incident]:
        with self._lock:
            return list(self._incidents)

    def inherit(self, notes: tuple[tuple[str, float], ...]) -> None:
        """Before start: rank 0's epoch-end state (AttemptNotes) as if the log held it before its first step,
        so the first attempt's WELCOME hands it on (a re-formed elastic job goes on with the rule's state)."""
        with self._lock:
            self._core.inherit_notes(notes)

    def notes_at(self, step: int) -> tuple[tuple[str, float], ...]:
        """Rank 0's epoch-end state as the log holds it through `step` (the observer's): what a job
        that starts after it inherits; () without a training observer."""
        with self._lock:
            return self._core.notes_at(step)

    def epoch_tallies(self) -> dict[tuple[int, int], dict[str, float | None]]:
        """(rank, epoch) -> what the applied log says about it (the observer's; {} without one)."""
        with self._lock:
            return self._core.epoch_tallies()

    def rolled_back(self) -> list[dict[str, int]]:
        """Each time a retried stage restarted at a checkpoint: {"attempt", "from": complete_through then,
        "to": the checkpoint's step} (the training observer's rollback, gradshare/task/tallies.py TrainingLog)."""
        with self._lock:
            return list(self._rolled_back)

    def wait_left(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until every rank said LEAVE; whether they all did. After FINISHED a
        peer lingers for its last acknowledgements, then leaves: a relay closed before that would leave it
        waiting out its linger (the relay inside the job closes with its task)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._core.all_left():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.02))
            return True

    def wait_finished(self, timeout: float) -> None:
        """Return when every rank sent FINISHED or was declared gone and the log is applied."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._log_complete:
                self._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [r for r in range(self._world_size) if r not in self._ended]
                    raise TransportTimeout(
                        f"relay {self.address}: ranks {waiting} neither FINISHED nor declared gone within "
                        f"{timeout:g} s (log complete through step {self._core.complete_through})"
                    )
                self._changed.wait(min(left, 0.1))


__all__ = ["Relay"]
