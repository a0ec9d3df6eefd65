"""What the relay's applied log says beyond the parameters: per-(rank, epoch) sums of the steps' meta
(``EpochTally``), rank 0's epoch-end state a new attempt inherits (``AttemptNotes``), and the two as the
relay core's training observer (``TrainingLog``, transport/protocol/relay/observer.py LogObserver) with the
rollback to checkpoints. Training bookkeeping, outside the transport (which knows nothing of epochs): the driver and
the in-job relay (task/relay_host.py) hand one to their relay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
from numpy.typing import NDArray

from gradshare.transport.protocol.relay.observer import Cut, Notes
from gradshare.transport.protocol.step_meta import StepMeta

MAX_EPOCH_ROWS = 1 << 16


class EpochTally:
    """What the applied log says about one (rank, epoch): sums of its steps' meta."""

    __slots__ = (
        "steps",
        "loss",
        "sparsity",
        "payload",
        "silent",
        "tau",
        "lr",
        "val_metric",
        "first_attempt",
        "last_attempt",
    )

    def __init__(self, attempt: int) -> None:
        self.steps = 0
        self.loss = self.sparsity = self.payload = 0.0
        self.silent = 0
        self.tau: float | None = None
        self.lr: float | None = None
        self.val_metric: float | None = None
        self.first_attempt = self.last_attempt = attempt

    def add(self, meta: StepMeta, attempt: int) -> None:
        self.steps += 1
        self.loss += meta.loss or 0.0
        self.sparsity += meta.sparsity or 0.0
        self.payload += meta.bytes or 0.0
        self.silent += meta.sparsity == 0.0
        if meta.tau is not None:
            self.tau = meta.tau
        if self.lr is None:
            self.lr = meta.lr
        self.last_attempt = attempt

    def as_dict(self) -> dict[str, float | None]:
        return {
            "steps": self.steps,
            "loss": self.loss,
            "sparsity": self.sparsity,
            "payload": self.payload,
            "silent": self.silent,
            "tau": self.tau,
            "lr": self.lr,
            "val_metric": self.val_metric,
            "resumed": self.first_attempt != self.last_attempt,
        }


class AttemptNotes:
    """Rank 0's epoch-end state as the applied log carries it: (step, {key: value}) in log order, one
    entry per message that carried any of StepMeta.NOTE_FIELDS (at most one per epoch), bounded. `at(step)` is the
    state after the log through `step`: what an attempt that starts after `step` inherits."""

    def __init__(self, limit: int = MAX_EPOCH_ROWS) -> None:
        self.entries: list[tuple[int, dict[str, float]]] = []
        self.limit = limit
        self.dropped = 0

    def add(self, step: int, meta: StepMeta) -> None:
        found = meta.notes()
        if not found:
            return
        if len(self.entries) >= self.limit:  # a fit of more epochs than this keeps its newest state
            self.entries.pop(0)
            self.dropped += 1
        self.entries.append((step, found))

    def cut(self, step: int) -> None:
        """Forget what steps after `step` said (a rollback to a checkpoint at `step`)."""
        self.entries = [(t, found) for t, found in self.entries if t <= step]

    def at(self, step: int) -> tuple[tuple[str, float], ...]:
        state: dict[str, float] = {}
        for t, found in self.entries:
            if t <= step:
                state.update(found)
        return tuple(sorted(state.items()))


# what a rollback answers: (through, params, epochs_done, note); see TrainingLog
RollbackPoint = tuple[int, NDArray[np.float32], int, float]


class TrainingLog:
    """The relay's training bookkeeping (observer.LogObserver): every applied update's meta per (rank,
    epoch) in ``epochs`` (bounded), so the history of a retried stage includes the steps of the attempts
    before it (rank 0's validation score of an epoch too, from the message after it scored it); rank 0's
    early-stopping state and stop decision as of the cut (``notes``), handed over in WELCOME's notes.

    rollback: None, or ``rollback(complete_through) -> None | (through, params, epochs_done, note)``,
    asked when a new attempt starts: the log restarts after step `through` (<= complete_through) from
    `params` (the state the log holds through it), per-(rank, epoch) tallies of epochs >= epochs_done
    (counted in the log's epochs) are dropped, and WELCOME's notes add ``("checkpoint", note)``.
    The trainer's reads the last checkpoint (checkpoint.py); it is called under the relay's lock."""

    def __init__(self, rollback: Callable[[int], RollbackPoint | None] | None = None) -> None:
        self.rollback = rollback
        self.epochs: dict[tuple[int, int], EpochTally] = {}  # (rank, epoch) -> the applied steps' meta
        self.notes = AttemptNotes()  # rank 0's epoch-end state, in log order
        self.counts: Counter[str] = Counter()  # reported with the relay's counters

    def applied(self, step: int, rank: int, meta: StepMeta, attempt: int) -> None:
        if meta.epoch is not None:
            self._tally(rank, meta.epoch, meta, attempt)
        if rank == 0:
            self.notes.add(step, meta)
            if meta.val_epoch is not None and meta.val_metric is not None:
                self._tally_score(meta.val_epoch, meta.val_metric)

    def cut(self, complete_through: int, params: NDArray[np.float32]) -> Cut:
        point = None if self.rollback is None else self.rollback(complete_through)
        if point is None:
            return Cut(complete_through, self.notes.at(complete_through), False)
        through, values, epochs_done, note = point
        if not -1 <= through <= complete_through or np.shape(values) != params.shape:
            raise ValueError(
                f"rollback to step {through} with {np.shape(values)} values: the relay holds "
                f"the log through {complete_through} and {params.shape} values"
            )
        np.copyto(params, values)
        self.notes.cut(through)
        for key in [k for k in self.epochs if k[1] >= epochs_done]:  # those epochs run again, whole
            del self.epochs[key]
        return Cut(through, self.notes.at(through) + (("checkpoint", float(note)),), True)

    def inherit(self, notes: Notes) -> None:
        """Before the first attempt: `notes` as if the log held them before its first step (WELCOME's)."""
        if notes:
            self.notes.entries.append((-1, dict(notes)))

    def notes_at(self, step: int) -> Notes:
        """Rank 0's epoch-end state through `step` (AttemptNotes.at)."""
        return self.notes.at(step)

    def epoch_tallies(self) -> dict[tuple[int, int], dict[str, float | None]]:
        """(rank, epoch) -> what the applied log says about it (EpochTally.as_dict)."""
        return {k: t.as_dict() for k, t in self.epochs.items()}

    def counters(self) -> Mapping[str, int]:
        return self.counts

    def _tally(self, rank: int, epoch: int, meta: StepMeta, attempt: int) -> None:
        tally = self.epochs.get((rank, epoch))
        if tally is None:
            if len(self.epochs) >= MAX_EPOCH_ROWS:
                self.counts["epoch_rows_dropped"] += 1
                return
            tally = self.epochs[(rank, epoch)] = EpochTally(attempt)
        tally.add(meta, attempt)

    def _tally_score(self, epoch: int, value: float) -> None:
        """Rank 0's validation score of `epoch`, from the message after it scored it (worker.py)."""
        tally = self.epochs.get((0, epoch))
        if tally is not None:
            tally.val_metric = value


__all__ = ["MAX_EPOCH_ROWS", "AttemptNotes", "EpochTally", "RollbackPoint", "TrainingLog"]
