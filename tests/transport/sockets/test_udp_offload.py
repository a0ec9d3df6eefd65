"""UDP segmentation offload in the socket shells (udp.py): a run of datagrams to one address goes out as
one GSO buffer and comes back, through `received`, as the same datagrams in the same order; a socket
without GRO gets them one by one; a kernel that refuses GSO gets them one call each. Loopback only."""

from __future__ import annotations

import errno
import socket
import sys
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.transport.sockets import udp

LINUX = sys.platform.startswith("linux")


def _drain(sock: socket.socket, expect: int, timeout: float = 5.0) -> tuple[list[bytes], int]:
    """(datagrams, reads) once ``expect`` datagrams came in (bounded wait)."""
    got: list[bytes] = []
    reads = 0
    deadline = time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        udp.wait_readable(sock, 0.05)
        for run, _ in udp.received(sock, Counter(), 512):
            got += run
            reads += 1
    return got, reads


def _datagrams(sizes: list[int], tag: int = 0) -> list[bytes]:
    return [bytes([(tag + i) % 256]) * n for i, n in enumerate(sizes)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([1400, 1400, 1400, 900, 20, 40_000]), st.sampled_from(["a", "b"])), max_size=150)
)
def test_runs_partition_the_datagrams_into_valid_gso_buffers(items):
    datagrams = [(b"x" * n, addr) for n, addr in items]
    i = 0
    while i < len(datagrams):
        end = udp.run_end(datagrams, i)  # type: ignore[arg-type]
        run = datagrams[i:end]
        size = len(run[0][0])
        assert end > i and len(run) <= udp.GSO_MAX_SEGMENTS
        assert all(a == run[0][1] for _, a in run)  # one address
        assert all(len(d) == size for d, _ in run[:-1]) and len(run[-1][0]) <= size  # the last may be short
        assert len(run) == 1 or sum(len(d) for d, _ in run) <= udp.GSO_MAX_BYTES
        if end < len(datagrams) and len(run[-1][0]) == size and len(run) < udp.GSO_MAX_SEGMENTS:
            d, a = datagrams[end]  # the run could not take the next one
            assert a != run[0][1] or len(d) > size or sum(len(x) for x, _ in run) + len(d) > udp.GSO_MAX_BYTES
        i = end


@pytest.fixture
def pair():
    send = udp.open_udp("127.0.0.1", 0, "test sender")
    recv = udp.open_udp("127.0.0.1", 0, "test receiver")
    yield send, recv
    send.close()
    recv.close()


def test_a_gso_run_reads_back_as_the_same_datagrams_in_fewer_reads(pair):
    send, recv = pair
    assert not LINUX or (udp.offloads(send)[0] and udp.offloads(recv)[1])  # Linux >= 5.0 has both
    to = recv.getsockname()
    sizes = [1400] * 11 + [700] + [1400] * 3 + [60] + [1400] * 70 + [1400, 90]
    sent = _datagrams(sizes)
    drops: Counter[str] = Counter()
    udp.send_all(send, [(d, to) for d in sent], drops)
    got, reads = _drain(recv, len(sent))
    assert got == sent and not drops
    if LINUX:
        assert reads == 4  # [12], [3 + 60], [46 of the 70: 65,000 bytes], [24 + 1400 + 90] of 88


def test_a_socket_without_gro_gets_each_datagram_alone(pair):
    send, _ = pair
    plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        plain.bind(("127.0.0.1", 0))
        plain.setblocking(False)
        sent = _datagrams([1400] * 20 + [300], tag=7)
        udp.send_all(send, [(d, plain.getsockname()) for d in sent], Counter())
        got, reads = _drain(plain, len(sent))
        assert got == sent and reads == len(sent)  # the kernel cut the GSO buffer on delivery
    finally:
        plain.close()


class _Refusing(socket.socket):
    """A socket whose kernel refuses GSO (as without checksum offload: EIO)."""

    calls = 0

    def sendmsg(self, *args, **kwargs):  # type: ignore[override]
        type(self).calls += 1
        raise OSError(errno.EIO, "no GSO here")


def test_a_refused_gso_send_falls_back_to_one_datagram_a_call_and_stays_off(pair, monkeypatch):
    _, recv = pair
    with monkeypatch.context() as m:  # open_udp opens a _Refusing socket with GSO on, on any platform
        m.setattr(socket, "socket", _Refusing)
        m.setattr(udp, "OFFLOAD", True)
        send = udp.open_udp("127.0.0.1", 0, "test sender")
    try:
        assert isinstance(send, _Refusing) and udp.offloads(send)[0]
        to = recv.getsockname()
        first = _datagrams([1400] * 5, tag=1)
        drops: Counter[str] = Counter()
        udp.send_all(send, [(d, to) for d in first], drops)
        assert not udp.offloads(send)[0] and _Refusing.calls == 1
        later = _datagrams([1400] * 5, tag=9)
        udp.send_all(send, [(d, to) for d in later], drops)
        assert _Refusing.calls == 1  # not asked again
        got, _ = _drain(recv, 10)
        assert got == first + later and not drops  # nothing lost
    finally:
        send.close()


def test_offload_off_opens_plain_sockets(monkeypatch):
    monkeypatch.setattr(udp, "OFFLOAD", False)
    s = udp.open_udp("127.0.0.1", 0, "test")
    try:
        assert udp.offloads(s) == (False, False)
    finally:
        s.close()
