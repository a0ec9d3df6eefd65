"""Shared helpers for the transport tests: a tiny Strom-like codec and an in-memory lossy link.

The toy codec (float32 τ, then int32 signed 1-based indices, "add ±τ at |i|-1") stands in for
gradshare.encoding in the core tests so they exercise the transport alone; it validates every index.
`exchange` runs ranks as threads against a real relay over loopback sockets.
"""

from __future__ import annotations

import heapq
import random
import struct
import threading
import time

import numpy as np

from gradshare.errors import DecodeError
from gradshare.transport import Peer
from gradshare.transport.protocol.step_meta import StepMeta


def toy_encode(tau: float, signed_indices) -> bytes:
    idx = np.asarray(signed_indices, dtype=np.int32)
    return struct.pack("<f", tau) + idx.tobytes()


def toy_decode(payload: bytes, n_params: int):
    if len(payload) < 4 or (len(payload) - 4) % 4:
        raise DecodeError(f"toy payload of {len(payload)} bytes")
    (tau,) = struct.unpack_from("<f", payload)
    idx = np.frombuffer(payload, dtype=np.int32, offset=4)
    if idx.size and (np.any(idx == 0) or np.abs(idx.astype(np.int64)).max() > n_params):
        raise DecodeError("toy index out of range")
    return np.float32(tau), idx


def toy_apply(decoded, params: np.ndarray) -> None:
    tau, idx = decoded
    for i in idx:  # sequential: repeated indices add up in order, like the real one
        params[abs(int(i)) - 1] += tau if i > 0 else -tau


def toy_apply_payload(payload: bytes, params: np.ndarray) -> None:
    toy_apply(toy_decode(payload, params.size), params)


TOY = dict(decode_update=toy_decode, apply_update=toy_apply)


def random_update(rng: np.random.Generator, n_params: int, n_entries: int) -> bytes:
    idx = rng.integers(1, n_params + 1, size=n_entries) * rng.choice([-1, 1], size=n_entries)
    return toy_encode(float(rng.choice([0.01, 0.125, 0.5])), idx)


class Link:
    """Seeded in-memory network: each datagram is dropped, duplicated, and delayed (reordering)."""

    def __init__(self, seed: int, loss: float = 0.0, dup: float = 0.0, max_delay: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.loss, self.dup, self.max_delay = loss, dup, max_delay
        self._q: list = []
        self._n = 0
        self.sent = self.dropped = 0

    def send(self, data: bytes, dst, src, now: float) -> None:
        self.sent += 1
        copies = 2 if self.rng.random() < self.dup else 1
        for _ in range(copies):
            if self.rng.random() < self.loss:
                self.dropped += 1
                continue
            self._n += 1
            heapq.heappush(self._q, (now + self.rng.random() * self.max_delay, self._n, data, dst, src))

    def due(self, now: float):
        while self._q and self._q[0][0] <= now:
            _, _, data, dst, src = heapq.heappop(self._q)
            yield data, dst, src

    def next_time(self) -> float | None:
        return self._q[0][0] if self._q else None


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition()`` (a shell's public accessors) until it is true; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(0.01)


N = 2000


def exchange(
    relay,
    key,
    W,
    steps,
    rng,
    peer_kwargs=None,
    entries=(3, 900),
    staleness=1,
    address=None,
    world_size=None,
    make=random_update,
    apply=toy_apply_payload,
    wait=20.0,
):
    """Ranks 0..W-1 (threads) send `steps` updates each (to `address`, default the relay's) in a job of
    `world_size` (default W) ranks; returns each peer's applied params and log. ``make(rng, n, entries)``
    and ``apply(payload, params)``: the codec (default the toy one). ``wait``: how long a peer waits to join
    and for a step of the log (a thread for its rank, the relay for every rank's FINISHED) before the exchange
    fails."""
    peers = [
        Peer(address or relay.address, r, world_size or W, 0, key, 9, N, timeout=wait, **(peer_kwargs or {}))
        for r in range(W)
    ]
    params = [np.zeros(N, np.float32) for _ in range(W)]
    logs: list[list] = [[] for _ in range(W)]
    sent = {}
    errors = []
    payloads = {(t, r): make(rng, N, int(rng.choice(entries))) for t in range(steps) for r in range(W)}

    def work(r):
        try:
            p = peers[r]
            p.join(wait)
            for t in range(steps):
                if t - 1 - staleness >= 0:
                    for u in p.receive(until_step=t - 1 - staleness, timeout=wait):
                        logs[r].append((u.step, u.sender))
                        apply(u.payload, params[r])
                p.send_update(t, payloads[(t, r)], StepMeta(loss=1.0 / (t + 1)))
                sent[(t, r)] = payloads[(t, r)]
            p.finish(steps - 1)
            for u in p.receive(until_step=steps - 1, timeout=wait):
                logs[r].append((u.step, u.sender))
                apply(u.payload, params[r])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * wait)
        assert not errors, errors
        relay.wait_finished(wait)
    finally:
        counters = [p.counters() for p in peers]
        for p in peers:
            p.close()
    return params, logs, sorted(payloads), counters
