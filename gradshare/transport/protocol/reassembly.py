"""Chunk reassembly with bounded memory (the shape of aioquic's ``quic/stream.py`` receive buffer).

Partial messages are limited in number and in bytes; a chunk that would exceed a limit is refused (the
sender retransmits later, so refusing is safe and keeps memory bounded). Partials idle for too long expire.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Partial:
    __slots__ = ("count", "chunks", "raw", "nbytes", "held", "last_seen", "naks")

    def __init__(self, count: int, now: float) -> None:
        self.count = count
        self.chunks: dict[int, bytes] = {}
        self.raw: dict[int, bytes] = {}  # the sealed datagrams, when the owner keeps them
        self.nbytes = 0  # message bytes so far
        self.held = 0  # what it holds against the reassembler's max_bytes
        self.last_seen = now
        self.naks = 0  # NAKs sent for it so far (the receiver backs off between them)

    def missing(self, limit: int) -> tuple[int, ...]:
        out = []
        for i in range(self.count):
            if i not in self.chunks:
                out.append(i)
                if len(out) >= limit:
                    break
        return tuple(out)


class LateAllowance:
    """How long a missing chunk may be late before the receiver NAKs it, learned per sender.

    It starts at ``floor`` (the reorder allowance). When a chunk we NAKed arrives twice (the original was
    late, not lost: the NAK was spurious) it grows by half, up to ``cap``; every update that completes
    without a NAK shrinks it by 1 % towards ``floor``. A loaded machine (a sender descheduled between its
    sendto calls) thus stops triggering retransmits of data that is merely late, and a lossy but idle one
    keeps repairing fast (the idea of RFC 4015's reordering-aware timers, in the small)."""

    __slots__ = ("floor", "cap", "value", "_nakked", "_remember")

    def __init__(self, floor: float, cap: float = 0.05, remember: int = 256) -> None:
        self.floor, self.cap, self.value = floor, max(cap, floor), floor
        self._nakked: dict[Hashable, None] = {}  # recently NAKed keys, oldest first, at most `remember`
        self._remember = remember

    def nakked(self, key: Hashable) -> None:
        self._nakked[key] = None
        if len(self._nakked) > self._remember:
            del self._nakked[next(iter(self._nakked))]

    def arrived_twice(self, key: Hashable) -> None:
        if key in self._nakked:
            del self._nakked[key]
            self.value = min(self.cap, self.value * 1.5)

    def completed(self, key: Hashable) -> None:
        if key not in self._nakked:
            self.value = max(self.floor, self.value * 0.99)


class Reassembler(Generic[K]):
    """Collects chunks per key; ``add`` returns the whole message once its last chunk arrives.

    With ``keep_raw`` it also keeps each chunk's sealed datagram (``add(..., raw=)``, counted against
    ``max_bytes``); after a completing ``add``, ``last_raw`` holds them in chunk order. The relay forwards
    those bytes unchanged instead of sealing every chunk again."""

    def __init__(self, max_messages: int, max_bytes: int, max_message_bytes: int, keep_raw: bool = False) -> None:
        for name, v in (
            ("max_messages", max_messages),
            ("max_bytes", max_bytes),
            ("max_message_bytes", max_message_bytes),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1 (got {v})")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_message_bytes = max_message_bytes
        self.keep_raw = keep_raw
        self.partials: dict[K, Partial] = {}
        self.nbytes = 0
        self.last_raw: tuple[bytes, ...] = ()

    def add(
        self, key: K, index: int, count: int, data: bytes, now: float, raw: bytes = b""
    ) -> tuple[bytes | None, str | None]:
        """(message, None) when complete; (None, None) when stored/duplicate; (None, reason) when refused."""
        p = self.partials.get(key)
        if p is None:
            if count == 1:  # the common small message: no bookkeeping at all
                if len(data) > self.max_message_bytes:
                    return None, "message_too_large"
                self.last_raw = (raw,)
                return data, None
            if len(self.partials) >= self.max_messages:
                return None, "reassembly_full"
            p = self.partials[key] = Partial(count, now)
        elif p.count != count:
            return None, "chunk_count_mismatch"
        if index in p.chunks:
            p.last_seen = now
            return None, "duplicate_chunk"
        if p.nbytes + len(data) > self.max_message_bytes:
            self._drop(key)
            return None, "message_too_large"
        size = len(data) + (len(raw) if self.keep_raw else 0)
        if self.nbytes + size > self.max_bytes:
            if not p.chunks:
                self._drop(key)
            return None, "reassembly_full"
        p.chunks[index] = data
        if self.keep_raw:
            p.raw[index] = raw
        p.nbytes += len(data)
        p.held += size
        p.last_seen = now
        p.naks = 0  # progress: a later NAK need not back off
        self.nbytes += size
        if len(p.chunks) < p.count:
            return None, None
        self._drop(key)
        if self.keep_raw:
            self.last_raw = tuple(p.raw[i] for i in range(p.count))
        return b"".join(p.chunks[i] for i in range(p.count)), None

    def _drop(self, key: K) -> None:
        p = self.partials.pop(key, None)
        if p is not None:
            self.nbytes -= p.held

    def discard(self, key: K) -> None:
        self._drop(key)

    def discard_where(self, pred: Callable[[K], bool]) -> int:
        keys = [k for k in self.partials if pred(k)]
        for k in keys:
            self._drop(k)
        return len(keys)

    def stale(self, now: float, idle: float) -> list[tuple[K, Partial]]:
        """Partials with no new chunk for ``idle`` seconds (candidates for a NAK)."""
        return [(k, p) for k, p in self.partials.items() if now - p.last_seen >= idle]

    def expire(self, now: float, max_age: float) -> int:
        """Forget partials idle for ``max_age`` seconds; returns how many."""
        return self.discard_where(lambda k: now - self.partials[k].last_seen >= max_age)

    def __contains__(self, key: K) -> bool:
        return key in self.partials

    def __len__(self) -> int:
        return len(self.partials)
