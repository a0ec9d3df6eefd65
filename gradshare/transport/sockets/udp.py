"""Socket plumbing shared by the relay and peer shells: bind, drain, send (the only place with sockets)."""

from __future__ import annotations

import errno
import ipaddress
import select
import socket
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, cast

from gradshare.transport.protocol.events import Address

BUFFER_BYTES = 8 << 20  # ask for 8 MiB socket buffers (the kernel caps at net.core.[rw]mem_max)
RECV_BYTES = 65536
SEND_RETRY_WAIT = 0.01
# A socket address as recvfrom gives it: (host, port), or (host, port, flowinfo, scope_id) for IPv6
SockAddr = tuple[str | int, ...]

# UDP segmentation offload (Linux; the option numbers are linux/udp.h's, which Python 3.11 does not name).
# Why (N = 32 latency): a rank's update is ~12 datagrams of 1.4 kB, and a system call per
# datagram was a quarter of the relay thread's time. A run of datagrams to one address goes out as one
# GSO buffer (one call), and a socket with UDP_GRO reads such a buffer back in one call with its segment
# size. On loopback the buffer is never cut; through a NIC the kernel or the card cuts it into the same
# datagrams on the wire (each still <= the datagram size), and a receiver without GRO gets them one by
# one. Every segment is one sealed datagram as before: the cores see nothing of this.
OFFLOAD = sys.platform.startswith("linux")  # sockets opened from now on use it (a benchmark turns it off)
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
GSO_MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS before Linux 6.x (128 since)
GSO_MAX_BYTES = 65000  # one IPv4 packet's payload is at most 65,507 bytes
GRO_CMSG_BYTES = socket.CMSG_SPACE(4)  # the kernel reports the segment size as an int
# an EIO (no checksum offload), EINVAL or EMSGSIZE (a segment larger than the path MTU) refuses GSO: that
# socket sends one datagram a call from then on
_GSO_REFUSED = frozenset({errno.EIO, errno.EINVAL, errno.EMSGSIZE, errno.ENOPROTOOPT, errno.EOPNOTSUPP})
_gso: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # sockets that send runs as one GSO buffer
_gro: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # sockets whose reads may hold several datagrams


def offloads(sock: socket.socket) -> tuple[bool, bool]:
    """(GSO, GRO) of a socket open_udp opened: whether it sends a run as one GSO buffer (until the kernel
    refuses one) and whether one read may hold several datagrams."""
    return sock in _gso, sock in _gro


def open_udp(host: str, port: int, what: str) -> socket.socket:
    """A non-blocking UDP socket bound to (host, port) with large buffers; OSError names the address."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"{what}: cannot resolve bind address {host!r}: {exc}") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
            except OSError:
                pass  # a smaller buffer still works; drops are repaired by NAKs
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    exc.errno,
                    f"{what}: UDP port {port} on {host or '*'} is already in use "
                    f"(choose another port, or 0 for an ephemeral one)",
                ) from None
            raise OSError(exc.errno, f"{what}: cannot bind UDP {host or '*'}:{port}: {exc.strerror}") from None
        sock.setblocking(False)
        if OFFLOAD:
            _gso.add(sock)
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                _gro.add(sock)
            except OSError:
                pass  # a kernel before 5.0: the datagrams come one by one
        return sock
    except BaseException:
        sock.close()
        raise


def local_bind_for(relay_host: str) -> str:
    """Bind peers to loopback when the relay is on loopback (traffic never leaves the host), else all."""
    try:
        ip = ipaddress.ip_address(relay_host)
    except ValueError:
        ip = ipaddress.ip_address(socket.getaddrinfo(relay_host, None, type=socket.SOCK_DGRAM)[0][4][0])
    if ip.is_loopback:
        return str(ip)
    return "::" if ip.version == 6 else "0.0.0.0"


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    r, _, _ = select.select([sock], [], [], max(timeout, 0.0))
    return bool(r)


class _Timed(Protocol):
    def next_timer(self) -> float: ...


def wait_for_work(sock: socket.socket, lock: threading.Lock, core: _Timed, max_wait: float) -> None:
    """Sleep until a datagram arrives or the core's timer is due (at most ``max_wait`` s)."""
    with lock:
        wait = core.next_timer() - time.monotonic()
    if wait > 0:
        wait_readable(sock, min(wait, max_wait))


