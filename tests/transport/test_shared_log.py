"""The lock-step harness's relay (gradshare/transport/testing/shared_log.py): every rank gets every message
exactly once in (step, rank) order, memory is let go once every rank has read a step, and a message that
comes after its step was read is refused, not lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.transport.testing.shared_log import LogPeer, SharedLog


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 5), steps=st.integers(1, 12), data=st.data())
def test_every_rank_gets_every_message_once_in_step_then_rank_order(world, steps, data):
    log = SharedLog(world)
    peers = [LogPeer(log, r) for r in range(world)]
    got: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for t in range(steps):
        for r in data.draw(st.permutations(range(world))):  # ranks send a step in any order
            peers[r].send_update(t, f"{t}:{r}".encode())
        for r in range(world):
            if data.draw(st.booleans()) or t == steps - 1:  # a rank may read late, several steps at once
                for u in peers[r].receive(until_step=t):
                    assert u.payload == f"{u.step}:{u.sender}".encode()
                    got[r].append((u.step, u.sender))
    want = [(t, r) for t in range(steps) for r in range(world)]
    assert all(g == want for g in got)
    assert log.steps == {}  # everything read by everyone is let go


def test_a_step_is_held_until_the_last_rank_reads_it_and_a_late_message_is_refused():
    log = SharedLog(2)
    a, b = LogPeer(log, 0), LogPeer(log, 1)
    a.send_update(0, b"a0")
    b.send_update(0, b"b0")
    assert [u.payload for u in a.receive(until_step=0)] == [b"a0", b"b0"]
    assert list(log.steps) == [0]  # rank 1 has not read step 0 yet
    assert [u.payload for u in b.receive(until_step=0)] == [b"a0", b"b0"]
    assert log.steps == {} and a.receive(until_step=0) == []
    with pytest.raises(RuntimeError, match="rank 1's message of step 0 came after a rank had read that step"):
        b.send_update(0, b"late")
