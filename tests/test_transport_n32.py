"""The transport's failure checks at N = 32 (issue 13, "Bad input and failures"), in both forwarding modes,
on the in-memory simulation (tests/harness.py: the real cores, wire and crypto on a seeded lossy,
duplicating, reordering link): 1/5/20 % loss, a killed peer, and a flood of 10⁵ forged datagrams."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gradshare.transport import param_hash
from gradshare.transport.events import AGGREGATE_ORIGIN
from harness import RELAY, Sim, drive
from test_aggregate import aggregate_sim
from test_transport_flood import make_flood

W = 32
MODES = ["per-rank", "aggregate"]


def sim32(mode: str, **kw) -> Sim:
    # small messages (a few chunks at most): what scales here is the number of peers, not the payload
    if mode == "aggregate":
        return aggregate_sim(world_size=W, n_params=2000, **kw)
    return Sim(world_size=W, n_params=2000, **kw)


def check_log(sim: Sim, mode: str, steps: int, ranks=None) -> None:
    """Every live peer delivered the whole log exactly once, in order, and every replica equals the
    relay's parameters bit for bit."""
    ranks = range(W) if ranks is None else ranks
    if mode == "aggregate":
        want = [(t, AGGREGATE_ORIGIN) for t in range(steps)]
    else:
        want = sorted((t, r) for (t, r) in sim.sent)
    assert len(want) == (steps if mode == "aggregate" else steps * len(ranks))
    for r, delivered in sim.delivered.items():
        if r in sim.silent:
            continue
        assert [(u.step, u.sender) for u in delivered] == want, f"rank {r}"
        assert param_hash(sim.params[r]) == param_hash(sim.relay.params), f"rank {r}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", [0.01, 0.05, 0.20])
def test_32_peers_on_a_lossy_duplicating_reordering_link_are_exactly_once(mode, loss):
    sim = sim32(mode, seed=int(loss * 100), loss=loss, dup=0.02, max_delay=0.003)
    for r in range(W):
        sim.add_peer(r)
    sim.run(steps=4, entries=(3, 200))
    check_log(sim, mode, 4)
    c = sim.relay.counters()
    assert c["updates_in"] == 4 * W and c["applied"] == 4 * W
    assert sim.link.dropped > 0
    assert c["retransmits"] + sum(p.counters()["retransmits"] for p in sim.peers.values()) > 0
