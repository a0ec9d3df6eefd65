"""The relay's rank table: what it knows of each rank of the current attempt (out of
the relay core, with its own tests). A rank's lifecycle is ``status`` (states.RANK_TRANSITIONS); the rest is
bookkeeping the relay core updates as datagrams arrive: address, session, steps held, liveness, meta.
"""

from __future__ import annotations

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.rangeset import RangeSet
from gradshare.transport.protocol.reassembly import LateAllowance
from gradshare.transport.protocol.states import (
    GONE_STATES,
    JOINED_STATES,
    LEFT_STATES,
    RANK_TRANSITIONS,
    RankStatus,
    RankTrigger,
    transition,
)
from gradshare.transport.protocol.step_meta import StepMeta

# per status: (joined, left, connected, live), derived once from the state sets. Every datagram asks
# whether its rank is joined and not left, and every forward whether each rank is live: attributes set
# with the status cost a load each, where properties over enum sets cost a call and a look-up each
# (the relay core's per-datagram cost in `gradshare bench transport`)
_FLAGS = {
    s: (
        s in JOINED_STATES,
        s in LEFT_STATES,
        s in JOINED_STATES and s not in LEFT_STATES,
        s in JOINED_STATES and s not in LEFT_STATES and s not in GONE_STATES,
    )
    for s in RankStatus
}


class Presence:
    """What liveness.py's rules know of one rank: when it was last heard, what its training thread computes,
    and the verdicts they reached about it in this attempt."""

    __slots__ = ("heard", "last_heard", "suspected_since", "computing", "computing_since", "given_up")

    def __init__(self, now: float) -> None:
        self.heard = False  # anything authenticated from it in this attempt (LOADING too)
        self.last_heard = now
        self.suspected_since: float | None = None  # last heard, when liveness_timeout made it suspected
        self.computing = -1  # the step its heartbeat says the training thread computes
        self.computing_since = now
        self.given_up = False  # a fatal incident (silent / stuck) was recorded for it


class RankState:
    """joined: it joined this attempt (whatever followed); left: it said LEAVE; connected: joined and not
    left (it gets STATUS pages: a rank declared gone learns it from them); live: connected and not
    declared gone (it gets the log's updates). All four follow ``status``, which only ``to()`` changes."""

    __slots__ = (
        "rank",
        "addr",
        "session",
        "status",
        "joined",
        "left",
        "connected",
        "live",
        "presence",
        "received",
        "ended",
        "delivered_through",
        "sent_through",
        "meta",
        "bytes_in",
        "updates_in",
        "late",
    )

    def __init__(self, rank: int, now: float, nak_delay: float) -> None:
        self.rank = rank
        self.addr: ev.Address | None = None
        self.session: int | None = None
        self._set(RankStatus.WAITING)  # states.RANK_TRANSITIONS: changed only by to()
        self.presence = Presence(now)  # liveness.py's
        self.received = RangeSet()  # steps whose update the relay holds completely
        self.ended: ev.Ended | None = None
        self.delivered_through = -1
        self.sent_through = -1
        self.meta: StepMeta | None = None  # its latest update's
        self.bytes_in = 0
        self.updates_in = 0
        self.late = LateAllowance(nak_delay)  # how late this rank's chunks may be before we NAK them

    def to(self, trigger: RankTrigger) -> None:
        self._set(transition(RANK_TRANSITIONS, self.status, trigger, f"relay rank {self.rank}"))

    def _set(self, status: RankStatus) -> None:
        self.status = status
        self.joined, self.left, self.connected, self.live = _FLAGS[status]


class RankTable(list[RankState]):
    """Ranks 0..world_size-1 of one attempt (a new attempt gets a new table): a list of `RankState`, so
    that the look-up the relay makes on every datagram is a list's, not a Python ``__getitem__`` (with the
    flags above: the core's own cost per datagram, codec aside, 8.4 -> 8.1 us at N = 2), plus the
    table's queries."""

    def __init__(self, world_size: int, now: float, nak_delay: float) -> None:
        super().__init__(RankState(r, now, nak_delay) for r in range(world_size))

    def connected(self) -> list[RankState]:
        """The ranks that get STATUS pages."""
        return [r for r in self if r.connected]

    def forward_targets(self, origin: int) -> list[ev.Address]:
        """Where an update of ``origin`` goes: every other live rank's address."""
        return [r.addr for r in self if r.rank != origin and r.live]

    def delivered_floor(self, complete_through: int) -> int | None:
        """The last step every live rank has delivered and the relay applied (history older than it is
        needed by no one); None while a rank has not joined yet (it will need the history from the start)."""
        if any(r.status == RankStatus.WAITING for r in self):
            return None
        return min([r.delivered_through for r in self if r.live] + [complete_through])

    def have(self, start_step: int) -> list[int]:
        """Per rank: the last step through which the relay holds its updates contiguously."""
        return [r.received.contiguous_from(start_step) - 1 for r in self]


__all__ = ["RankState", "RankTable"]
