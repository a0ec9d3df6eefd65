"""Outstanding sends: kept until acknowledged, re-sent with exponential backoff, RTO from RFC 6298 with
Karn's rule (transport/protocol/peer/outstanding.py)."""

from __future__ import annotations

import pytest

from gradshare.transport.protocol.peer.outstanding import MAX_RTO, Outstanding


def test_rto_follows_rfc6298_and_stays_within_bounds():
    o = Outstanding(16, 1 << 20, min_rto=0.2)
    assert o.rto() == 0.2  # no sample yet: the configured timeout
    o.add(0, b"a", now=0.0)
    o.acked(0, now=1.0)  # first sample: srtt = 1, rttvar = 0.5
    assert (o.srtt, o.rttvar) == (1.0, 0.5) and o.rto() == pytest.approx(3.0)
    o.add(1, b"b", now=1.0)
    o.acked(1, now=1.5)  # rttvar = .75*.5 + .25*.5, srtt = .875 + .0625
    assert o.srtt == pytest.approx(0.9375) and o.rttvar == pytest.approx(0.5)
    o.add(2, b"c", now=2.0)
    o.acked(2, now=2.0 + 100.0)
    assert o.rto() == MAX_RTO and not len(o)


def test_karn_resent_steps_give_no_sample():
    o = Outstanding(16, 1 << 20, min_rto=0.2)
    o.add(0, b"a", now=0.0)
    assert o.due(0.19) == [] and o.due(0.2) == [0]  # timed out: re-sent
    o.acked(0, now=5.0)
    o.add(1, b"b", now=5.0)
    o.repaired(1)  # re-sent on the relay's NAK
    o.acked(1, now=9.0)
    assert o.srtt is None and o.rto() == 0.2 and not len(o)


def test_backoff_doubles_per_try_and_status_acks_a_prefix():
    o = Outstanding(16, 1 << 20, min_rto=1.0)
    for s in range(4):
        o.add(s, bytes([s]), now=0.0)
    times = [t for t in range(0, 200) if 0 in o.due(float(t))]
    assert times == [1, 3, 7, 15, 31, 63, 127, 191]  # 1, 2, 4, ... s apart, capped at 64 s
    o.acked_through(2)
    assert list(o) == [3] and o.get(3) == b"\x03" and o.get(1) is None
    assert set(o.sent_at) == set(o.tries) == {3}  # nothing left behind for acknowledged steps
