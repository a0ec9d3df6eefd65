"""Socket plumbing shared by the relay and peer shells: bind, drain, send (the only place with sockets)."""

from __future__ import annotations

import errno
import ipaddress
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Protocol, cast

from gradshare.transport.events import Address

BUFFER_BYTES = 8 << 20          # ask for 8 MiB socket buffers (the kernel caps at net.core.[rw]mem_max)
RECV_BYTES = 65536
SEND_RETRY_WAIT = 0.01
# A socket address as recvfrom gives it: (host, port), or (host, port, flowinfo, scope_id) for IPv6
SockAddr = tuple[str | int, ...]


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
                pass                      # a smaller buffer still works; drops are repaired by NAKs
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"{what}: UDP port {port} on {host or '*'} is already in use "
                                         f"(choose another port, or 0 for an ephemeral one)") from None
            raise OSError(exc.errno, f"{what}: cannot bind UDP {host or '*'}:{port}: {exc.strerror}") from None
        sock.setblocking(False)
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


def received(sock: socket.socket, drops: Counter[str], limit: int) -> Iterator[tuple[bytes, SockAddr]]:
    """Yield up to ``limit`` datagrams already waiting on a non-blocking socket."""
    for _ in range(limit):
        try:
            data, addr = sock.recvfrom(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:          # e.g. ICMP errors surfaced on some platforms
            drops["recv_error"] += 1
            continue
        yield data, addr


def send_all(sock: socket.socket, datagrams: Iterable[tuple[bytes, Address]], drops: Counter[str]) -> None:
    """Send (bytes, addr) pairs; a full send buffer waits briefly once, then the datagram is dropped and
    counted (the protocol repairs it: ACK/NAK)."""
    # The cast, once per batch: a UDP shell hands its core only the socket addresses received() gave it,
    # so those are what the core's datagrams carry back.
    for data, addr in cast("Iterable[tuple[bytes, SockAddr]]", datagrams):
        try:
            sock.sendto(data, addr)
        except BlockingIOError:
            select.select([], [sock], [], SEND_RETRY_WAIT)
            try:
                sock.sendto(data, addr)
            except BlockingIOError:
                drops["send_buffer_full"] += 1
            except OSError:
                drops["send_error"] += 1
        except OSError:
            drops["send_error"] += 1
