"""The relay's admission, sans I/O: what a rank may send before (or without) joining (JOIN, LOADING,
FAIL) and the start of a new attempt.

The relay admits ranks 0..W-1 of the current attempt (JOIN → WELCOME with n_params/world_size/start_step,
then every STATUS page). The first JOIN or LOADING of a higher attempt starts it (the core cuts the log,
here: ``new_attempt``). A FAIL (a rank's error, deterministic or not) is recorded, one per rank, and
acknowledged: the driver stops the job on it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.relay.attempt import Attempt
from gradshare.transport.protocol.relay.liveness import Liveness
from gradshare.transport.protocol.relay.observer import LogObserver
from gradshare.transport.protocol.relay.outbox import RelayOutbox
from gradshare.transport.protocol.relay.status import StatusPages
from gradshare.transport.protocol.states import RankTrigger
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import Kind

# the core's: cut the log and start attempt `number` at `now`; the new Attempt
StartAttempt = Callable[[int, float], Attempt]


class Admission:
    def __init__(
        self,
        world_size: int,
        n_params: int,
        aggregate: bool,
        max_message: int,
        tuning: RelayTuning,
        observer: LogObserver,
        io: RelayOutbox,
        pages: StatusPages,
        liveness: Liveness,
    ) -> None:
        self.world_size, self.n_params, self.aggregate = world_size, n_params, aggregate
        self.max_message = max_message
        self.tuning = tuning
        self.observer = observer
        self.io = io
        self.pages = pages
        self.liveness = liveness
        self.failures: dict[int, ev.Fail] = {}  # rank -> its latest FAIL (any attempt)
        self.rolled_back: list[dict[str, int]] = []  # one entry per rollback: the attempt and the step

    def on_loading(self, att: Attempt, h: wire.Header, body: bytes, now: float, start: StartAttempt) -> None:
        """LOADING: a task still materialising its partition is alive (liveness.py)."""
        if self.io.chan.control(Kind.LOADING, body) is None:
            return
        if h.attempt > att.number:
            att = start(h.attempt, now)  # a stage's first task to speak starts its attempt
        self.liveness.heard(att, att.ranks[h.sender], now)

    def on_join(
        self, att: Attempt, h: wire.Header, body: bytes, addr: ev.Address, now: float, start: StartAttempt
    ) -> None:
        msg = self.io.chan.control(Kind.JOIN, body)
        if msg is None:
            return
        reject = None
        if msg.world_size != self.world_size:
            reject = f"world_size {msg.world_size} does not match the relay's {self.world_size}"
        elif msg.n_params != self.n_params:
            reject = f"n_params {msg.n_params} does not match the relay's {self.n_params}"
        if reject:
            self._reject(addr, f"rank {h.sender}: {reject}")
            return
        if h.attempt > att.number:
            att = start(h.attempt, now)
        rs = att.ranks[h.sender]
        if rs.session is not None and rs.session != h.session and (rs.ended is not None or len(rs.received)):
            self._reject(
                addr,
                f"rank {h.sender} of attempt {h.attempt} already joined and sent updates; "
                f"a restarted task must join with a higher attempt",
            )
            return
        if rs.ended is not None and rs.ended.gone:
            self._reject(
                addr,
                f"rank {h.sender} was declared gone at step {rs.ended.last_step}; "
                f"a retried stage must join with a higher attempt",
            )
            return
        first = not rs.joined or rs.session != h.session
        rs.session = h.session
        rs.addr = addr
        rs.to(RankTrigger.JOIN)
        self.liveness.heard(att, rs, now)
        cur = att.cursor
        self.io.send(
            rs,
            ev.Welcome(self.n_params, self.world_size, cur.start_step, cur.complete_through, att.notes, self.aggregate),
        )
        for page in range(self.pages.n_pages):
            self.io.send(rs, self.pages.page(page, att))
        if first:
            self.io.emit(ev.PeerJoined(rs.rank, h.attempt, addr))

    def on_fail(self, h: wire.Header, body: bytes, addr: ev.Address) -> None:
        """Record a rank's failure, fatal or not (one per rank: ``failures`` stays bounded) and
        acknowledge it; the FAIL is retransmitted until acknowledged, so duplicates are normal."""
        msg = self.io.chan.control(Kind.FAIL, body)
        if msg is None:
            return
        if msg.rank != h.sender or msg.attempt != h.attempt:
            self.io.chan.drops["bad_fail"] += 1
            return
        known = self.failures.get(msg.rank)
        if known is None or known.attempt != msg.attempt:
            self.failures[msg.rank] = msg
            self.io.counts["failures"] += 1
            self.io.emit(
                ev.PeerFailed(
                    msg.rank, msg.attempt, msg.error_type, msg.message, msg.step, msg.fatal, msg.error_class, msg.cause
                )
            )
        self.io.send_to(addr, ev.FailAck(msg.rank, msg.attempt))

    def new_attempt(self, number: int, now: float, complete_through: int, params: NDArray[np.float32]) -> Attempt:
        """A retried stage: the log restarts after complete_through (or after the step the observer rolls
        ``params`` back to), from a fresh Attempt."""
        cut = self.observer.cut(complete_through, params)
        if cut.rolled_back and self.io.counts["attempts"]:  # a retried stage (a resumed fit's first attempt is none)
            self.rolled_back.append({"attempt": number, "from": complete_through, "to": cut.through})
            self.io.emit(ev.RolledBack(number, complete_through, cut.through))
        att = Attempt(number, now, cut.through + 1, cut.notes, self.world_size, self.tuning, self.max_message, now)
        self.io.counts["attempts"] += 1
        self.io.emit(ev.AttemptStarted(number, cut.through + 1))
        return att

    def _reject(self, addr: ev.Address, reason: str) -> None:
        self.io.send_to(addr, ev.Reject(reason))
        self.io.counts["rejects"] += 1


__all__ = ["Admission", "StartAttempt"]
