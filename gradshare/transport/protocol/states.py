"""The peer's and the relay's per-rank lifecycles: one enum of states and one transition table each
(the shape of h11 ``_state.py``). A transition the table does not hold is our own misuse of the core
and raises :class:`LocalProtocolError` naming the state and the trigger; input from the wire is checked
before it reaches a transition, so the network cannot trigger one.

The states are ``str`` enums, so a state also compares equal to its name (``p.state == "joined"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

from gradshare.errors import LocalProtocolError


class PeerState(str, Enum):
    NEW = "new"
    LOADING = "loading"  # LOADING sent: the task materialises its partition
    JOINING = "joining"  # JOIN sent, no WELCOME yet
    JOINED = "joined"
    REJECTED = "rejected"  # the relay refused us (REJECT, or a WELCOME for another job)
    CLOSED = "closed"  # LEAVE said (or left silently)

    def __str__(self) -> str:
        return self.value


class PeerTrigger(Enum):
    LOADING = "loading()"
    JOIN = "join()"
    WELCOME = "WELCOME"
    REJECT = "REJECT"
    LEAVE = "leave()"


_P, _PT = PeerState, PeerTrigger
PEER_TRANSITIONS: dict[PeerState, dict[PeerTrigger, PeerState]] = {
    _P.NEW: {_PT.LOADING: _P.LOADING, _PT.JOIN: _P.JOINING, _PT.REJECT: _P.REJECTED, _PT.LEAVE: _P.CLOSED},
    _P.LOADING: {_PT.JOIN: _P.JOINING, _PT.REJECT: _P.REJECTED, _PT.LEAVE: _P.CLOSED},
    _P.JOINING: {_PT.WELCOME: _P.JOINED, _PT.REJECT: _P.REJECTED, _PT.LEAVE: _P.CLOSED},
    _P.JOINED: {_PT.REJECT: _P.REJECTED, _PT.LEAVE: _P.CLOSED},
    _P.REJECTED: {_PT.LEAVE: _P.CLOSED},
    _P.CLOSED: {_PT.LEAVE: _P.CLOSED},
}


class RankStatus(str, Enum):
    """A rank of the current attempt, as the relay sees it. Joined or not and left or not (whether it
    still gets STATUS pages) combine with how its part of the log ended (FINISHED or declared gone)."""

    WAITING = "waiting"  # not joined, not ended: the log waits for it (join_window)
    JOINED = "joined"
    FINISHED = "finished"  # FINISHED(last_step) recorded; still connected
    FINISHED_LEFT = "finished_left"  # ... and said LEAVE
    GONE = "gone"  # declared gone while connected (it hears so in STATUS)
    GONE_LEFT = "gone_left"  # declared gone, and LEAVE said (a LEAVE before FINISHED is both)
    GONE_UNJOINED = "gone_unjoined"  # declared gone without ever joining this attempt

    def __str__(self) -> str:
        return self.value


class RankTrigger(Enum):
    JOIN = "JOIN"  # accepted: a first JOIN, a retransmitted one, or a rejoin after LEAVE
    FINISH = "FINISHED"
    GONE = "declared gone"
    LEAVE = "LEAVE"


_R, _RT = RankStatus, RankTrigger
RANK_TRANSITIONS: dict[RankStatus, dict[RankTrigger, RankStatus]] = {
    _R.WAITING: {_RT.JOIN: _R.JOINED, _RT.GONE: _R.GONE_UNJOINED},
    _R.JOINED: {_RT.JOIN: _R.JOINED, _RT.FINISH: _R.FINISHED, _RT.GONE: _R.GONE},
    _R.FINISHED: {_RT.JOIN: _R.FINISHED, _RT.LEAVE: _R.FINISHED_LEFT},
    _R.FINISHED_LEFT: {_RT.JOIN: _R.FINISHED},
    _R.GONE: {_RT.LEAVE: _R.GONE_LEFT},
    _R.GONE_LEFT: {},
    _R.GONE_UNJOINED: {},
}

JOINED_STATES = frozenset({_R.JOINED, _R.FINISHED, _R.FINISHED_LEFT, _R.GONE, _R.GONE_LEFT})
LEFT_STATES = frozenset({_R.FINISHED_LEFT, _R.GONE_LEFT})
GONE_STATES = frozenset({_R.GONE, _R.GONE_LEFT, _R.GONE_UNJOINED})


S = TypeVar("S", bound=Enum)
T = TypeVar("T", bound=Enum)


def transition(table: Mapping[S, Mapping[T, S]], state: S, trigger: T, who: str) -> S:
    """The state after ``trigger`` in ``state``; LocalProtocolError naming both if the table has none."""
    new = table[state].get(trigger)
    if new is None:
        raise LocalProtocolError(f"{who}: {trigger.value} is not allowed in state {state.value}")
    return new


__all__ = [
    "PeerState",
    "PeerTrigger",
    "PEER_TRANSITIONS",
    "RankStatus",
    "RankTrigger",
    "RANK_TRANSITIONS",
    "transition",
]
