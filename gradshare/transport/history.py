"""Retransmit history bounded by entry count and by bytes (oldest evicted first).

The relay keeps every forwarded update here until every live peer has delivered it, so a NAK can be
answered; a peer keeps its own unacknowledged updates. Eviction under pressure is counted by the caller:
a NAK for an evicted entry is answered with an explicit error, never silence (docs/design.md, Transport).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any


class History:
    """``size(entry)`` is what an entry counts against ``max_bytes`` (``len`` of bytes by default; the relay
    stores tuples of datagrams)."""

    def __init__(self, max_entries: int, max_bytes: int, size: Callable[[Any], int] = len) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries ({max_entries}) and max_bytes ({max_bytes}) must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.size = size
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self.nbytes = 0

    def put(self, key: Hashable, data: Any) -> list[Hashable]:
        """Store ``data`` under ``key``; returns the keys evicted to make room (oldest first)."""
        if key in self._d:
            self.pop(key)
        self._d[key] = data
        self.nbytes += self.size(data)
        evicted = []
        while len(self._d) > 1 and (len(self._d) > self.max_entries or self.nbytes > self.max_bytes):
            k, v = self._d.popitem(last=False)
            self.nbytes -= self.size(v)
            evicted.append(k)
        return evicted

    def get(self, key: Hashable) -> Any | None:
        return self._d.get(key)

    def pop(self, key: Hashable) -> Any | None:
        v = self._d.pop(key, None)
        if v is not None:
            self.nbytes -= self.size(v)
        return v

    def discard_where(self, pred) -> int:
        keys = [k for k in self._d if pred(k)]
        for k in keys:
            self.pop(k)
        return len(keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._d))
