"""The relay's `apply_step` plug-in (a step cap needs a whole step at once): over a lossy, duplicating,
reordering in-memory link, per-rank and aggregated, the relay hands it each step's complete row once, in
rank order, and its capped parameters are the bits a replica gets by applying what it was delivered one
whole step at a time."""

from __future__ import annotations

import itertools

import pytest

from aggregate_util import real_payload
from gradshare.encoding import apply_update, decode_update
from gradshare.encoding.step_cap import StepCap, apply_step
from gradshare.transport import param_hash
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN
from harness import Sim


@pytest.mark.parametrize("forwarding", ["per-rank", "aggregate"])
def test_the_relay_applies_whole_steps_capped_as_every_replica_does(forwarding):
    n, world, steps = 3000, 4, 10
    cap_holder: list[StepCap] = []
    rows: list[list[int]] = []  # the entries of each row the relay applied, to see whole steps

    def capped(decoded, params):
        rows.append([d.message.n_entries for d in decoded])
        apply_step(decoded, params, 1.0, cap_holder[0])

    sim = Sim(
        world_size=world,
        n_params=n,
        seed=5,
        loss=0.05,
        dup=0.02,
        max_delay=0.003,
        forwarding=forwarding,
        decode_update=lambda p, k: decode_update(p, k, n_params=k),
        apply_step=capped,
    )
    # three "tensors"; a cap that binds on every step (the entries are ±τ of 0.01-3: far above 1e-3 × the norm)
    cap_holder.append(StepCap.of([1000, 1500, 500], sim.p0, 1e-3))
    sim.make_payload = lambda n_entries: real_payload(sim.rng, sim.N, n_entries)
    sim.apply_payload = lambda payload, params: None  # the replicas are rebuilt below, step by step
    for r in range(world):
        sim.add_peer(r)
    sim.run(steps=steps, entries=(3, 40, 300))
    assert len(rows) == steps  # one call per step of the log ...
    assert all(len(r) == (world if forwarding == "per-rank" else 1) for r in rows)  # ... with its whole row
    for r in range(world):
        delivered = sim.delivered[r]
        if forwarding == "aggregate":
            assert {u.sender for u in delivered} == {AGGREGATE_ORIGIN}
        replica = sim.p0.copy()
        for _, group in itertools.groupby(delivered, key=lambda u: u.step):
            apply_step([decode_update(u.payload, n, n_params=n) for u in group], replica, 1.0, cap_holder[0])
        assert param_hash(replica) == param_hash(sim.relay.params), f"rank {r}"
    plain = sim.p0.copy()  # and the cap did bind
    for u in sim.delivered[0]:
        apply_update(decode_update(u.payload, n, n_params=n), plain)
    assert param_hash(plain) != param_hash(sim.relay.params)
