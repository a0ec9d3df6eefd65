"""Relay and peer cores end to end in memory: exactly-once canonical delivery on a lossy link."""

from __future__ import annotations

import numpy as np
import pytest

from gradshare.hashing import param_hash
from gradshare.transport.protocol.peer.core import PeerCore
from harness import Sim, check_consistent, drive


@pytest.mark.parametrize(
    "seed,loss,dup,delay", [(0, 0.0, 0.0, 0.0), (1, 0.05, 0.05, 0.003), (2, 0.2, 0.1, 0.01), (3, 0.01, 0.2, 0.02)]
)
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
    ends = {r: e for r, e in sim.relay.att.cursor.ends.items()}
    assert ends == {0: 4, 1: 19, 2: -1, 3: 11}


def test_synchronous_staleness_zero():
    sim = Sim(world_size=2, seed=7, loss=0.1, staleness=0)
    for r in range(2):
        sim.add_peer(r)
    sim.run(steps=15)
    check_consistent(sim)


def test_silent_peer_is_declared_gone_and_the_log_goes_on():
    sim = Sim(world_size=3, seed=12, loss=0.02, liveness_timeout=0.5, on_rank_loss="continue")
    for r in range(3):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    for t in range(4):
        for r, p in sim.peers.items():
            payload = b"\x00\x00\x80\x3f" + np.int32(t * 3 + r + 1).tobytes()
            sim.sent[(t, r)] = payload
            p.send_update(t, payload, None, sim.now)
        drive(sim, lambda: all(p.complete_through >= t for p in sim.peers.values()))
    sim.silent.add(2)  # rank 2 goes quiet (no FINISHED, no LEAVE)
    for t in range(4, 8):
        for r in (0, 1):
            payload = b"\x00\x00\x80\x3f" + np.int32(t * 3 + r + 1).tobytes()
            sim.sent[(t, r)] = payload
            sim.peers[r].send_update(t, payload, None, sim.now)
    t0 = sim.now
    drive(sim, lambda: 2 in sim.relay.att.cursor.ends)
    assert sim.now - t0 <= 0.7 and sim.now - sim.relay.att.ranks[2].presence.last_heard > 0.5
    assert sim.relay.att.cursor.ends[2] == 3 and sim.relay.att.ranks[2].ended.gone
    for r in (0, 1):
        sim.peers[r].finish(7, sim.now)
    drive(sim, lambda: sim.relay.finished() and all(sim.peers[r].inbound.cursor.finished() for r in (0, 1)))
    check_consistent(sim)
    assert sim.relay.complete_through == 7


def test_new_attempt_cuts_log_and_resumes_from_snapshot():
    sim = Sim(world_size=2, seed=21, loss=0.05, dup=0.02, max_delay=0.002)
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    rng = np.random.default_rng(3)
    from transport_util import random_update

    for t in range(6):
        for r, p in sim.peers.items():
            if t == 5 and r == 1:
                continue  # rank 1 fails before sending step 5
            payload = random_update(rng, sim.N, 40)
            sim.sent[(t, r)] = payload
            p.send_update(t, payload, None, sim.now)
        drive(sim, lambda: sim.relay.complete_through >= min(t, 4))
    drive(sim, lambda: (5, 0) in sim.relay.att.pending or sim.relay.att.ranks[0].received.contiguous_from(0) == 6)
    assert sim.relay.complete_through == 4
    # Spark retries the stage: attempt 1 joins; the old attempt's datagrams are refused from now on
    old = dict(sim.peers)
    applied_before = sim.relay.counts["applied"]
    assert applied_before == 10
    for r in range(2):
        sim.add_peer(r, attempt=1)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    assert all(p.welcome.start_step == 5 for p in sim.peers.values())
    old[0].send_update(6, random_update(rng, sim.N, 5), None, sim.now)  # a straggler of attempt 0
    for d in old[0].datagrams_to_send():
        sim.relay.receive_datagram(d, 0, sim.now)
    for p in sim.peers.values():
        p.request_snapshot(sim.now)
    drive(sim, lambda: all(p.snaps.result is not None for p in sim.peers.values()))
    assert sim.relay.chan.drops["old_attempt"] >= 1
    for r, p in sim.peers.items():
        step, snap = p.snaps.result
        assert step == 4 and param_hash(snap) == param_hash(sim.relay.params)
        sim.params[r] = snap.copy()
    sim.sent = {k: v for k, v in sim.sent.items() if k[0] < 5}  # (5, 0) of attempt 0 is cut
    before = set(sim.sent)
    sim.run(steps=4)
    sim.sent = {k: v for k, v in sim.sent.items() if k not in before}
    sim.relay.counts["applied"] -= applied_before
    check_consistent(sim)
    assert sim.relay.complete_through == 8


