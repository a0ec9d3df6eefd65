"""A loopback UDP proxy that drops, duplicates, reorders and delays datagrams (seeded), for tests and the
transport benchmark (netem is not available on this kernel; docs/design.md, Measuring).

    with FaultProxy(relay.address, loss=0.05, duplicate=0.01, reorder=0.05, delay=0.002, seed=1) as proxy:
        Peer(proxy.address, ...)        # peers talk to the proxy; the relay sees one address per peer

Each client gets its own upstream socket, so the relay still tells peers apart. Faults apply in both
directions. Everything is bounded: clients, queued datagrams; overflow is counted, never silent.
"""

from __future__ import annotations

import heapq
import random
import select
import socket
import threading
import time
from collections import Counter

from gradshare.transport.sockets.udp import SockAddr


class FaultProxy:
    def __init__(
        self,
        target: tuple[str, int],
        *,
        loss: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        delay: float = 0.0,
        seed: int = 0,
        bind: str = "127.0.0.1",
        max_clients: int = 256,
        max_queued: int = 200_000,
    ) -> None:
        for name, v in (("loss", loss), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1) (got {v})")
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds (got {delay})")
        self.target = target
        self.loss, self.duplicate, self.reorder, self.delay = loss, duplicate, reorder, delay
        self.rng = random.Random(seed)
        self.max_clients, self.max_queued = max_clients, max_queued
        self.stats: Counter[str] = Counter()
        self._front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._up: dict[SockAddr, socket.socket] = {}  # client address -> upstream socket
        self._client_of: dict[socket.socket, SockAddr] = {}
        self._queue: list[tuple[float, int, socket.socket, bytes, SockAddr]] = []  # (due, seq, sock, data, addr)
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            for s in (self._front,):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            self._front.bind((bind, 0))
            self._front.setblocking(False)
        except BaseException:
            self._front.close()
            raise
        self.address = self._front.getsockname()

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="gradshare-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> FaultProxy:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for s in list(self._up.values()) + [self._front]:
            s.close()

    # --- internals ----------------------------------------------------------------------------------
    def _upstream(self, client: SockAddr) -> socket.socket | None:
        s = self._up.get(client)
        if s is None:
            if len(self._up) >= self.max_clients:
                return None
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            s.bind((self.address[0], 0))
            s.setblocking(False)
            self._up[client] = s
            self._client_of[s] = client
        return s

    def _schedule(self, now: float, sock: socket.socket, data: bytes, addr: SockAddr) -> None:
        """Apply the faults to one datagram and queue what survives."""
        rng = self.rng
        if rng.random() < self.loss:
            self.stats["dropped"] += 1
            return
        copies = 2 if rng.random() < self.duplicate else 1
        if copies == 2:
            self.stats["duplicated"] += 1
        for _ in range(copies):
            due = now + (rng.random() * self.delay if self.delay else 0.0)
            if rng.random() < self.reorder:
                due += self.delay + 0.001 + rng.random() * 0.002  # held back: later ones overtake it
                self.stats["reordered"] += 1
            if len(self._queue) >= self.max_queued:
                self.stats["queue_full"] += 1
                continue
            self._seq += 1
            heapq.heappush(self._queue, (due, self._seq, sock, data, addr))

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            while self._queue and self._queue[0][0] <= now:
                _, _, sock, data, addr = heapq.heappop(self._queue)
                try:
                    sock.sendto(data, addr)
                    self.stats["forwarded"] += 1
                except OSError:
                    self.stats["send_error"] += 1
            wait = 0.01 if not self._queue else max(0.0, min(0.01, self._queue[0][0] - now))
            socks = [self._front] + list(self._up.values())
            readable, _, _ = select.select(socks, [], [], wait)
            now = time.monotonic()
            for s in readable:
                for _ in range(256):
                    try:
                        data, addr = s.recvfrom(65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        self.stats["recv_error"] += 1
                        break
                    if s is self._front:
                        up = self._upstream(addr)
                        if up is None:
                            self.stats["too_many_clients"] += 1
                            continue
                        self._schedule(now, up, data, self.target)
                    else:
                        self._schedule(now, self._front, data, self._client_of[s])
