"""Early stopping as one rank holds it (stopping.py): rank 0 runs the rule and the callbacks after each
scored epoch; its next message carries the request, and the log carries the decision to every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradshare.reports import EpochStats
from gradshare.stopping import should_stop, stop_epoch
from gradshare.task.config import WorkerConfig
from gradshare.transport.protocol.step_meta import StepMeta


class StopNotes:
    """Rank 0's rule state, its stop request and whether a message carried it, the stop the log decided
    before this attempt, and rank 0's epoch end for its next message's meta. A checkpoint saves and
    loads these fields (checkpoint.py)."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule  # rank 0's rule state (best, epochs waited): its own copy of cfg.early_stopping
        self.requested: int | None = None  # rank 0: the epoch whose end asked for a stop
        self.sent = False
        self.inherited: int | None = None  # a stop the log decided before this attempt (`inherit`)
        self.notes = StepMeta()  # rank 0: its epoch end (score, rule state) for its next message's meta

    def epoch_end(self, row: EpochStats, callbacks: tuple[Callable[..., Any], ...] | None) -> None:
        """Rank 0, after scoring an epoch: the callbacks (each sees a copy of the row) and the rule. Any
        of them may ask for a stop; the next message carries it (stopping.py)."""
        stop = False
        for callback in callbacks or ():
            stop = bool(callback(dict(row))) or stop
        if self.rule is not None:
            stop = should_stop(self.rule, row) or stop
            self.notes = self.notes.with_(StepMeta(es_best=self.rule.best, es_waited=self.rule.waited))
        if row["val_metric"] is not None:  # the relay keeps it for the epoch's row (a retried stage's history)
            self.notes = self.notes.with_(StepMeta(val_epoch=row["epoch"], val_metric=row["val_metric"]))
        if stop and self.requested is None:
            self.requested = row["epoch"]

    def inherit(self, notes: StepMeta, rank: int) -> None:
        """What a retried stage's attempt inherits from the log before it (the relay's WELCOME notes,
        gradshare/task/tallies.py AttemptNotes, read as StepMeta.from_notes): rank 0's rule state and
        stop request, every rank's stop epoch."""
        if notes.stop_epoch is not None:
            self.inherited = notes.stop_epoch
        if rank != 0:
            return
        if notes.stop_requested is not None:  # sent in a message the log holds: never sent twice
            self.requested, self.sent = notes.stop_requested, True
        if self.rule is not None and notes.es_waited is not None:
            self.rule.best = notes.es_best
            self.rule.waited = notes.es_waited

    def take_meta(self, t: int, cfg: WorkerConfig) -> StepMeta:
        """What step t's message carries beyond its progress: rank 0's last epoch end (the relay keeps it
        for a retried stage) and, once, its stop request with the epoch it stops every rank after."""
        meta, self.notes = self.notes, StepMeta()
        if self.requested is not None and not self.sent:
            self.sent = True  # one decision; a stop that comes too late to shorten any rank sends none
            stop = stop_epoch(t, cfg.compression.staleness, cfg.data.steps_per_epoch, cfg.data.epochs)
            meta = meta.with_(StepMeta(stop_requested=self.requested, stop_epoch=stop))
        return meta
