"""Retransmit history bounded by entry count and by bytes (oldest evicted first).

The relay keeps every forwarded update here until every live peer has delivered it, so a NAK can be
answered; a peer keeps its own unacknowledged updates. Eviction under pressure is counted by the caller:
a NAK for an evicted entry is answered with an explicit error, never silence (docs/design.md, Transport).

The relay forgets whole steps at once (everything at or below the step every live peer has delivered):
``StepKeys`` gives those keys up in step order, touching only them, so a trim costs what it removes and
not a scan of the whole history on every heartbeat.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from gradshare.errors import LocalProtocolError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
StepKey = tuple[int, ...]  # what StepKeys holds: (step, ...), ordered by step first


class History(Generic[K, V]):
    """``size(entry)`` is what an entry counts against ``max_bytes`` (``len`` of bytes by default; the relay
    stores tuples of datagrams)."""

    # The ignore: ``len`` is the default for entries that are bytes; mypy cannot tie a default to one V,
    # and a History of other entries (the relay's) passes its own size.
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        size: Callable[[V], int] = len,  # type: ignore[assignment]
        by_step: bool = False,
    ) -> None:
        """by_step: keys are ``(step, ...)`` tuples and ``discard_through`` is used (the relay)."""
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries ({max_entries}) and max_bytes ({max_bytes}) must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.size = size
        self._d: OrderedDict[K, V] = OrderedDict()
        self._steps = StepKeys() if by_step else None
        self.nbytes = 0

    def put(self, key: K, data: V) -> list[K]:
        """Store ``data`` under ``key``; returns the keys evicted to make room (oldest first)."""
        if key in self._d:
            self.pop(key)
        self._d[key] = data
        self.nbytes += self.size(data)
        if self._steps is not None:
            self._steps.add(key)  # type: ignore[arg-type]  # by_step promises (step, ...) keys
        evicted = []
        while len(self._d) > 1 and (len(self._d) > self.max_entries or self.nbytes > self.max_bytes):
            k = next(iter(self._d))
            self.pop(k)
            evicted.append(k)
        return evicted

    def get(self, key: K) -> V | None:
        return self._d.get(key)

    def pop(self, key: K) -> V | None:
        v = self._d.pop(key, None)
        if v is not None:
            self.nbytes -= self.size(v)
            if self._steps is not None:
                self._steps.discard(key)  # type: ignore[arg-type]  # by_step promises (step, ...) keys
        return v

    def discard_through(self, step: int) -> int:
        """Drop every entry whose key's step is <= ``step`` (needs ``by_step``); returns how many."""
        if self._steps is None:
            raise LocalProtocolError("discard_through needs a History made with by_step=True")
        keys: list[K] = self._steps.discard_through(step)  # type: ignore[assignment]  # the keys put() gave it
        for k in keys:
            v = self._d.pop(k)
            self.nbytes -= self.size(v)
        return len(keys)

    @property
    def examined(self) -> int:
        """Keys ``discard_through`` has looked at so far (the work a trim costs; tests count it)."""
        return self._steps.examined if self._steps is not None else 0

    @property
    def index_entries(self) -> int:
        """Entries of the step index, removed keys it still holds included (bounded; tests check it)."""
        return self._steps.heap_entries if self._steps is not None else 0

    def discard_where(self, pred: Callable[[K], bool]) -> int:
        keys = [k for k in self._d if pred(k)]
        for k in keys:
            self.pop(k)
        return len(keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._d))


class StepKeys:
    """A set of ``(step, ...)`` keys that gives up every key at or below a step in step order.

    A min-heap beside the set: ``discard_through`` pops only the keys it returns (plus keys removed
    earlier, which the heap still holds: lazy deletion). Those stale heap entries are bounded: when they
    outnumber the live keys the heap is rebuilt from the set (amortised O(1) per removal)."""

    def __init__(self) -> None:
        self._set: set[StepKey] = set()
        self._heap: list[StepKey] = []
        self.examined = 0

    def add(self, key: StepKey) -> None:
        if key not in self._set:
            self._set.add(key)
            heapq.heappush(self._heap, key)

    def discard(self, key: StepKey) -> None:
        self._set.discard(key)
        if len(self._heap) > 2 * len(self._set) + 64:
            self._heap = sorted(self._set)  # a sorted list is a heap

    @property
    def heap_entries(self) -> int:
        """Keys in the heap, removed ones not yet popped included: at most 2·len(self) + 65."""
        return len(self._heap)

    def discard_through(self, step: int) -> list[StepKey]:
        out = []
        heap = self._heap
        while heap and heap[0][0] <= step:
            key = heapq.heappop(heap)
            self.examined += 1
            if key in self._set:
                self._set.remove(key)
                out.append(key)
        return out

    def clear(self) -> None:
        self._set.clear()
        self._heap.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._set

    def __len__(self) -> int:
        return len(self._set)

    def __iter__(self) -> Iterator[StepKey]:
        return iter(list(self._set))
