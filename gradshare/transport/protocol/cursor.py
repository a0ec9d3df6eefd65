"""The apply-log cursor: which (step, rank) comes next in canonical order (docs/design.md, Consistency).

A message is due only when every message before it in (step, rank) order is applied or known not to exist:
its rank ended (FINISHED or declared gone) at an earlier step. Shared by the relay and every peer so that
all of them walk the same log the same way.
"""

from __future__ import annotations


class LogCursor:
    __slots__ = ("world_size", "step", "rank", "ends", "complete_through", "start_step")

    def __init__(self, world_size: int, start_step: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1 (got {world_size})")
        self.world_size = world_size
        self.start_step = start_step
        self.step = start_step
        self.rank = 0
        self.ends: dict[int, int] = {}  # rank -> last step that exists
        self.complete_through = start_step - 1

    def end(self, rank: int, last_step: int) -> None:
        self.ends[rank] = last_step

    def finished(self) -> bool:
        """Every rank ended and the cursor is past the last message of the log."""
        return len(self.ends) == self.world_size and self.step > max(self.ends.values())

    def exists(self, step: int, rank: int) -> bool | None:
        """False if (step, rank) is known not to exist, True if it must exist, None if not known yet."""
        end = self.ends.get(rank)
        if end is not None:
            return step <= end
        return None

    def next_key(self) -> tuple[int, int] | None:
        """The message that must come next, skipping ones known not to exist; None when the log is done."""
        while True:
            if self.finished():
                self.complete_through = max(self.complete_through, self.step - 1)
                return None
            end = self.ends.get(self.rank)
            if end is not None and self.step > end:
                self.advance()
                continue
            return self.step, self.rank

    def advance(self) -> None:
        """Move past the current message (it was applied, or does not exist)."""
        self.rank += 1
        if self.rank == self.world_size:
            self.rank = 0
            self.complete_through = self.step
            self.step += 1

    def done_before(self, step: int, rank: int) -> bool:
        """True if (step, rank) is behind the cursor (already applied or skipped)."""
        return (step, rank) < (self.step, self.rank)
