"""The relay's history trim costs what it drops, not a scan of the history per heartbeat.

Work is counted (keys a trim looks at), never timed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.transport.protocol.history import History, StepKeys
from harness import Sim


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["put", "pop", "trim"]), st.integers(0, 40), st.integers(0, 3)), max_size=300)
)
def test_step_ordered_history_matches_a_dict(ops):
    h = History(max_entries=25, max_bytes=1 << 20, by_step=True)
    model: dict = {}
    for op, step, origin in ops:
        key = (step, origin)
        if op == "put":
            for k in h.put(key, b"x" * (1 + origin)):
                del model[k]
            model.pop(key, None)
            model[key] = b"x" * (1 + origin)
            assert len(model) <= 25
        elif op == "pop":
            assert h.pop(key) == model.pop(key, None)
        else:
            dropped = h.discard_through(step)
            assert dropped == sum(1 for k in model if k[0] <= step)
            model = {k: v for k, v in model.items() if k[0] > step}
        assert sorted(h) == sorted(model) and h.nbytes == sum(map(len, model.values()))
        assert h.index_entries <= 2 * len(model) + 65  # removed keys do not pile up in the heap


def test_trim_looks_only_at_what_it_drops():
    keys = StepKeys()
    for step in range(1000):
        for origin in (3, 0, 2, 1):  # arrival order is not key order
            keys.add((step, origin))
    for floor in range(1000):
        assert keys.discard_through(floor) == [(floor, o) for o in range(4)]
        assert keys.discard_through(floor) == []  # the same floor again: nothing to look at
    assert keys.examined == 4000 and not keys


def test_relay_trims_once_per_rise_of_the_floor():
    sim = Sim(world_size=4, seed=3, loss=0.05, dup=0.05, max_delay=0.003)
    for r in range(4):
        sim.add_peer(r)
    sim.run(steps=30)
    relay = sim.relay
    kept = len(sim.sent) - len(relay.att.history)  # every forwarded update went into the history once
    # each key is looked at once when dropped (plus keys evicted or discarded earlier, none here)
    assert relay.att.history.examined == kept and relay.counts["history_evicted"] == 0
    # the last heartbeats may have raised the floor since the last timer: one trim catches up, at the same
    # cost of one look per dropped key
    relay.log.trim(relay.att)
    assert relay.att.history.examined == len(sim.sent) - len(relay.att.history)
    before = relay.att.history.examined
    for _ in range(1000):  # heartbeats that move nothing trim nothing
        relay.log.trim(relay.att)
    assert relay.att.history.examined == before
