"""A set of integers kept as sorted half-open ranges (the shape of aioquic's ``quic/rangeset.py``).

Used for the steps a sender has delivered to the relay, the chunks of a snapshot a peer holds, and the
NAK lists built from their gaps. Memory is proportional to the number of gaps, not to the values.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class RangeSet:
    """Sorted, non-overlapping, non-adjacent ``[start, stop)`` ranges."""

    __slots__ = ("_starts", "_stops")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []

    def add(self, start: int, stop: int | None = None) -> bool:
        """Add ``[start, stop)`` (one value when ``stop`` is None). Returns True if anything was new."""
        if stop is None:
            stop = start + 1
        if stop <= start:
            raise ValueError(f"stop ({stop}) must be greater than start ({start})")
        if self.covers(start, stop):
            return False
        # every range that overlaps or touches [start, stop) merges into one
        lo = bisect.bisect_left(self._stops, start)
        hi = bisect.bisect_right(self._starts, stop)
        if lo < hi:
            start = min(start, self._starts[lo])
            stop = max(stop, self._stops[hi - 1])
        self._starts[lo:hi] = [start]
        self._stops[lo:hi] = [stop]
        return True

    def __contains__(self, value: int) -> bool:
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and value < self._stops[i]

    def covers(self, start: int, stop: int) -> bool:
        """True if every value of ``[start, stop)`` is in the set."""
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and stop <= self._stops[i]

    def contiguous_from(self, start: int) -> int:
        """The end of the run beginning at ``start``: the first value >= start that is missing."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and start < self._stops[i]:
            return self._stops[i]
        return start

    def gaps(self, start: int, stop: int, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` missing ranges within ``[start, stop)``, lowest first."""
        out: list[tuple[int, int]] = []
        cur = start
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while cur < stop and len(out) < limit:
            while i < len(self._starts) and self._stops[i] <= cur:
                i += 1
            if i < len(self._starts) and self._starts[i] <= cur:
                cur = self._stops[i]
                continue
            nxt = self._starts[i] if i < len(self._starts) else stop
            end = min(nxt, stop)
            if end > cur:
                out.append((cur, end))
            cur = end
        return out

    def discard_below(self, value: int) -> None:
        """Forget everything below ``value`` (keeps memory bounded as a cursor advances)."""
        i = bisect.bisect_right(self._stops, value)
        del self._starts[:i]
        del self._stops[:i]
        if self._starts and self._starts[0] < value:
            self._starts[0] = value

    def count(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._stops))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._stops))

    def __len__(self) -> int:
        """Number of ranges (not values)."""
        return len(self._starts)

    def __repr__(self) -> str:
        return f"RangeSet({list(self)})"
