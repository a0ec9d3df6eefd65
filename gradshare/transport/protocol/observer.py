"""The relay core's one seam to the training bookkeeping (docs/design.md, Consistency): the core calls an
observer when an update enters the applied log and when a new attempt cuts the log. What it keeps (epoch
tallies, rank 0's stop notes, checkpoints to roll back to) is the driver's; the default is
``tallies.TrainingLog``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from gradshare.transport.protocol.step_meta import StepMeta


class Cut(NamedTuple):
    """Where a new attempt's log starts: after step ``through`` (<= the relay's complete_through), with
    ``notes`` in WELCOME; ``rolled_back``: the observer put the parameters back to ``through``."""

    through: int
    notes: tuple[tuple[str, float], ...]
    rolled_back: bool


class LogObserver(Protocol):
    def applied(self, step: int, rank: int, meta: StepMeta, attempt: int) -> None:
        """Update (step, rank), which carried ``meta``, entered the applied log (canonical order)."""

    def cut(self, complete_through: int, params: NDArray[np.float32]) -> Cut:
        """A new attempt starts; the log holds ``params`` through ``complete_through``. The observer may
        roll ``params`` back in place to an earlier step (a checkpoint) and say so in the Cut."""


__all__ = ["Cut", "LogObserver"]