def test_snapshot_survives_loss_and_reordering():
    sim = Sim(world_size=1, n_params=30_000, seed=31, loss=0.1, dup=0.05, max_delay=0.005)
    p = sim.add_peer(0)
    drive(sim, lambda: p.state == "joined")
    p.request_snapshot(sim.now)
    drive(sim, lambda: p.snaps.result is not None, max_iters=200_000)
    assert p.snaps.result[0] == -1 and np.array_equal(p.snaps.result[1], sim.p0)
    drive(sim, lambda: not sim.relay.snaps.transfers)  # SNAP_DONE freed the transfer (or it will expire)


def _second_snapshot(snap_done) -> PeerCore:
    """A peer downloads the initial snapshot, step 0 is applied, and it asks again: ``snap_done(held)``
    decides what becomes of the first download's SNAP_DONE (``held``, not yet sent) meanwhile."""
    sim = Sim(world_size=1, n_params=30_000, seed=33)
    p = sim.add_peer(0)
    drive(sim, lambda: p.state == "joined")
    p.request_snapshot(sim.now)
    drive(sim, lambda: p.snaps.result is not None)
    held = p.datagrams_to_send()  # the SNAP_DONE the completing chunk produced
    payload = sim.make_payload(5)
    sim.sent[(0, 0)] = payload
    p.send_update(0, payload, None, sim.now)
    drive(sim, lambda: sim.relay.complete_through == 0 and p.complete_through == 0)
    p.request_snapshot(sim.now)
    snap_done(sim, held)
    drive(sim, lambda: p.snaps.result is not None)
    step, params = p.snaps.result
    assert step == 0 and param_hash(params) == param_hash(sim.relay.params)
    return p


def test_second_snapshot_when_the_first_snap_done_arrives_after_the_request():
    """The peer shell sends a completed download's SNAP_DONE from its receiver thread, so it can reach the
    relay after the next fetch's request: the relay answered that request with the finished transfer,
    then forgot it, and the peer NAKed a snapshot id the relay no longer knew, until its timeout."""

    def late(sim, held):
        sim.pump()  # the new request reaches the relay first
        for d in held:
            sim.relay.receive_datagram(d, 0, sim.now)

    _second_snapshot(late)


def test_second_snapshot_when_the_first_snap_done_is_lost():
    """A lost SNAP_DONE leaves the relay holding the finished transfer of step -1: the next fetch must
    still get the parameters through step 0, not that old transfer again."""
    _second_snapshot(lambda sim, held: None)


def test_snapshot_download_survives_the_relay_dropping_its_transfer():
    """The relay drops a transfer on SNAP_DONE of its id (a late one, of an earlier download of the same
    shared snapshot) or when idle; it then drops the peer's NAKs too. The peer asks again."""
    sim = Sim(world_size=1, n_params=30_000, seed=34, snapshot_rate=1e6)  # 120 ms of chunks
    p = sim.add_peer(0)
    drive(sim, lambda: p.state == "joined")
    p.request_snapshot(sim.now)
    drive(sim, lambda: p.snaps.download is not None)
    sim.relay.snaps.done(0, p.snaps.download.info.snap_id)
    drive(sim, lambda: p.snaps.result is not None)
    assert p.snaps.result[0] == -1 and np.array_equal(p.snaps.result[1], sim.p0)
    assert sim.relay.chan.drops["stale_snapshot"] >= 1  # it did NAK the forgotten transfer first


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.floats(0, 0.3),
    st.floats(0, 0.2),
    st.floats(0, 0.02),
    st.integers(1, 4),
    st.integers(0, 2),
)
def test_any_seeded_lossy_link_is_exactly_once(seed, loss, dup, delay, world, staleness):
    sim = Sim(world_size=world, seed=seed, loss=loss, dup=dup, max_delay=delay, staleness=staleness)
    for r in range(world):
        sim.add_peer(r)
    sim.run(steps=8)
    check_consistent(sim)