def received(sock: socket.socket, drops: Counter[str], limit: int) -> Iterator[tuple[list[bytes], SockAddr]]:
    """Yield the datagrams already waiting on a non-blocking socket, one read at a time, as (datagrams,
    sender), reading at most ``limit`` datagrams. A read holds one datagram, or with GRO a run of them
    from one sender: the buffer is cut at the segment size the kernel reports (the last may be shorter)."""
    split = sock in _gro
    n = 0
    while n < limit:
        try:
            if split:
                data, anc, _, addr = sock.recvmsg(RECV_BYTES, GRO_CMSG_BYTES)
            else:
                data, addr = sock.recvfrom(RECV_BYTES)
                anc = None
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # e.g. ICMP errors surfaced on some platforms
            drops["recv_error"] += 1
            n += 1
            continue
        size = _segment_size(anc) if anc else 0
        if 0 < size < len(data):
            run = [data[i : i + size] for i in range(0, len(data), size)]
        else:
            run = [data]
        n += len(run)
        yield run, addr


def _segment_size(anc: list[tuple[int, int, bytes]]) -> int:
    for level, kind, value in anc:
        if level == SOL_UDP and kind == UDP_GRO:
            return int.from_bytes(value[:4], sys.byteorder)
    return 0


def send_all(sock: socket.socket, datagrams: Iterable[tuple[bytes, Address]], drops: Counter[str]) -> None:
    """Send (bytes, addr) pairs in order; a run of them to one address goes as one GSO buffer where the
    socket may. A full send buffer waits briefly once, then the datagrams are dropped and counted (the
    protocol repairs them: ACK/NAK)."""
    # The cast, once per batch: a UDP shell hands its core only the socket addresses received() gave it,
    # so those are what the core's datagrams carry back.
    items = list(cast("Iterable[tuple[bytes, SockAddr]]", datagrams))
    i = 0
    while i < len(items):
        data, addr = items[i]
        end = run_end(items, i) if sock in _gso else i + 1
        if end - i > 1 and _send_segments(sock, [d for d, _ in items[i:end]], len(data), addr, drops):
            i = end
            continue
        for d, _ in items[i:end]:
            _send_one(sock, d, addr, drops)
        i = end


def run_end(items: list[tuple[bytes, SockAddr]], i: int) -> int:
    """The end of the GSO run from ``items[i]``: to the same address, each of its size but the last (which
    may be shorter), at most GSO_MAX_SEGMENTS and GSO_MAX_BYTES."""
    data, addr = items[i]
    size = total = len(data)
    j = i + 1
    while j < len(items) and j - i < GSO_MAX_SEGMENTS:
        d, a = items[j]
        if a != addr or len(d) > size or total + len(d) > GSO_MAX_BYTES:
            break
        total += len(d)
        j += 1
        if len(d) < size:
            break
    return j


def _send_segments(sock: socket.socket, segments: list[bytes], size: int, addr: SockAddr, drops: Counter[str]) -> bool:
    """One GSO send of ``segments`` (each ``size`` bytes but the last); False if the kernel refused GSO
    (nothing was sent; the socket no longer tries it)."""
    anc = [(SOL_UDP, UDP_SEGMENT, size.to_bytes(2, sys.byteorder))]
    exc = _send(sock, lambda: sock.sendmsg(segments, anc, 0, addr), len(segments), drops)
    if exc is not None and exc.errno in _GSO_REFUSED:
        _gso.discard(sock)
        return False
    if exc is not None:
        drops["send_error"] += len(segments)
    return True


def _send_one(sock: socket.socket, data: bytes, addr: SockAddr, drops: Counter[str]) -> None:
    if _send(sock, lambda: sock.sendto(data, addr), 1, drops) is not None:
        drops["send_error"] += 1


def _send(sock: socket.socket, send: Callable[[], object], count: int, drops: Counter[str]) -> OSError | None:
    """``send()``, once more after a brief wait for room if the send buffer is full; still full, its
    ``count`` datagrams are dropped and counted. Any other error is returned for the caller to judge."""
    for attempt in range(2):
        if attempt:
            select.select([], [sock], [], SEND_RETRY_WAIT)
        try:
            send()
            return None
        except BlockingIOError:
            continue
        except OSError as exc:
            return exc
    drops["send_buffer_full"] += count
    return None
