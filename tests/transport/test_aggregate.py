"""Aggregated forwarding: the relay's aggregate against a NumPy oracle, and the
protocol in aggregate mode (exactly once per step, bit-identical replicas) over a lossy in-memory link,
a stage restart, and real sockets through the fault proxy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregate_util import aggregate_sim, real_apply, real_payload, real_update
from gradshare.encoding import CalibratedThreshold, apply_update, decode_entries, decode_update
from gradshare.encoding.aggregate import AggregateState, aggregate_step
from gradshare.transport import Relay, RelayTuning, new_job_key, param_hash
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN
from gradshare.transport.testing.fault_proxy import FaultProxy
from harness import Sim, drive
from naive import accumulate_encode, naive_kth_largest_abs
from naive import apply as naive_apply

# --- the aggregate against the oracle -------------------------------------------------------------------


def oracle_step(residual, buffers_n, updates, density):
    """(residual after, entry codes, τ or None, buffer index, buffer values) of one aggregate, by hand:
    add each message's ±τ in rank order, τ = the k-th largest |residual| (one float32 ulp up when more
    than 2× the target share reach it: a tie), Strom's rule; buffers summed."""
    r = residual.copy()
    for u in updates:
        idx, sign = decode_entries(u.message)
        r = naive_apply(2 * idx + (sign < 0), u.message.threshold, r)
    tau = naive_kth_largest_abs(r, density)
    if tau is None:
        r_after, codes = r, np.empty(0, np.int64)
    else:
        if sum(abs(v) >= np.float32(tau) for v in r) > 2 * density * r.size + 1:
            tau = np.nextafter(np.float32(tau), np.float32(np.inf))
        r_after, codes = accumulate_encode(r, None, np.float32(tau))
    total = np.zeros(buffers_n, np.float32)
    touched = set()
    for u in updates:
        for i, v in zip(u.buffer_index, u.buffer_value):
            total[i] = np.float32(total[i] + v)
            touched.add(int(i))
    where = np.array(sorted(touched), np.uint32)
    return r_after, codes, tau, where, total[where]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),
    ranks=st.integers(1, 5),
    buffers=st.integers(0, 6),
    density=st.sampled_from([0.002, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**31),
    steps=st.integers(1, 3),
)
def test_aggregate_matches_the_numpy_oracle(n, ranks, buffers, density, seed, steps):
    rng = np.random.default_rng(seed)
    state = AggregateState(n, buffers, CalibratedThreshold(density=density, min_entries=0))
    residual = np.zeros(n, np.float32)
    for step in range(steps):  # several steps: what one step leaves in the residual goes on
        updates = [real_update(rng, n, int(rng.integers(0, n + 1)), buffers) for _ in range(ranks)]
        want_r, want_codes, want_tau, want_b, want_v = oracle_step(residual, buffers, updates, density)
        got = aggregate_step(state, updates, step)
        idx, sign = decode_entries(got.message)
        assert np.array_equal(2 * idx + (sign < 0), want_codes)
        if len(want_codes):
            assert got.message.threshold == np.float32(want_tau)
        assert np.array_equal(state.residual, want_r)
        assert np.array_equal(got.buffer_index, want_b) and np.array_equal(got.buffer_value, want_v)
        residual = want_r
        decode_update(got.to_bytes(buffers), n + buffers, n_params=n)  # a valid update on the wire


def test_aggregate_keeps_what_it_does_not_send_and_refuses_a_foreign_size():
    rng = np.random.default_rng(1)
    state = AggregateState(5000, rule=CalibratedThreshold(density=1e-3, min_entries=0))
    ups = [real_update(rng, 5000, 50) for _ in range(8)]
    agg = aggregate_step(state, ups, 0)
    # 8 ranks × 50 entries in, about 5 out: the rest stays in the relay's residual, nothing is lost
    sent = np.zeros(5000, np.float32)
    apply_update(agg, sent)
    total = np.zeros(5000, np.float32)
    for u in ups:
        apply_update(u, total)
    assert agg.message.n_entries < 50
    assert np.allclose(sent + state.residual, total, atol=1e-5)
    before = state.residual.copy()
    with pytest.raises(ValueError, match=r"updates\[1\] is for 10 parameters"):
        aggregate_step(state, [real_update(rng, 5000, 3), real_update(rng, 10, 3)], 1)
    assert np.array_equal(state.residual, before)  # nothing of a refused row was added
    with pytest.raises(ValueError, match=r"updates\[0\] changes buffer entry"):
        aggregate_step(state, [real_update(rng, 5000, 3, buffers=4)], 1)


