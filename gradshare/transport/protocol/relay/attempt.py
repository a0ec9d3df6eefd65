"""The relay's stage attempts, sans I/O: what one attempt owns (``Attempt``), admission (JOIN, LOADING)
and the start of a new attempt.

The relay admits ranks 0..W-1 of the current attempt (JOIN → WELCOME with n_params/world_size/start_step,
then every STATUS page). A higher attempt is a retried stage: the log is cut at ``complete_through`` (or
where the training observer rolls the parameters back to) and restarts after the cut from a fresh
``Attempt``, so nothing of the old one's log, repair state or liveness verdicts survives but what the core
carries over on purpose (the parameters, the failures, the observer's notes).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.history import History, StepKeys
from gradshare.transport.protocol.relay.observer import LogObserver
from gradshare.transport.protocol.relay.ranks import RankState, RankTable
from gradshare.transport.protocol.reassembly import Reassembler
from gradshare.transport.protocol.relay.status import StatusPages
from gradshare.transport.protocol.relay.snapshots import SnapshotServer
from gradshare.transport.protocol.states import RankTrigger
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import Kind

# as in relay/core.py: importing the encoding package loads Numba, which the transport defers to first use
if TYPE_CHECKING:
    from gradshare.encoding.aggregate import AggregateState

# Any, for a decoded update: the core only holds it between decode_update and apply_update, which come as
# a pair (the encoding package's StepUpdate by default; tests plug in a toy codec)
Decoded = Any


def total_len(datagrams: tuple[bytes, ...]) -> int:
    return sum(len(d) for d in datagrams)


class Attempt:
    __slots__ = ("number", "started", "notes", "cursor", "ranks", "pending", "pending_meta", "restart_reason",
                 "evicted", "trim_floor", "history", "reasm", "recent", "acks", "log_complete_sent")

    def __init__(self, number: int, started: float | None, base: int, notes: tuple[tuple[str, float], ...],
                 world_size: int, tuning: RelayTuning, max_message: int, now: float) -> None:
        self.number = number                   # -1: no attempt yet; the first JOIN or LOADING starts one
        self.started = started                 # when (None: no attempt yet)
        self.notes = notes                     # what this attempt's WELCOME hands over
        self.cursor = LogCursor(world_size, base)
        self.ranks = RankTable(world_size, now, tuning.nak_delay)
        self.pending: dict[tuple[int, int], Decoded] = {}    # (step, rank) -> decoded, validated, not applied
        self.pending_meta: dict[tuple[int, int], StepMeta] = {}  # their meta, accounted when applied
        self.restart_reason: str | None = None           # on_rank_loss="restart" fired in this attempt
        self.evicted = StepKeys()                        # history entries lost to the caps (NAK → error)
        self.trim_floor = -2                             # the floor the last trim dropped through
        # the origin's sealed datagrams are kept and forwarded unchanged: every peer holds the job key, so
        # re-sealing each chunk would cost an AEAD operation per chunk and buy nothing (the origin's
        # authentication covers the header, origin and step included)
        self.history: History[tuple[int, int], tuple[bytes, ...]] = History(
            tuning.history_entries, tuning.history_bytes, size=total_len, by_step=True)
        self.reasm: Reassembler[tuple[int, int]] = Reassembler(tuning.reassembly_messages, tuning.reassembly_bytes,
                                                               max_message, keep_raw=True)
        self.recent: dict[tuple[int, int], float] = {}  # (step, origin) -> forwarded at, the last nak_delay
        self.acks: dict[int, list[int]] = {}            # rank -> steps to acknowledge
        self.log_complete_sent = False


class _Liveness(Protocol):
    """relay/liveness.py Liveness, as admission uses it (that module reads ``Attempt``: it imports this one)."""

    def heard(self, rs: RankState, now: float) -> None: ...


class RelayParts(Protocol):
    """What every part of the relay (admission, liveness, the update log) uses of the core:
    relay/core.py RelayCore, which passes itself (Protocols, so that no part need import the core that
    imports it)."""

    att: Attempt                            # start_attempt replaces it
    tuning: RelayTuning
    c: Counter[str]

    @property
    def attempt(self) -> int: ...

    def emit(self, event: ev.RelayEvent) -> None: ...

    def send(self, rs: RankState, msg: ev.ControlMessage) -> None: ...


class AdmissionCore(RelayParts, Protocol):
    """What admission and a new attempt use of the relay besides `RelayParts`."""

    world_size: int
    n_params: int
    max_message: int
    params: NDArray[np.float32]
    chan: Channel
    aggregator: AggregateState | None
    observer: LogObserver
    rolled_back: list[dict[str, int]]
    pages: StatusPages
    snaps: SnapshotServer

    @property
    def liveness(self) -> _Liveness: ...

    @property
    def attempt_notes(self) -> tuple[tuple[str, float], ...]: ...

    @property
    def cursor(self) -> LogCursor: ...

    @property
    def ranks(self) -> RankTable: ...

    @property
    def complete_through(self) -> int: ...

    def apply_pending(self) -> None: ...

    def status_page(self, page: int) -> ev.Status: ...

    def send_to(self, addr: ev.Address, msg: ev.ControlMessage) -> None: ...


def on_loading(core: AdmissionCore, h: wire.Header, body: bytes, now: float) -> None:
    """LOADING: a task still materialising its partition is alive (relay/liveness.py)."""
    if core.chan.control(Kind.LOADING, body) is None:
        return
    if h.attempt > core.attempt:
        start_attempt(core, h.attempt, now)    # a stage's first task to speak starts its attempt
    core.liveness.heard(core.ranks[h.sender], now)


def on_join(core: AdmissionCore, h: wire.Header, body: bytes, addr: ev.Address, now: float) -> None:
    msg = core.chan.control(Kind.JOIN, body)
    if msg is None:
        return
    reject = None
    if msg.world_size != core.world_size:
        reject = f"world_size {msg.world_size} does not match the relay's {core.world_size}"
    elif msg.n_params != core.n_params:
        reject = f"n_params {msg.n_params} does not match the relay's {core.n_params}"
    if reject:
        _reject(core, addr, f"rank {h.sender}: {reject}")
        return
    if h.attempt > core.attempt:
        start_attempt(core, h.attempt, now)
    rs = core.ranks[h.sender]
    if rs.session is not None and rs.session != h.session and (rs.ended is not None or len(rs.received)):
        _reject(core, addr, f"rank {h.sender} of attempt {h.attempt} already joined and sent updates; "
                            f"a restarted task must join with a higher attempt")
        return
    if rs.ended is not None and rs.ended.gone:
        _reject(core, addr, f"rank {h.sender} was declared gone at step {rs.ended.last_step}; "
                            f"a retried stage must join with a higher attempt")
        return
    first = not rs.joined or rs.session != h.session
    rs.session = h.session
    rs.addr = addr
    rs.to(RankTrigger.JOIN)
    core.liveness.heard(rs, now)
    core.send(rs, ev.Welcome(core.n_params, core.world_size, core.cursor.start_step,
                             core.complete_through, core.attempt_notes, core.aggregator is not None))
    for page in range(core.pages.n_pages):
        core.send(rs, core.status_page(page))
    if first:
        core.emit(ev.PeerJoined(rs.rank, h.attempt, addr))


def _reject(core: AdmissionCore, addr: ev.Address, reason: str) -> None:
    core.send_to(addr, ev.Reject(reason))
    core.c["rejects"] += 1


def start_attempt(core: AdmissionCore, attempt: int, now: float) -> None:
    """A retried stage: drop everything after complete_through (or after the step the observer rolls
    the parameters back to) and restart the log after it, from a fresh Attempt."""
    core.apply_pending()                   # complete_through must be current before it becomes the cut
    through = core.complete_through
    cut = core.observer.cut(through, core.params)
    if cut.rolled_back and core.c["attempts"]:   # a retried stage (the first attempt of a resumed fit is none)
        core.rolled_back.append({"attempt": attempt, "from": through, "to": cut.through})
        core.emit(ev.RolledBack(attempt, through, cut.through))
    core.att = Attempt(attempt, now, cut.through + 1, cut.notes, core.world_size, core.tuning, core.max_message,
                       now)
    core.chan.attempt = attempt
    core.snaps.clear()
    core.c["attempts"] += 1
    core.emit(ev.AttemptStarted(attempt, cut.through + 1))


__all__ = ["AdmissionCore", "Attempt", "RelayParts", "Decoded", "on_join", "on_loading", "start_attempt", "total_len"]
