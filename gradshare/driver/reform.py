"""The records an elastic fit's re-form passes between its jobs (elastic.py): why a job stops (`Reform`),
what its relay held when it stopped (`Left`), and where the next job starts (`Restart`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gradshare.encoding.step_cap import StepCap


@dataclass(frozen=True)
class Left:
    """The relay's state once the cancelled job's tasks are gone: its parameters (every message of the log
    it applied: through `complete_through`, and of the next step those that came) and its tallies."""

    params: np.ndarray
    complete_through: int
    tallies: Mapping[tuple[int, int], Mapping[str, float | None]]
    notes: tuple[tuple[str, float], ...] = ()  # rank 0's epoch-end state through complete_through


class Reform(Exception):
    """Raised by an elastic fit's watch to stop the job and start it again at another size: `kind` is
    "shrink" (a task failed or a rank went silent past its bound) or "grow" (free slots at an epoch's end).
    run_job adds `left`, the relay's state after the cancel. Never leaves `SharedTrainer.fit`."""

    def __init__(self, kind: str, reason: str, detected_at: float) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason, self.detected_at = kind, reason, detected_at
        self.left: Left | None = None


@dataclass(frozen=True)
class Restart:
    """Where a re-formed job starts: the relay's parameters, the whole-training epochs done (it runs the
    interrupted epoch again from its start) and the step cap of the training's start."""

    params: np.ndarray
    epochs_done: int
    step_cap: StepCap | None = None  # the first job's (which tensors it caps: the training's start); None: none
    # rank 0's early-stopping state as the old job's log held it, its epochs counted from the new job's start
    notes: tuple[tuple[str, float], ...] = ()


def shifted(notes: tuple[tuple[str, float], ...], by: int) -> tuple[tuple[str, float], ...]:
    """`notes` (AttemptNotes.at) with their epochs (the stop request, the stop epoch) moved by `by`: a job's
    log counts its epochs from its own start."""
    return tuple((k, v + by if k in ("stop_epoch", "stop_requested") else v) for k, v in notes)
