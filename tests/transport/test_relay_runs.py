"""RelayCore.receive_run (a GRO read's datagrams, with the fast path for the next chunk of the same update)
does exactly what receive_datagram does one datagram at a time: same drops, counters, log, parameters and
datagrams out, whatever the stream holds (duplicates, losses, reordering, forgeries, truncations)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradshare.encoding import encode
from gradshare.encoding.aggregate import AggregateState
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.crypto import Sealer, new_job_key
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.tuning import RelayTuning

WORLD, PARAMS, DGRAM = 3, 40_000, 256  # small datagrams: each update is several chunks
KEY = new_job_key()


def _plain(out: list) -> list:
    """What datagrams say (addresses, headers but the relay's random session, bodies opened): two relays in
    the same state seal it under different sessions."""
    sealer, said = Sealer(KEY), []
    for item in out:
        if item[0] == "event":
            said.append(item)
            continue
        d, addr = item
        h = wire.decode_header(d, 1 << 16)
        body = sealer.open(d[: wire.HEADER_BYTES], h.sender, h.session, h.counter, d[wire.HEADER_BYTES :])
        assert body is not None
        said.append((addr, h._replace(session=0), body))
    return said


def _payloads(seed: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        r = np.zeros(PARAMS, np.float32)
        r[rng.choice(PARAMS, 2000, replace=False)] = rng.choice(np.float32([-2e-3, 2e-3]), 2000)
        out.append(encode(r, None, 1e-3).to_bytes())
    return out


def _setup(forwarding: str) -> tuple[list[RelayCore], list[tuple[bytes, int]]]:
    """Two relays in the same state (the same JOINs fed to both) and the update datagrams of 2 steps of
    every rank, in send order."""
    peers = [PeerCore(r, WORLD, 0, KEY, 7, PARAMS, now=0.0, datagram_size=DGRAM) for r in range(WORLD)]
    joins = []
    for r, p in enumerate(peers):
        p.join(0.0)
        joins += [(d, r) for d in p.datagrams_to_send()]
    relays = []
    for _ in range(2):
        agg = AggregateState(PARAMS) if forwarding == "aggregate" else None
        relay = RelayCore(
            np.zeros(PARAMS, np.float32),
            WORLD,
            KEY,
            7,
            now=0.0,
            datagram_size=DGRAM,
            tuning=RelayTuning(forwarding=forwarding),
            aggregator=agg,
            defer_apply=True,
        )
        for d, r in joins:
            relay.receive_datagram(d, r, 0.0)
        relays.append(relay)
    welcome = relays[0].datagrams_to_send()
    assert _plain(welcome) == _plain(relays[1].datagrams_to_send())  # the same state: the same answers
    for d, addr in welcome:
        peers[addr].receive_datagram(d, "relay", 0.0)
    for relay in relays:
        while relay.next_event() is not None:  # the joins': taken, as the shell does
            pass
    payloads = _payloads(1, 2 * WORLD)
    stream = []
    for step in range(2):
        for r, p in enumerate(peers):
            p.send_update(step, payloads[step * WORLD + r], None, 0.0)
            stream += [(d, r) for d in p.datagrams_to_send() if wire.decode_header(d, 64).kind == wire.Kind.UPDATE]
    return relays, stream


def _mangle(stream: list[tuple[bytes, int]], ops: list[tuple[int, int, int]]) -> list[tuple[bytes, int]]:
    out = list(stream)
    for op, i, v in ops:
        if not out:
            break
        i %= len(out)
        d, a = out[i]
        if not d:
            continue
        if op == 0:  # duplicate
            out.insert(i, (d, a))
        elif op == 1:  # lose
            del out[i]
        elif op == 2:  # move later
            out.insert(min(len(out), i + 1 + v % 5), out.pop(i))
        elif op == 3:  # flip a byte (header or body)
            j = v % len(d)
            out[i] = (d[:j] + bytes([d[j] ^ (1 + v % 255)]) + d[j + 1 :], a)
        elif op == 4:  # truncate
            out[i] = (d[: v % len(d)], a)
        elif op == 5:  # from another address
            out[i] = (d, (a + 1) % WORLD)
    return out


def _shell(relay: RelayCore, sent: list) -> None:
    """What the relay's shell does after feeding datagrams: send, apply, take the events."""
    sent += relay.datagrams_to_send()
    if relay.apply_due:
        relay.apply_pending()
        sent += relay.datagrams_to_send()
    while (e := relay.next_event()) is not None:
        sent.append(("event", e))


def _feed_one_by_one(relay: RelayCore, reads: list[list[tuple[bytes, int]]]) -> list:
    sent: list = []
    for k, read in enumerate(reads):
        for d, a in read:
            relay.receive_datagram(d, a, 0.001 * k)
            _shell(relay, sent)
    return sent


def _feed_runs(relay: RelayCore, reads: list[list[tuple[bytes, int]]]) -> list:
    sent: list = []
    for k, read in enumerate(reads):
        run, addr = [d for d, _ in read], read[0][1]
        i = 0
        while i < len(run):
            i = relay.receive_run(run, i, addr, 0.001 * k)
            _shell(relay, sent)
    return sent


def _reads(stream: list[tuple[bytes, int]], cuts: list[int]) -> list[list[tuple[bytes, int]]]:
    """Consecutive datagrams from one address, cut where ``cuts`` says: what GRO reads could hold."""
    reads: list[list[tuple[bytes, int]]] = []
    for n, (d, a) in enumerate(stream):
        if not reads or reads[-1][0][1] != a or (cuts and cuts[n % len(cuts)] == 0):
            reads.append([])
        reads[-1].append((d, a))
    return reads


@pytest.mark.parametrize("forwarding", ["per-rank", "aggregate"])
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10_000), st.integers(0, 10_000)), max_size=12),
    cuts=st.lists(st.integers(0, 7), max_size=20),
)
@example(ops=[(3, 1, 34)], cuts=[])  # the second chunk's index byte flipped past its count: malformed
def test_a_run_does_what_its_datagrams_do_one_by_one(forwarding, ops, cuts):
    (one, runs), stream = _setup(forwarding)
    reads = _reads(_mangle(stream, ops), cuts)
    assert _plain(_feed_runs(runs, reads)) == _plain(_feed_one_by_one(one, reads))
    assert runs.counters() == one.counters()
    assert runs.param_hash() == one.param_hash() and runs.complete_through == one.complete_through
    assert sorted(runs.att.pending) == sorted(one.att.pending) and sorted(runs.att.reasm.partials) == sorted(
        one.att.reasm.partials
    )


def test_a_clean_stream_completes_every_update_through_the_fast_path():
    (one, runs), stream = _setup("aggregate")
    reads = _reads(stream, [])
    assert len(reads) == 2 * WORLD and all(len(r) > 5 for r in reads)  # one read per update
    fast_path = []
    next_chunk = runs.log.next_chunk

    def counted(att, last, data, now):
        took = next_chunk(att, last, data, now)
        if took:
            fast_path.append(data)
        return took

    runs.log.next_chunk = counted  # type: ignore[method-assign]
    before = runs.counters()["datagrams_in"]
    _feed_runs(runs, reads)
    assert runs.complete_through == 1 and runs.counters()["updates_in"] == 2 * WORLD
    assert runs.counters()["datagrams_in"] - before == len(stream) and not runs.chan.drops
    assert fast_path == [d for r in reads for d, _ in r[1:]]  # all but each update's first chunk
