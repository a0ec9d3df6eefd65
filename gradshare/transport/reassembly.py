"""Chunk reassembly with bounded memory (the shape of aioquic's ``quic/stream.py`` receive buffer).

Partial messages are limited in number and in bytes; a chunk that would exceed a limit is refused (the
sender retransmits later, so refusing is safe and keeps memory bounded). Partials idle for too long expire.
"""

from __future__ import annotations

from collections.abc import Hashable


class Partial:
    __slots__ = ("count", "chunks", "nbytes", "last_seen", "first_seen", "naks")

    def __init__(self, count: int, now: float) -> None:
        self.count = count
        self.chunks: dict[int, bytes] = {}
        self.nbytes = 0
        self.first_seen = now
        self.last_seen = now
        self.naks = 0              # NAKs sent for it so far (the receiver backs off between them)

    def missing(self, limit: int) -> tuple[int, ...]:
        out = []
        for i in range(self.count):
            if i not in self.chunks:
                out.append(i)
                if len(out) >= limit:
                    break
        return tuple(out)


class Reassembler:
    """Collects chunks per key; ``add`` returns the whole message once its last chunk arrives."""

    def __init__(self, max_messages: int, max_bytes: int, max_message_bytes: int) -> None:
        for name, v in (("max_messages", max_messages), ("max_bytes", max_bytes),
                        ("max_message_bytes", max_message_bytes)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1 (got {v})")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_message_bytes = max_message_bytes
        self.partials: dict[Hashable, Partial] = {}
        self.nbytes = 0

    def add(self, key: Hashable, index: int, count: int, data: bytes, now: float) -> tuple[bytes | None, str | None]:
        """(message, None) when complete; (None, None) when stored/duplicate; (None, reason) when refused."""
        p = self.partials.get(key)
        if p is None:
            if count == 1:   # the common small message: no bookkeeping at all
                return (data if len(data) <= self.max_message_bytes else None,
                        None if len(data) <= self.max_message_bytes else "message_too_large")
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
        if self.nbytes + len(data) > self.max_bytes:
            if not p.chunks:
                self._drop(key)
            return None, "reassembly_full"
        p.chunks[index] = data
        p.nbytes += len(data)
        p.last_seen = now
        p.naks = 0                 # progress: a later NAK need not back off
        self.nbytes += len(data)
        if len(p.chunks) < p.count:
            return None, None
        self._drop(key)
        return b"".join(p.chunks[i] for i in range(p.count)), None

    def _drop(self, key: Hashable) -> None:
        p = self.partials.pop(key, None)
        if p is not None:
            self.nbytes -= p.nbytes

    def discard(self, key: Hashable) -> None:
        self._drop(key)

    def discard_where(self, pred) -> int:
        keys = [k for k in self.partials if pred(k)]
        for k in keys:
            self._drop(k)
        return len(keys)

    def stale(self, now: float, idle: float) -> list[tuple[Hashable, Partial]]:
        """Partials with no new chunk for ``idle`` seconds (candidates for a NAK)."""
        return [(k, p) for k, p in self.partials.items() if now - p.last_seen >= idle]

    def expire(self, now: float, max_age: float) -> int:
        """Forget partials idle for ``max_age`` seconds; returns how many."""
        return self.discard_where(lambda k: now - self.partials[k].last_seen >= max_age)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.partials

    def __len__(self) -> int:
        return len(self.partials)
