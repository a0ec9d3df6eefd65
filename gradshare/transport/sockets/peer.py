"""A peer (one Spark task) as a receiver thread around :class:`PeerCore` (a thin I/O shell: the core decides).

The receiver thread drains the socket into the core and runs its timer; the training thread calls
``send_update``/``receive``/``finish`` which take the same lock. Every wait has a timeout whose error names
what did not answer: the relay's address, or the (step, sender) the log is waiting for.
Waiters are resolved from the core's events (``Welcomed``, ``SnapshotReady``, ``Rejected``...); the shell
asks the core only through its methods.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import cast

import numpy as np
from numpy.typing import NDArray

from gradshare.errors import GradshareError, ProtocolError, TransportTimeout
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.events import Counters, Update, Welcome
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import PeerTuning
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE
from gradshare.transport.sockets import quiet_gc, udp

DRAIN_BATCH = 512
MAX_WAIT = 0.02
LINGER = 2.0  # close() waits this long (at most) for the relay to acknowledge our last updates


class Peer:
    def __init__(
        self,
        relay_address: tuple[str, int],
        rank: int,
        world_size: int,
        attempt: int,
        key: bytes | None,
        job_id: int | str,
        n_params: int,
        datagram_size: int = DEFAULT_DATAGRAM_SIZE,
        timeout: float = 60.0,
        insecure: bool = False,
        bind: str | None = None,
        tuning: PeerTuning = PeerTuning(),
    ) -> None:
        """tuning: the core's tunables (tuning.PeerTuning)."""
        host, port = relay_address
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (got {timeout!r})")
        self.timeout = float(timeout)
        self._rank, self._n_params = rank, n_params
        self._core = PeerCore(
            rank,
            world_size,
            attempt,
            key,
            job_id,
            n_params,
            now=time.monotonic(),
            datagram_size=datagram_size,
            insecure=insecure,
            tuning=tuning,
        )
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except socket.gaierror as exc:
            raise ValueError(f"relay_address {host}:{port} does not resolve: {exc}") from None
        self.relay_address = (host, port)
        self._relay_sockaddr = infos[0][4]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._io_drops: Counter[str] = Counter()
        # what the core's events said (lock held): its WELCOME, the snapshot fetched, why it cannot go
        # on, whether the relay acknowledged our FAIL
        self._welcome: Welcome | None = None
        self._snapshot: tuple[int, NDArray[np.float32]] | None = None
        self._error: str | None = None
        self._fail_acked = False
        self._sock = udp.open_udp(
            bind if bind is not None else udp.local_bind_for(str(infos[0][4][0])), 0, f"peer rank {rank}"
        )
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._run, name=f"gradshare-peer-{rank}", daemon=True)
        quiet_gc.hold()  # a full collection would stall this rank's step (quiet_gc.py)
        try:
            self._thread.start()
        except BaseException:
            quiet_gc.release()
            self._sock.close()
            raise
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    def _where(self) -> str:
        return f"relay {self.relay_address[0]}:{self.relay_address[1]}"

    # --- the I/O loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        core, sock, lock, drops = self._core, self._sock, self._lock, self._io_drops
        relay = self._relay_sockaddr[:2]
        try:
            while not self._stop.is_set():
                udp.wait_for_work(sock, lock, core, MAX_WAIT)
                # one datagram at a time under the lock: the training thread gets each update as soon
                # as it is complete instead of after a whole batch
                for run, addr in udp.received(sock, drops, DRAIN_BATCH):
                    if addr[:2] != relay:
                        drops["not_from_relay"] += len(run)
                        continue
                    for data in run:
                        with lock:
                            core.receive_datagram(data, addr, time.monotonic())
                            out = self._publish_locked(core.has_ready())
                        self._send(out)
                with lock:
                    now = time.monotonic()
                    if now >= core.next_timer():
                        core.handle_timer(now)
                    out = self._publish_locked(False)
                self._send(out)
        except BaseException as exc:
            with lock:
                self._failure = exc
                self._changed.notify_all()

    def _send(self, out: list[bytes]) -> None:
        if out:
            udp.send_all(self._sock, ((d, self._relay_sockaddr) for d in out), self._io_drops)

    def _publish_locked(self, news: bool) -> list[bytes]:
        """(Lock held.) Act on the core's events and wake the training thread if anything it may be
        waiting for changed (``news`` or any event); returns the datagrams the core wants sent."""
        out = self._core.datagrams_to_send()
        while (e := self._core.next_event()) is not None:
            news = True
            if isinstance(e, ev.Welcomed):
                self._welcome = e.info
            elif isinstance(e, ev.SnapshotReady):
                self._snapshot = (e.step, e.params)
            elif isinstance(e, (ev.Rejected, ev.SnapshotFailed)):
                self._error = e.reason
            elif isinstance(e, ev.FailAck):
                self._fail_acked = True
        if news:
            self._changed.notify_all()
        return out

    def _flush_locked(self) -> list[bytes]:
        return self._publish_locked(False)

    def _call(self, method: Callable[..., None], *args: object) -> None:
        """Run a core method under the lock (after the usual checks), then send what it produced."""
        with self._changed:
            self._check()
            method(*args, time.monotonic())
            out = self._flush_locked()
            self._changed.notify_all()
        self._send(out)

    def _check(self) -> None:
        if self._failure is not None:
            raise GradshareError(f"peer rank {self.rank}: receiver thread failed: {self._failure!r}") from self._failure
        if self._error:
            raise ProtocolError(f"peer rank {self.rank}: {self._error}")
        if self._closed:
            raise GradshareError(f"peer rank {self.rank} is closed")

    def _wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait (lock held) until ``done()`` (True) or ``timeout`` passes (False); raises if the peer failed."""
        deadline = time.monotonic() + timeout
        while True:
            self._check()
            if done():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.wait(min(left, 0.05))

    def _wait(self, done: Callable[[], bool], timeout: float, describe: Callable[[], str]) -> None:
        """Wait (lock held) until ``done()``; TransportTimeout with ``describe()`` otherwise."""
        if not self._wait_until(done, timeout):
            raise TransportTimeout(describe())

    # --- API ----------------------------------------------------------------------------------------
    def loading(self) -> None:
        """Say LOADING to the relay now and every heartbeat interval until join(): this task is alive
        and still materialising its partition."""
        with self._changed:
            self._check()
            self._core.loading(time.monotonic())
            out = self._flush_locked()
        self._send(out)

    def begin_step(self, step: int) -> None:
        """The training thread starts computing ``step`` (until its send_update): heartbeats say so, and
        the relay's step_timeout measures it (progress not presence)."""
        with self._lock:
            self._core.begin_step(step)

    def join(self, timeout: float | None = None) -> Welcome:
        """Join the relay; returns its WELCOME (``start_step`` 0 fresh, > 0 resume from a snapshot)."""
        timeout = self.timeout if timeout is None else timeout
        self._call(self._core.join)
        with self._changed:
            self._wait(
                lambda: self._welcome is not None,
                timeout,
                lambda: (
                    f"{self._where()} did not answer JOIN of rank {self.rank} within {timeout:g} s "
                    f"(is the relay running and reachable from {self.address[0]}?)"
                ),
            )
            assert self._welcome is not None  # what _wait waited for
            return self._welcome

    def fetch_snapshot(
        self, timeout: float | None = None, into: NDArray[np.float32] | None = None
    ) -> tuple[int, NDArray[np.float32]]:
        """(step, params): the relay's authoritative parameters with the log applied through ``step``.
        ``into``: a writable C-contiguous float32 array of n_params that receives them (and is returned)
        instead of a new array; on a timeout or a failed hash check it holds a partial download."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            self._core.snapshot_destination(into)  # ValueError for a wrong `into`
            self._snapshot = None
        self._call(self._core.request_snapshot)
        with self._changed:

            def describe() -> str:
                chunks = self._core.snapshot_progress()
                got = "no SNAP_INFO" if chunks is None else f"{chunks[0]}/{chunks[1]} chunks"
                return f"{self._where()}: snapshot for rank {self.rank} incomplete after {timeout:g} s ({got})"

            self._wait(lambda: self._snapshot is not None, timeout, describe)
            # _wait returned, so the receiver thread set it; the checker still holds the None assigned above
            return self._snapshot  # type: ignore[return-value]

    def send_update(self, step: int, payload: bytes, meta: StepMeta | None = None) -> None:
        self._call(self._core.send_update, step, payload, meta)

    def receive(self, until_step: int | None = None, timeout: float | None = None) -> list[Update]:
        """Every deliverable update not returned before, in canonical (step, sender) order. With
        ``until_step``: first wait until the log is complete through ``until_step``."""
        timeout = self.timeout if timeout is None else timeout
        with self._changed:
            self._check()
            if self._welcome is None:
                raise GradshareError(f"peer rank {self.rank}: receive() before join()")
            if until_step is not None:

                def describe() -> str:
                    key = self._core.blocking_key()
                    what = "nothing" if key is None else f"update (step {key[0]}, sender {key[1]})"
                    heard = self._core.heard_at()
                    ago = "never" if heard is None else f"{time.monotonic() - heard:.1f} s ago"
                    return (
                        f"peer rank {self.rank}: log not complete through step {until_step} after "
                        f"{timeout:g} s; waiting for {what} from {self._where()} (last heard {ago})"
                    )

                self._wait(
                    lambda: self._core.complete_through >= until_step or self._core.finished(), timeout, describe
                )
            return self._core.pop_ready()

    def wait(self, timeout: float) -> bool:
        """Block until at least one update is deliverable (True) or ``timeout`` passes (False)."""
        with self._changed:
            return self._wait_until(self._core.has_ready, timeout)

    def report_failure(
        self,
        error_type: str,
        message: str,
        timeout: float,
        step: int = -1,
        fatal: bool = True,
        error_class: str = "TrainingError",
        cause: str = "",
    ) -> bool:
        """FAIL(rank, error_type, message, step, fatal, error_class, cause: as PeerCore.fail) to the
        relay, joined or not, resent until acknowledged; True once the relay acknowledged it, False after
        ``timeout`` (the caller raises its error either way)."""
        with self._changed:
            if self._failure is not None or self._closed:
                return False
            self._fail_acked = False
            self._core.fail(error_type, message, time.monotonic(), step, fatal, error_class, cause)
            out = self._flush_locked()
        self._send(out)
        with self._changed:
            deadline = time.monotonic() + timeout
            while not self._fail_acked and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))
            return self._fail_acked

    def finish(self, last_step: int) -> None:
        """FINISHED(last_step): peers stop expecting this rank after it (retransmitted until confirmed)."""
        self._call(self._core.finish, last_step)

    @property
    def complete_through(self) -> int:
        with self._lock:
            return self._core.complete_through

    def counters(self) -> Counters:
        with self._lock:
            d = self._core.counters()
            core_drops = cast("dict[str, int]", d["drops"])  # counters() puts the core's drops there
            d["drops"] = dict(Counter(core_drops) + self._io_drops)
            return d

    def close(self, linger: float = LINGER, leave: bool = True) -> None:
        """Wait up to ``linger`` s for our updates to be acknowledged, say LEAVE, stop the thread, close.
        ``leave=False`` vanishes silently, like a killed task (the relay's liveness timeout then applies)."""
        if self._closed:
            return
        try:
            if not leave:
                return
            # joined (its WELCOME came) and not refused since: what was sent may still need its ACK
            if self._thread.is_alive() and self._welcome is not None and not self._error:
                deadline = time.monotonic() + linger
                with self._changed:
                    while not self._core.idle() and time.monotonic() < deadline and self._failure is None:
                        self._changed.wait(0.02)
            with self._lock:
                self._core.leave()
                out = self._flush_locked()
            self._send(out)
        finally:
            self._closed = True
            self._stop.set()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5.0)
            self._sock.close()
            quiet_gc.release()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
