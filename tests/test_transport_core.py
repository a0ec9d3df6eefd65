"""Relay and peer cores end to end in memory: exactly-once canonical delivery on a lossy link."""

from __future__ import annotations

import numpy as np
import pytest

from gradshare.transport.relay_core import param_hash
from harness import Sim


def check_consistent(sim: Sim) -> None:
    expected = sorted(sim.sent)                       # canonical (step, sender) order
    for r in sim.peers:
        if r in sim.silent:
            continue
        got = [(u.step, u.sender) for u in sim.delivered[r]]
        assert got == expected, f"rank {r} delivered {len(got)} of {len(expected)} (or out of order)"
        for u in sim.delivered[r]:
            assert u.payload == sim.sent[(u.step, u.sender)]
        assert param_hash(sim.params[r]) == param_hash(sim.relay.params), f"rank {r} differs from relay"
    assert sim.relay.c["applied"] == len(expected)


@pytest.mark.parametrize("seed,loss,dup,delay", [(0, 0.0, 0.0, 0.0), (1, 0.05, 0.05, 0.003),
                                                  (2, 0.2, 0.1, 0.01), (3, 0.01, 0.2, 0.02)])
def test_lossy_link_delivers_everything_once_in_canonical_order(seed, loss, dup, delay):
    sim = Sim(world_size=3, seed=seed, loss=loss, dup=dup, max_delay=delay)
    for r in range(3):
        sim.add_peer(r)
    sim.run(steps=25)
    check_consistent(sim)
    assert not np.array_equal(sim.relay.params, sim.p0)


def test_ranks_finishing_at_different_steps():
    sim = Sim(world_size=4, seed=5, loss=0.05, max_delay=0.002)
    for r in range(4):
        sim.add_peer(r)
    sim.run(steps=20, last_step={0: 4, 1: 19, 2: -1, 3: 11})
    check_consistent(sim)
    assert sim.relay.complete_through == 19
    ends = {r: e for r, e in sim.relay.cursor.ends.items()}
    assert ends == {0: 4, 1: 19, 2: -1, 3: 11}


def test_synchronous_staleness_zero():
    sim = Sim(world_size=2, seed=7, loss=0.1, staleness=0)
    for r in range(2):
        sim.add_peer(r)
    sim.run(steps=15)
    check_consistent(sim)
