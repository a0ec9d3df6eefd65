"""The relay's rank table alone (transport/protocol/relay/ranks.py): who gets updates, who gets STATUS, and the floor
below which no one needs the history."""

from __future__ import annotations

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.relay.ranks import RankTable
from gradshare.transport.protocol.states import RankTrigger


def _table() -> RankTable:
    t = RankTable(5, now=0.0, nak_delay=0.004)
    for r in t:
        r.addr = ("127.0.0.1", 1000 + r.rank)
    return t


def test_targets_status_and_floor_follow_the_ranks_lifecycles():
    t = _table()
    assert len(t) == 5 and t.forward_targets(0) == [] and t.connected() == []
    for r in range(4):
        t[r].to(RankTrigger.JOIN)
        t[r].delivered_through = 10 + r
    assert t.delivered_floor(20) is None  # rank 4 has not joined: it needs everything
    t[4].to(RankTrigger.GONE)  # declared gone without joining (join_window)
    t[4].ended = ev.Ended(4, -1, True)
    assert t.delivered_floor(20) == 10 and t.delivered_floor(7) == 7
    t[0].to(RankTrigger.GONE)  # gone, still connected: it hears so in STATUS
    t[1].to(RankTrigger.FINISH)  # finished: still gets the others' updates
    t[2].to(RankTrigger.FINISH)
    t[2].to(RankTrigger.LEAVE)  # finished and left: nothing more for it
    assert [r.rank for r in t.connected()] == [0, 1, 3]
    assert t.forward_targets(3) == [("127.0.0.1", 1001)]
    assert t.forward_targets(1) == [("127.0.0.1", 1003)]
    assert t.delivered_floor(20) == 11  # ranks 1 and 3 are the live ones


def test_have_is_each_ranks_contiguous_prefix():
    t = _table()
    for step in (3, 4, 6):
        t[1].received.add(step)
    t[2].received.add(2)
    assert t.have(start_step=3) == [2, 4, 2, 2, 2]
