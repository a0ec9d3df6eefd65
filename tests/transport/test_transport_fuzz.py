"""Any bytes into the relay or peer core: handled, or dropped with a counted reason; state stays valid."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.events import Join
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.wire import RELAY_ID
from transport_util import TOY

KEY = b"K" * 32
N, W = 300, 3
JOIN_BODY = wire.encode_control(Join(N, W))[1]
UPDATE_BODY = wire.encode_update_body(b"\x00\x00\x80\x3f" + bytes([5, 0, 0, 0]), StepMeta(loss=1.0))


def forged(kind, sender, attempt, origin, step, index, count, body, job=42, key=KEY, counter=0):
    """A datagram sealed with the job key (or another key): it passes or fails AEAD as chosen."""
    ch = Channel(
        key=key,
        insecure=False,
        job=job,
        sender=sender,
        attempt=attempt,
        datagram_size=1400,
        max_chunks=1 << 20,
        max_windows=1,
        session=7,
    )
    ch.counter = counter
    return ch.seal(kind, body, origin, step, index, count)


datagram = st.one_of(
    st.binary(max_size=300),
    st.builds(
        forged,
        st.integers(1, 15),
        st.integers(0, 3) | st.just(RELAY_ID),
        st.integers(0, 2),
        st.integers(0, 3),
        st.integers(0, 6),
        st.integers(0, 3),
        st.integers(1, 4),
        st.binary(max_size=200) | st.sampled_from([b"\x92\x01\x02", b"\x91\xa1x", b"\x90", JOIN_BODY, UPDATE_BODY]),
        st.sampled_from([42, 43]),
        st.sampled_from([KEY, b"X" * 32]),
        st.integers(0, 40),
    ),
)


def relay_invariants(relay: RelayCore, n_in: int) -> None:
    c = relay.counters()
    assert c.get("datagrams_in", 0) == n_in
    assert relay.att.reasm.nbytes <= relay.att.reasm.max_bytes and len(relay.att.reasm) <= relay.att.reasm.max_messages
    assert relay.params.shape == (N,) and relay.params.dtype == np.float32
    assert relay.complete_through >= relay.att.cursor.start_step - 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(datagram, max_size=30))
def test_relay_core_survives_any_datagrams(datagrams):
    relay = RelayCore(np.zeros(N, np.float32), W, KEY, 42, now=0.0, **TOY)
    for i, d in enumerate(datagrams):
        relay.receive_datagram(d, ("127.0.0.1", 1000 + i % 3), now=i * 0.01)
        relay.handle_timer(i * 0.01 + 0.005)
        relay.datagrams_to_send()
        while relay.next_event() is not None:
            pass
    relay_invariants(relay, len(datagrams))
    assert relay.counts["applied"] <= relay.counts["updates_in"]
    assert np.count_nonzero(relay.params) <= 1  # only the one valid toy update can touch it


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(datagram, max_size=30))
def test_peer_core_survives_any_datagrams(datagrams):
    peer = PeerCore(1, W, 0, KEY, 42, N, now=0.0)
    peer.join(0.0)
    for i, d in enumerate(datagrams):
        peer.receive_datagram(d, ("127.0.0.1", 1), now=i * 0.01)
        peer.handle_timer(i * 0.01 + 0.005)
        peer.datagrams_to_send()
        peer.pop_ready()
    assert peer.counters()["datagrams_in"] == len(datagrams)
    assert peer.inbound.reasm.nbytes <= peer.inbound.reasm.max_bytes
    if peer.inbound.cursor is not None:
        assert peer.complete_through >= peer.inbound.cursor.start_step - 1


def test_forged_and_invalid_updates_are_never_applied():
    """Sealed with the real key but carrying out-of-range indices: refused before the log, rank cut."""
    from transport_util import toy_encode

    relay = RelayCore(np.zeros(N, np.float32), 1, KEY, 42, now=0.0, **TOY)
    join = forged(wire.Kind.JOIN, 0, 0, 0, 0, 0, 1, wire.encode_control(Join(N, 1))[1])
    relay.receive_datagram(join, "a", 0.0)
    bad = wire.encode_update_body(toy_encode(1.0, [N + 1]), None)
    relay.receive_datagram(forged(wire.Kind.UPDATE, 0, 0, 0, 0, 0, 1, bad, counter=1), "a", 0.1)
    assert relay.counts["applied"] == 0 and relay.chan.drops["bad_update"] == 1
    assert relay.att.ranks[0].ended.gone and np.all(relay.params == 0)
