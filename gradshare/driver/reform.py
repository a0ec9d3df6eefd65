"""How a job of a fit ended when it did not finish, and where the next one starts (driver/loop.py): an
elastic fit's watch stopped it (`Stop`, `Reformed` with what its relay held, `Left`), or an in-job stage
failed in a way a new run may pass (`Retry`); the next job starts from `Restart`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gradshare.config import TrainConfig
from gradshare.encoding.step_cap import StepCap


@dataclass(frozen=True)
class Left:
    """The relay's state once the cancelled job's tasks are gone: its parameters (every message of the log
    it applied: through `complete_through`, and of the next step those that came) and its tallies."""

    params: np.ndarray
    complete_through: int
    tallies: Mapping[tuple[int, int], Mapping[str, float | None]]
    notes: tuple[tuple[str, float], ...] = ()  # rank 0's epoch-end state through complete_through


@dataclass(frozen=True)
class Stop:
    """Why an elastic fit's watch stops its job to start it again at another size: `kind` is "shrink" (a
    task failed or a rank went silent past its bound) or "grow" (free slots at an epoch's end)."""

    kind: str
    reason: str
    detected_at: float  # time.monotonic() when the watch saw it

    def __str__(self) -> str:
        return f"{self.kind}: {self.reason}"


@dataclass(frozen=True)
class Reformed:
    """How a job the watch stopped ended: why (`stop`), and the relay's state once its tasks were gone."""

    stop: Stop
    left: Left


@dataclass(frozen=True)
class Retry:
    """How an in-job stage ended that a new run may pass (in_job.restartable): the error to raise when no
    run is left."""

    error: Exception


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


@dataclass(frozen=True)
class JobStart:
    """What a fit's next job runs with: its options (an elastic job's: its worker count and batch), the
    checkpoint it resumes, and a re-formed job's start (the relay's parameters)."""

    config: TrainConfig
    resume_from: str | None
    restart: Restart | None = None
