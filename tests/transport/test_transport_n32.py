"""The transport's failure checks at N = 32, in both forwarding modes,
on the in-memory simulation (tests/harness.py: the real cores, wire and crypto on a seeded lossy,
duplicating, reordering link): 1/5/20 % loss, a killed peer, and a flood of 10⁵ forged datagrams."""

from __future__ import annotations

import random

import pytest

from aggregate_util import aggregate_sim
from flood import FLOOD, make_flood
from gradshare.transport import param_hash
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN
from harness import RELAY, Sim, drive

# The same checks at small N are in the fast subset (test_transport_core, test_liveness_core, test_aggregate);
# at N = 32 they take ~50 s together on the shared 2-core machine.
pytestmark = pytest.mark.slow

W = 32
MODES = ["per-rank", "aggregate"]


def sim32(mode: str, **kw) -> Sim:
    # small messages (a few chunks at most): what scales here is the number of peers, not the payload
    if mode == "aggregate":
        return aggregate_sim(world_size=W, n_params=2000, **kw)
    return Sim(world_size=W, n_params=2000, **kw)


def check_log(sim: Sim, mode: str, steps: int) -> None:
    """Every live peer delivered the whole log exactly once, in order, and every replica equals the
    relay's parameters bit for bit."""
    if mode == "aggregate":
        want = [(t, AGGREGATE_ORIGIN) for t in range(steps)]
    else:
        want = sorted((t, r) for (t, r) in sim.sent)
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
    assert len(sim.sent) == 4 * W
    check_log(sim, mode, 4)
    c = sim.relay.counters()
    assert c["updates_in"] == 4 * W and c["applied"] == 4 * W
    assert sim.link.dropped > 0
    assert c["retransmits"] + sum(p.counters()["retransmits"] for p in sim.peers.values()) > 0


def send_step(sim: Sim, t: int, ranks) -> None:
    for r in ranks:
        payload = sim.make_payload(int(sim.rng.choice((3, 200))))
        sim.sent[(t, r)] = payload
        sim.peers[r].send_update(t, payload, None, sim.now)


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_peer_among_32_is_cut_and_the_log_goes_on(mode):
    sim = sim32(mode, seed=5, loss=0.02, dup=0.01, max_delay=0.002, liveness_timeout=0.3, on_rank_loss="continue")
    for r in range(W):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    for t in range(2):
        send_step(sim, t, range(W))
        drive(sim, lambda: all(p.complete_through >= t for p in sim.peers.values()))
    sim.silent.add(17)  # killed: no FINISHED, no LEAVE, never heard again
    sim.run(steps=5)
    assert sim.relay.att.ranks[17].ended.gone and sim.relay.att.cursor.ends[17] == 1
    assert [i.kind for i in sim.relay.liveness.incidents][-1] == "gone"
    # the killed rank's steps 0 and 1 stay in the log, nothing after them
    assert sorted(sim.sent) == sorted([(t, r) for t in range(5) for r in range(W) if r != 17] + [(0, 17), (1, 17)])
    check_log(sim, mode, 5)
    assert sim.relay.counters()["applied"] == 5 * (W - 1) + 2


def add_flood(sim: Sim, flood, per_tick: int) -> list[int]:
    """After every time step, ``per_tick`` forged datagrams at the relay (from addresses no peer has),
    interleaved with the genuine traffic until the flood is spent; returns the running count."""
    forged = [0]
    step_time = sim.step_time

    def step_with_flood(max_dt: float = 0.01) -> None:
        step_time(max_dt)
        for data in flood:
            sim.relay.receive_datagram(data, ("forger", forged[0] % 7), sim.now)
            forged[0] += 1
            if forged[0] % per_tick == 0:
                break

    sim.step_time = step_with_flood
    return forged


@pytest.mark.parametrize("mode", MODES)
def test_a_flood_of_forged_datagrams_during_an_exchange_of_32_peers(mode):
    sim = sim32(mode, seed=8, loss=0.01, dup=0.01, max_delay=0.002)
    captured: list[bytes] = []
    send = sim.link.send

    def tap(data, dst, src, now):
        if dst == RELAY and len(captured) < 2000:
            captured.append(data)
        send(data, dst, src, now)

    sim.link.send = tap
    forged = add_flood(sim, make_flood(sim.key, captured, random.Random(4), job=42, n=sim.N), per_tick=400)
    for r in range(W):
        sim.add_peer(r)
    sim.run(steps=6, entries=(3, 200))
    assert forged[0] == FLOOD, "the flood ended after the exchange: raise per_tick"
    check_log(sim, mode, 6)
    c = sim.relay.counters()
    assert c["updates_in"] == 6 * W and c["applied"] == 6 * W
    drops = c["drops"]
    for reason in ("malformed", "auth_failed", "wrong_job", "oversized", "replayed", "not_joined"):
        assert drops.get(reason, 0) > 0, (reason, drops)
    assert drops.get("bad_update", 0) == 0
    # every forged datagram is refused and counted (in memory nothing is lost to a socket buffer)
    assert sum(drops.values()) - drops.get("duplicate", 0) - drops.get("duplicate_chunk", 0) >= FLOOD