# --- the protocol in aggregate mode (in-memory link) -------------------------------------------------------


def check_aggregated(sim: Sim, first: int, last: int) -> None:
    """Every live peer got the aggregate of every step first..last exactly once, in order, and nothing
    else; every replica equals the relay's parameters bit for bit."""
    want = [(t, AGGREGATE_ORIGIN) for t in range(first, last + 1)]
    for r, delivered in sim.delivered.items():
        if r in sim.silent:
            continue
        assert [(u.step, u.sender) for u in delivered] == want, f"rank {r}"
        assert param_hash(sim.params[r]) == param_hash(sim.relay.params), f"rank {r}"


@pytest.mark.parametrize("loss, big", [(0.0, None), (0.05, None), (0.05, 8192)])
def test_aggregate_mode_is_exactly_once_per_step_and_bit_identical(loss, big):
    # big: the relay seals its aggregates in datagrams of snapshot_datagram_size (one or two here)
    sim = aggregate_sim(
        seed=7, loss=loss, dup=0.02 if loss else 0.0, max_delay=0.003 if loss else 0.0, snapshot_datagram_size=big
    )
    for r in range(sim.W):
        sim.add_peer(r)
    sim.run(steps=12, entries=(3, 40, 300))
    check_aggregated(sim, 0, 11)
    c = sim.relay.counters()
    assert c["aggregates"] == 12 and c["updates_in"] == 12 * sim.W
    # one message per step and peer (a few chunks each), where per-rank forwarding sends W - 1
    assert 12 * sim.W <= c["forwarded"] < 12 * sim.W * (sim.W - 1)
    if big:
        assert c["forwarded"] <= 12 * sim.W * 2
    if loss:
        assert c["retransmits"] > 0  # NAK repair from the relay's history of aggregates


def test_ranks_of_unequal_length_end_the_aggregated_log_at_the_last_step():
    sim = aggregate_sim(world_size=3, seed=3)
    for r in range(3):
        sim.add_peer(r)
    sim.run(steps=0, last_step={0: 4, 1: 9, 2: 6})
    check_aggregated(sim, 0, 9)
    assert sim.relay.counters()["updates_in"] == 5 + 10 + 7


def test_the_aggregate_of_a_step_waits_for_a_paused_rank():
    # on_rank_loss="wait" (the default): a silent rank is suspected, the step's aggregate waits for it,
    # and when it comes back everything goes on with nothing lost or repeated
    sim = aggregate_sim(world_size=3, seed=12, liveness_timeout=0.3)
    for r in range(3):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    sim.silent.add(2)
    for r in (0, 1):
        sim.peers[r].send_update(0, real_payload(sim.rng, sim.N, 30), None, sim.now)
    t0 = sim.now
    drive(sim, lambda: sim.now - t0 > 1.0)
    assert [i.kind for i in sim.relay.liveness.incidents] == ["suspected"] and sim.relay.complete_through == -1
    assert sim.relay.counters()["aggregates"] == 0
    sim.silent.discard(2)
    sim.run(steps=5)
    check_aggregated(sim, 0, 4)
    assert [i.kind for i in sim.relay.liveness.incidents] == ["suspected", "back"]


def test_a_rank_declared_gone_leaves_the_aggregates_to_the_others():
    # on_rank_loss="continue": a silent rank is cut (here before its first step); the aggregates of
    # every step then hold the live ranks' messages only, and the log completes
    sim = aggregate_sim(world_size=3, seed=9, liveness_timeout=0.3, on_rank_loss="continue")
    for r in range(3):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    sim.silent.add(2)
    sim.run(steps=6)
    check_aggregated(sim, 0, 5)
    assert sim.relay.att.ranks[2].ended.gone and sim.relay.counters()["updates_in"] == 12
    assert sim.relay.counters()["aggregates"] == 6