def is_update(datagram: bytes) -> bool:
    from gradshare.transport.protocol.wire import HEADER, Kind

    return HEADER.unpack_from(datagram)[2] == Kind.UPDATE


def joined_cores(world: int = 3, n: int = 5000, datagram_size: int = 400):
    from gradshare.transport.testing import memory
    from transport_util import TOY

    return memory.joined_cores(world, n, b"k" * 32, 7, datagram_size=datagram_size, **TOY)


def test_relay_forwards_the_origins_datagrams_unchanged_and_replays_are_duplicates():
    from transport_util import random_update

    relay, peers = joined_cores()
    payload = random_update(np.random.default_rng(0), 5000, 300)  # several 400-byte chunks
    peers[0].send_update(0, payload, None, 0.0)
    sent = peers[0].datagrams_to_send()
    assert len(sent) > 2
    for d in sent:
        relay.receive_datagram(d, 0, 0.0)
    out = [(d, r) for d, r in relay.datagrams_to_send() if is_update(d)]  # not the ACK/STATUS
    # sealed once, by the origin: the relay sends the very same bytes to ranks 1 and 2 (no AEAD per chunk)
    assert sorted(out) == sorted((d, r) for d in sent for r in (1, 2))
    for d, r in out:
        peers[r].receive_datagram(d, "relay", 0.0)
    for r in (1, 2):
        got = peers[r].pop_ready()
        assert [(u.step, u.sender, u.payload) for u in got] == [(0, 0, payload)]
    # forwarded chunks skip the replay window (a retransmission is the original datagram), so a replayed
    # one must be caught by the (step, origin) bookkeeping: counted as a duplicate, never delivered twice
    before = peers[1].chan.drops["duplicate"]
    for d in sent:
        peers[1].receive_datagram(d, "relay", 0.0)
    assert peers[1].chan.drops["duplicate"] - before == len(sent)
    assert peers[1].pop_ready() == []
    # a forwarded chunk of the peer's OWN update, or an update "from" the relay itself, is refused
    peers[0].receive_datagram(sent[0], "relay", 0.0)
    assert peers[0].chan.drops["bad_sender"] == 1


def test_nak_that_crossed_the_forward_is_not_answered_but_a_later_one_is():
    from gradshare.transport.protocol import events as ev
    from transport_util import random_update

    relay, peers = joined_cores()
    peers[0].send_update(0, random_update(np.random.default_rng(1), 5000, 300), None, 0.0)
    for d in peers[0].datagrams_to_send():
        relay.receive_datagram(d, 0, 0.0)
    n_chunks = sum(1 for d, r in relay.datagrams_to_send() if r == 1 and is_update(d))
    nak = peers[1].chan.seal_control(ev.Nak((ev.NakItem(0, 0, ()),)))  # "I have none of (0, 0)"
    relay.receive_datagram(nak, 1, relay.tuning.nak_delay / 2)
    assert relay.counts["nak_crossed_forward"] == 1 and relay.counts["retransmits"] == 0
    nak = peers[1].chan.seal_control(ev.Nak((ev.NakItem(0, 0, ()),)))
    relay.receive_datagram(nak, 1, 2 * relay.tuning.nak_delay)  # asked again: really lost
    assert relay.counts["retransmits"] == n_chunks
    nak = peers[1].chan.seal_control(ev.Nak((ev.NakItem(0, 0, (1,)),)))  # specific chunks: always answered
    relay.receive_datagram(nak, 1, 2 * relay.tuning.nak_delay)
    assert relay.counts["retransmits"] == n_chunks + 1


def test_peer_naks_a_partial_of_the_newest_step_without_waiting_for_a_later_one():
    from transport_util import random_update

    relay, peers = joined_cores()
    peers[0].send_update(0, random_update(np.random.default_rng(2), 5000, 300), None, 0.0)
    for d in peers[0].datagrams_to_send():
        relay.receive_datagram(d, 0, 0.0)
    to1 = [d for d, r in relay.datagrams_to_send() if r == 1 and is_update(d)]
    for d in to1[:-1]:  # the last chunk is lost; nothing newer exists
        peers[1].receive_datagram(d, "relay", 0.001)
    t, naks = 0.001, 0
    while t < 0.05 and not naks:  # well before any heartbeat or STATUS
        t += peers[1].tuning.tick
        peers[1].handle_timer(t)
        naks = peers[1].io.counts["naks_sent"]
    assert naks == 1 and t < 4 * peers[1].tuning.nak_delay