# --- a relay that cannot keep up --------------------------------------------------------------------------


def throttle(sim: Sim, rate: float, inbox: int) -> dict:
    """Make the relay slow: what reaches it waits in a bounded inbox of ``inbox`` datagrams (a full one
    drops the datagram and counts it, as a full socket buffer does) and the relay takes at most ``rate``
    datagrams per simulated second from it. Returns the inbox's counters."""
    queue: list = []
    stats = {"overflow": 0, "max_inbox": 0}
    receive = sim.relay.receive_datagram
    clock = {"last": sim.now, "credit": 0.0}

    def enqueue(data, src, now):
        if len(queue) >= inbox:
            stats["overflow"] += 1
            return
        queue.append((data, src))
        stats["max_inbox"] = max(stats["max_inbox"], len(queue))

    def drain():
        clock["credit"] = min(clock["credit"] + (sim.now - clock["last"]) * rate, inbox)
        clock["last"] = sim.now
        while queue and clock["credit"] >= 1:
            clock["credit"] -= 1
            data, src = queue.pop(0)
            receive(data, src, sim.now)

    step_time = sim.step_time

    def step_and_drain(max_dt: float = 0.01) -> None:
        step_time(min(max_dt, 0.002))  # the relay's own tick
        drain()

    sim.relay.receive_datagram = enqueue
    sim.step_time = step_and_drain
    return stats


@pytest.mark.parametrize("mode", MODES)
def test_a_relay_that_cannot_keep_up_slows_the_ranks_and_drops_nothing(mode):
    k, steps = 1, 8
    # datagrams/s the relay takes: heartbeats alone are W × 20/s, so aggregated (few datagrams a step) it
    # must be slower still to be what paces the ranks
    rate = 2000.0 if mode == "per-rank" else 1000.0
    fast = sim32(mode, seed=3, loss=0.01, dup=0.01, max_delay=0.002, staleness=k)
    for r in range(W):
        fast.add_peer(r)
    fast.run(steps=steps, entries=(3, 200))

    sim = sim32(mode, seed=3, loss=0.01, dup=0.01, max_delay=0.002, staleness=k)
    # an inbox of 64 datagrams: per rank, before the peer core backed off its NAKs for steps the relay may not
    # have, this made the run collapse rather than slow down (39 simulated s for these 8 steps, not 1.7)
    inbox = throttle(sim, rate, inbox=64)
    # Bounds, from the staleness rule (a rank sends step t once its log is complete through t-1-k):
    # aggregated, a peer's log is the relay's, so a rank sends at most k+1 steps past the relay's
    # complete_through. Per rank, a rank's own updates enter its log before the relay has them: the others
    # stop at k+1 past it and that rank at most k+1 past the others, so 2(k+1).
    ahead = k + 1 if mode == "aggregate" else 2 * (k + 1)
    # What the relay holds unapplied (pending or reassembling) is those steps of each rank; what the peers
    # hold undelivered likewise, and a rank's unacknowledged updates are its steps past the relay's.
    held = W * ahead
    # The history is trimmed to what every peer has delivered, which the relay learns from heartbeats
    # (every 50 ms); at this rate the log completes about one step in that time (W ranks × ~2 datagrams
    # of update, plus the heartbeats), so allow 4 steps of lag on top.
    history = W * (ahead + 4) if mode == "per-rank" else ahead + 4
    worst = {"ahead": 0, "relay_held": 0, "history": 0, "peer_held": 0, "unacked": 0}
    step_time = sim.step_time

    def watched(max_dt: float = 0.01) -> None:
        step_time(max_dt)
        rel = sim.relay
        live = [p for p in sim.peers.values() if p.own.next_step is not None]
        worst["ahead"] = max([worst["ahead"]] + [p.own.next_step - 1 - rel.complete_through for p in live])
        worst["relay_held"] = max(worst["relay_held"], len(rel.att.pending) + len(rel.att.reasm))
        worst["history"] = max(worst["history"], len(rel.att.history))
        worst["peer_held"] = max([worst["peer_held"]] + [len(p.inbound.inbox) + len(p.inbound.reasm) for p in live])
        worst["unacked"] = max([worst["unacked"]] + [len(p.own.unacked.bodies) for p in live])

    sim.step_time = watched
    for r in range(W):
        sim.add_peer(r)
    sim.run(steps=steps, entries=(3, 200), max_iters=10**6)
    check_log(sim, mode, steps)
    c = sim.relay.counters()
    assert c["updates_in"] == steps * W and c["applied"] == steps * W
    assert inbox["overflow"] > 0  # it really could not keep up: its inbox overflowed
    assert sim.now > 1.5 * fast.now, (sim.now, fast.now)  # and the ranks went at its pace,
    assert sim.now < 0.5 * steps, sim.now  # slowed, not collapsed: ~2 simulated s (per rank 39 s before)
    assert worst["ahead"] <= ahead, worst
    assert worst["relay_held"] <= held and worst["peer_held"] <= held, worst
    assert worst["unacked"] <= ahead + 1, worst
    assert worst["history"] <= history, worst
