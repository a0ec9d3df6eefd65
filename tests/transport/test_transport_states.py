"""Peer and rank lifecycles: one transition table each; anything else is a LocalProtocolError naming the
state and the trigger (h11 ``_state.py``)."""

from __future__ import annotations

import pytest

from gradshare.errors import LocalProtocolError
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.ranks import RankState
from gradshare.transport.protocol.states import (
    PEER_TRANSITIONS,
    RANK_TRANSITIONS,
    PeerState,
    PeerTrigger,
    RankStatus,
    RankTrigger,
    transition,
)


@pytest.mark.parametrize(
    "table,states,triggers", [(PEER_TRANSITIONS, PeerState, PeerTrigger), (RANK_TRANSITIONS, RankStatus, RankTrigger)]
)
def test_every_pair_outside_the_table_raises_naming_both(table, states, triggers):
    assert set(table) == set(states)  # every state has its row
    for state in states:
        for trigger in triggers:
            if trigger in table[state]:
                assert transition(table, state, trigger, "x") in states
            else:
                with pytest.raises(LocalProtocolError) as err:
                    transition(table, state, trigger, "x")
                assert str(err.value) == f"x: {trigger.value} is not allowed in state {state.value}"


def test_peer_walks_its_table():
    p = PeerCore(1, 2, 0, b"k" * 32, 7, 10, now=0.0)
    assert p.state == "new" and p.state is PeerState.NEW
    p.loading(0.0)
    with pytest.raises(LocalProtocolError, match="peer rank 1: loading.. is not allowed in state loading"):
        p.loading(0.1)
    p.join(0.1)
    with pytest.raises(LocalProtocolError, match=r"join\(\) is not allowed in state joining"):
        p.join(0.2)
    assert p.state is PeerState.JOINING
    p.leave()
    assert p.state is PeerState.CLOSED
    p.leave()  # closing twice is harmless
    assert p.state is PeerState.CLOSED


def test_rank_flags_follow_its_status():
    rs = RankState(3, 0.0, 0.004)
    seen = []
    for trigger in (RankTrigger.JOIN, RankTrigger.FINISH, RankTrigger.LEAVE, RankTrigger.JOIN):
        rs.to(trigger)
        seen.append((rs.status, rs.joined, rs.left, rs.connected, rs.live))
    assert seen == [
        (RankStatus.JOINED, True, False, True, True),
        (RankStatus.FINISHED, True, False, True, True),
        (RankStatus.FINISHED_LEFT, True, True, False, False),
        (RankStatus.FINISHED, True, False, True, True),
    ]  # a LEAVE'd rank may join again
    gone = RankState(4, 0.0, 0.004)
    gone.to(RankTrigger.GONE)
    assert (gone.status, gone.joined, gone.live) == (RankStatus.GONE_UNJOINED, False, False)
    with pytest.raises(LocalProtocolError, match="relay rank 4: JOIN is not allowed in state gone_unjoined"):
        gone.to(RankTrigger.JOIN)
