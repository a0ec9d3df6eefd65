"""Shared helpers for the transport tests: a tiny Strom-like codec and an in-memory lossy link.

The toy codec (float32 τ, then int32 signed 1-based indices, "add ±τ at |i|-1") stands in for
gradshare.encoding in the core tests so they exercise the transport alone; it validates every index.
"""

from __future__ import annotations

import heapq
import random
import struct
import time

import numpy as np

from gradshare.errors import DecodeError


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
    for i in idx:                       # sequential: repeated indices add up in order, like the real one
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