def test_a_restarted_attempt_resumes_the_aggregated_log_after_complete_through():
    sim = aggregate_sim(world_size=2, seed=11)
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    for t in range(5):
        for p in sim.peers.values():
            p.send_update(t, real_payload(sim.rng, sim.N, 60), None, sim.now)
        drive(sim, lambda: sim.relay.complete_through >= t)
    sim.peers[0].send_update(5, real_payload(sim.rng, sim.N, 60), None, sim.now)  # rank 1 dies before 5
    drive(sim, lambda: sim.relay.att.ranks[0].received.contiguous_from(0) == 6)
    residual = sim.relay.log.aggregator.residual.copy()
    for r in range(2):  # Spark retries the stage
        sim.add_peer(r, attempt=1)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    assert all(p.welcome.start_step == 5 and p.inbound.aggregate for p in sim.peers.values())
    # the relay's residual belongs to the log through step 4: the new attempt keeps it
    assert np.array_equal(sim.relay.log.aggregator.residual, residual)
    for p in sim.peers.values():
        p.request_snapshot(sim.now)
    drive(sim, lambda: all(p.snaps.result is not None for p in sim.peers.values()))
    for r, p in sim.peers.items():
        assert p.snaps.result[0] == 4
        sim.params[r] = p.snaps.result[1].copy()
    sim.run(steps=4)
    check_aggregated(sim, 5, 8)
    assert sim.relay.counters()["aggregates"] == 9


# --- real sockets, lossy ----------------------------------------------------------------------------------


@pytest.mark.sockets
def test_aggregate_mode_through_the_lossy_fault_proxy():
    from transport_util import N, exchange

    key = new_job_key()
    with (
        Relay(
            np.zeros(N, np.float32), 3, key, 9, port=0, bind="127.0.0.1", tuning=RelayTuning(forwarding="aggregate")
        ) as relay,
        FaultProxy(relay.address, loss=0.05, duplicate=0.02, reorder=0.05, delay=0.002, seed=4) as proxy,
    ):
        params, logs, _, counters = exchange(
            relay,
            key,
            3,
            20,
            np.random.default_rng(2),
            address=proxy.address,
            entries=(3, 300),
            make=real_payload,
            apply=real_apply,
        )
        for r in range(3):
            assert logs[r] == [(t, AGGREGATE_ORIGIN) for t in range(20)]
            assert param_hash(params[r]) == relay.param_hash()
        c = relay.counters()
        assert c["aggregates"] == 20 and c["applied"] == 60
        assert proxy.stats["dropped"] > 0
        assert c["retransmits"] + sum(pc["retransmits"] for pc in counters) > 0


def test_welcome_says_whether_the_log_is_aggregated_and_decodes_both_forms():
    import msgpack  # the control bodies' encoding (wire.py)

    from gradshare.errors import DecodeError
    from gradshare.transport.protocol import events as ev
    from gradshare.transport.protocol import wire

    for agg in (False, True):
        msg = ev.Welcome(10, 2, 0, -1, (("checkpoint", 2.0),), agg)
        kind, body = wire.encode_control(msg)
        assert wire.decode_control(kind, body) == msg
    with pytest.raises(DecodeError, match="WELCOME"):
        wire.decode_control(wire.Kind.WELCOME, msgpack.packb([10, 2, 0, -1, [], True, 1]))  # a field too many
    with pytest.raises(DecodeError):
        wire.decode_control(wire.Kind.WELCOME, msgpack.packb([10, 2, 0, -1, [], 1]))  # not a bool


def test_an_aggregating_peer_takes_no_rank_sealed_update():
    sim = aggregate_sim(world_size=2, seed=5)
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    p0, p1 = sim.peers[0], sim.peers[1]
    p0.send_update(0, real_payload(sim.rng, sim.N, 20), None, sim.now)
    for d in p0.datagrams_to_send():  # as if the relay forwarded rank 0's own datagrams per rank
        p1.receive_datagram(d, "relay", sim.now)
    assert p1.chan.drops["bad_sender"] >= 1 and not p1.inbound.inbox and not p1.inbound.ready
