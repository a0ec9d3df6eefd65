"""STATUS pages: jobs of more than STATUS_PAGE_RANKS ranks, heartbeats cheap at N = 256."""

from __future__ import annotations

import numpy as np
import pytest

from gradshare.bench.heartbeat import heartbeat_traffic
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.testing.memory import joined_cores
from harness import Sim


def test_page_bounds_are_checked_in_the_constructor():
    with pytest.raises(ValueError, match="outside this page"):
        ev.Status(0, -1, 200, 64, (1, 2), (ev.Ended(3, 0, False),))
    with pytest.raises(ValueError, match="have must list"):
        ev.Status(0, -1, 200, 190, tuple(range(11)), ())  # runs past world_size
    with pytest.raises(ValueError, match="have must list"):
        ev.Status(0, -1, 300, 0, tuple(range(ev.STATUS_PAGE_RANKS + 1)), ())
    with pytest.raises(ValueError, match="first_rank"):
        ev.Status(0, -1, 4, 4, (1,), ())
    with pytest.raises(ValueError, match="world_size"):
        ev.Status(0, -1, ev.MAX_WORLD_SIZE + 1, 0, (1,), ())


@pytest.mark.parametrize("datagram_size", [wire.MIN_DATAGRAM_SIZE, 600, wire.DEFAULT_DATAGRAM_SIZE])
def test_a_worst_case_page_fits_one_datagram(datagram_size):
    """The relay's page size for this datagram size, every rank ended at the largest step: still fits."""
    relay, _ = joined_cores(2, 10, b"k" * 32, 1, datagram_size=datagram_size)
    n = relay.pages.ranks_per_page
    big = ev.MAX_STEP
    page = ev.Status(
        big,
        big,
        ev.MAX_WORLD_SIZE,
        ev.MAX_WORLD_SIZE - n,
        (big,) * n,
        tuple(ev.Ended(ev.MAX_WORLD_SIZE - n + i, big, True) for i in range(n)),
    )
    chan = Channel(
        key=b"k" * 32,
        insecure=False,
        job=1,
        sender=wire.RELAY_ID,
        attempt=0,
        datagram_size=datagram_size,
        max_chunks=16,
        max_windows=4,
    )
    sealed = chan.seal_control(page)
    assert len(sealed) <= datagram_size
    assert wire.decode_control(wire.Kind.STATUS, wire.encode_control(page)[1]) == page


def test_ranks_in_several_pages_join_exchange_and_end_on_a_lossy_link():
    """Small datagrams make small pages (19 ranks at 400 bytes), so 45 ranks take 3 pages, as 256 ranks do
    at 1400 bytes: every peer delivers the same log through loss and duplication, and a rank of the last
    page that finishes early is cut at its last step by every peer (that page's STATUS tells them)."""
    W = 45
    sim = Sim(world_size=W, n_params=300, seed=3, loss=0.02, dup=0.01, max_delay=0.002, datagram_size=400)
    assert sim.relay.pages.n_pages == 3
    for r in range(W):
        sim.add_peer(r)
    sim.run(2, entries=(1, 3), last_step={W - 1: 0})
    logs = {r: [(u.step, u.sender) for u in d] for r, d in sim.delivered.items()}
    expected = sorted([(t, s) for t in range(2) for s in range(W) if not (s == W - 1 and t > 0)])
    assert all(log == expected for log in logs.values())
    ref = sim.params[0]
    assert all(np.array_equal(p, ref) for p in sim.params.values())
    assert np.array_equal(sim.relay.params, ref)


def test_every_heartbeat_gets_one_page_and_the_pages_take_turns():
    W = 200
    relay, peers = joined_cores(W, 10, b"k" * 32, 1)
    relay.datagrams_to_send()
    pages = relay.pages.n_pages
    assert pages == -(-W // relay.pages.ranks_per_page) and pages > 1
    seen = []
    for i in range(pages):
        p = peers[5]
        p.handle_timer(1.0 + i)  # heartbeat_interval has passed: one HEARTBEAT
        for d in p.datagrams_to_send():
            relay.receive_datagram(d, 5, 1.0 + i)
        out = relay.datagrams_to_send()
        statuses = []
        for data, addr in out:
            h = relay.chan.parse(data)
            if h.kind == wire.Kind.STATUS:
                statuses.append(wire.decode_control(h.kind, relay.chan.open(h, data)))
            p.receive_datagram(data, "relay", 1.0 + i)
        assert len(statuses) == 1 and all(a == 5 for _, a in out)
        seen.append(statuses[0].first_rank)
    assert sorted(seen) == [k * relay.pages.ranks_per_page for k in range(pages)]


def test_heartbeat_traffic_per_peer_does_not_grow_with_n():
    """Idle control traffic at the relay is one page per heartbeat: linear in N in total, so the bytes each
    peer receives per second stay flat (before paging they grew with N: one entry per rank each time)."""
    small, large = heartbeat_traffic(8, seconds=0.3), heartbeat_traffic(256, seconds=0.3)
    per_peer = [h["out_datagrams_per_s"] / h["peers"] for h in (small, large)]
    assert per_peer[0] == pytest.approx(per_peer[1], rel=0.05)
    # a page holds at most STATUS_PAGE_RANKS ranks, so per-peer bytes may grow until N fills a page, no more
    assert large["out_bytes_per_peer_per_s"] < 20 * wire.DEFAULT_DATAGRAM_SIZE * 1.05


def _page_by_hand(relay, page: int) -> ev.Status:
    start, n = relay.att.cursor.start_step, relay.pages.ranks_per_page
    ranks = list(relay.att.ranks)[page * n : (page + 1) * n]
    return ev.Status(
        start,
        relay.complete_through,
        relay.world_size,
        page * n,
        tuple(r.received.contiguous_from(start) - 1 for r in ranks),
        tuple(r.ended for r in ranks if r.ended is not None),
    )


def test_a_kept_page_is_served_until_what_it_shows_changes():
    """The relay keeps each page as last built (every peer's heartbeat asks for one, 20 times a second):
    an update of one of its ranks, a rank's end and complete_through moving each give a fresh page."""
    from gradshare.encoding import encode

    W = 200
    relay, peers = joined_cores(W, 10, b"k" * 32, 1)
    relay.datagrams_to_send()
    n = relay.pages.ranks_per_page
    empty = encode(np.zeros(10, np.float32), None, 1.0).to_bytes()
    kept = [relay.status_page(p) for p in range(relay.pages.n_pages)]
    assert all(relay.status_page(p) is kept[p] for p in range(relay.pages.n_pages))  # nothing changed

    def send(rank: int, step: int) -> None:
        peers[rank].send_update(step, empty, None, 0.1)
        for d in peers[rank].datagrams_to_send():
            relay.receive_datagram(d, rank, 0.1)

    send(3, 0)  # rank 3 is on page 0
    assert relay.status_page(0).have[3] == 0 and relay.status_page(0) == _page_by_hand(relay, 0)
    assert relay.status_page(1) is kept[1]
    peers[n + 1].finish(-1, 0.2)  # a rank of page 1 ends before its first step
    for d in peers[n + 1].datagrams_to_send():
        relay.receive_datagram(d, n + 1, 0.2)
    assert [e.rank for e in relay.status_page(1).ended] == [n + 1] and relay.status_page(1) == _page_by_hand(relay, 1)
    for r in range(W):
        if r not in (3, n + 1):
            send(r, 0)
    relay.apply_pending()
    assert relay.complete_through == 0
    assert all(relay.status_page(p) == _page_by_hand(relay, p) for p in range(relay.pages.n_pages))
    assert relay.status_page(2).complete_through == 0
