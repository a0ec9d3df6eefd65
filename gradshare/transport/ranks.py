"""The relay's rank table: what it knows of each rank of the current attempt (issue 13 item 5: out of
relay_core, with its own tests). A rank's lifecycle is ``status`` (states.RANK_TRANSITIONS); the rest is
bookkeeping the relay core updates as datagrams arrive: address, session, steps held, liveness, meta.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import overload

from gradshare.transport import events as ev
from gradshare.transport.rangeset import RangeSet
from gradshare.transport.reassembly import LateAllowance
from gradshare.transport.states import (GONE_STATES, JOINED_STATES, LEFT_STATES, RANK_TRANSITIONS, RankStatus,
                                        RankTrigger, transition)


class RankState:
    __slots__ = ("rank", "addr", "session", "status", "last_heard", "received", "ended",
                 "delivered_through", "sent_through", "meta", "bytes_in", "updates_in", "late",
                 "heard", "suspected_since", "computing", "computing_since", "given_up")

    def __init__(self, rank: int, now: float, nak_delay: float) -> None:
        self.rank = rank
        self.addr: ev.Address | None = None
        self.session: int | None = None
        self.status = RankStatus.WAITING    # states.RANK_TRANSITIONS: changed only by to()
        self.last_heard = now
        self.received = RangeSet()          # steps whose update the relay holds completely
        self.ended: ev.Ended | None = None
        self.delivered_through = -1
        self.sent_through = -1
        self.meta: ev.Meta | None = None
        self.bytes_in = 0
        self.updates_in = 0
        self.late = LateAllowance(nak_delay)   # how late this rank's chunks may be before we NAK them
        self.heard = False                     # anything authenticated from it in this attempt (LOADING too)
        self.suspected_since: float | None = None   # last heard, when liveness_timeout made it suspected
        self.computing = -1                    # the step its heartbeat says the training thread computes
        self.computing_since = now
        self.given_up = False                  # a fatal incident (silent / stuck) was recorded for it

    def to(self, trigger: RankTrigger) -> None:
        self.status = transition(RANK_TRANSITIONS, self.status, trigger, f"relay rank {self.rank}")

    @property
    def joined(self) -> bool:
        return self.status in JOINED_STATES

    @property
    def left(self) -> bool:
        return self.status in LEFT_STATES

    @property
    def connected(self) -> bool:
        """Joined and not left: it gets STATUS pages (a rank declared gone learns it from them)."""
        return self.joined and not self.left

    @property
    def live(self) -> bool:
        """Connected and not declared gone: it gets the log's updates."""
        return self.connected and self.status not in GONE_STATES


class RankTable:
    """Ranks 0..world_size-1 of one attempt (a new attempt gets a new table), indexable like a list."""

    def __init__(self, world_size: int, now: float, nak_delay: float) -> None:
        self._ranks = [RankState(r, now, nak_delay) for r in range(world_size)]

    @overload
    def __getitem__(self, i: int) -> RankState: ...
    @overload
    def __getitem__(self, i: slice) -> list[RankState]: ...

    def __getitem__(self, i: int | slice) -> RankState | list[RankState]:
        return self._ranks[i]

    def __iter__(self) -> Iterator[RankState]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def connected(self) -> list[RankState]:
        """The ranks that get STATUS pages."""
        return [r for r in self._ranks if r.connected]

    def forward_targets(self, origin: int) -> list[ev.Address]:
        """Where an update of ``origin`` goes: every other live rank's address."""
        return [r.addr for r in self._ranks if r.rank != origin and r.live]

    def delivered_floor(self, complete_through: int) -> int | None:
        """The last step every live rank has delivered and the relay applied (history older than it is
        needed by no one); None while a rank has not joined yet (it will need the history from the start)."""
        if any(r.status == RankStatus.WAITING for r in self._ranks):
            return None
        return min([r.delivered_through for r in self._ranks if r.live] + [complete_through])

    def have(self, start_step: int) -> list[int]:
        """Per rank: the last step through which the relay holds its updates contiguously."""
        return [r.received.contiguous_from(start_step) - 1 for r in self._ranks]


__all__ = ["RankState", "RankTable"]
