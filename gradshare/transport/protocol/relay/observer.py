"""The relay core's one seam to the training bookkeeping (docs/design.md, Consistency): the core calls an
observer when an update enters the applied log and when a new attempt cuts the log, and reads back what
the log says about the training (rank 0's notes, the epoch tallies). What it keeps (epoch tallies, rank 0's
stop notes, checkpoints to roll back to) is the trainer's (gradshare/task/tallies.py TrainingLog); the transport
knows nothing of epochs, so its default is ``NullObserver``: every method neutral.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from gradshare.transport.protocol.step_meta import StepMeta

Notes = tuple[tuple[str, float], ...]


class Cut(NamedTuple):
    """Where a new attempt's log starts: after step ``through`` (<= the relay's complete_through), with
    ``notes`` in WELCOME; ``rolled_back``: the observer put the parameters back to ``through``."""

    through: int
    notes: Notes
    rolled_back: bool


class LogObserver(Protocol):
    def applied(self, step: int, rank: int, meta: StepMeta, attempt: int) -> None:
        """Update (step, rank), which carried ``meta``, entered the applied log (canonical order)."""

    def cut(self, complete_through: int, params: NDArray[np.float32]) -> Cut:
        """A new attempt starts; the log holds ``params`` through ``complete_through``. The observer may
        roll ``params`` back in place to an earlier step (a checkpoint) and say so in the Cut."""

    def inherit(self, notes: Notes) -> None:
        """Before the first attempt: ``notes`` as if the log held them before its first step."""

    def notes_at(self, step: int) -> Notes:
        """What an attempt that starts after ``step`` inherits (WELCOME's notes)."""

    def epoch_tallies(self) -> dict[tuple[int, int], dict[str, float | None]]:
        """(rank, epoch) -> what the applied log says about it."""

    def counters(self) -> Mapping[str, int]:
        """The observer's own counters, reported with the relay's."""


class NullObserver:
    """Keeps nothing: a new attempt starts right after complete_through and inherits no notes."""

    def applied(self, step: int, rank: int, meta: StepMeta, attempt: int) -> None:
        pass

    def cut(self, complete_through: int, params: NDArray[np.float32]) -> Cut:
        return Cut(complete_through, (), False)

    def inherit(self, notes: Notes) -> None:
        pass

    def notes_at(self, step: int) -> Notes:
        return ()

    def epoch_tallies(self) -> dict[tuple[int, int], dict[str, float | None]]:
        return {}

    def counters(self) -> Mapping[str, int]:
        return {}


__all__ = ["Cut", "LogObserver", "Notes", "NullObserver"]
