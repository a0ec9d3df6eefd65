"""What the relay's applied log says beyond the parameters: per-(rank, epoch) sums of the steps' meta
(``EpochTally``) and rank 0's epoch-end state a new attempt inherits (``AttemptNotes``).
Pure bookkeeping, out of relay_core.
"""

from __future__ import annotations

from gradshare.transport.protocol.events import Meta

MAX_EPOCH_ROWS = 1 << 16


class EpochTally:
    """What the applied log says about one (rank, epoch): sums of its steps' meta."""

    __slots__ = ("steps", "loss", "sparsity", "payload", "silent", "tau", "lr", "val_metric", "first_attempt",
                 "last_attempt")

    def __init__(self, attempt: int) -> None:
        self.steps = 0
        self.loss = self.sparsity = self.payload = 0.0
        self.silent = 0
        self.tau: float | None = None
        self.lr: float | None = None
        self.val_metric: float | None = None
        self.first_attempt = self.last_attempt = attempt

    def add(self, meta: Meta, attempt: int) -> None:
        self.steps += 1
        self.loss += meta.get("loss", 0.0)
        self.sparsity += meta.get("sparsity", 0.0)
        self.payload += meta.get("bytes", 0.0)
        self.silent += meta.get("sparsity", 1.0) == 0.0
        self.tau = meta.get("tau", self.tau)
        if self.lr is None:
            self.lr = meta.get("lr")
        self.last_attempt = attempt

    def as_dict(self) -> dict[str, float | None]:
        return {"steps": self.steps, "loss": self.loss, "sparsity": self.sparsity, "payload": self.payload,
                "silent": self.silent, "tau": self.tau, "lr": self.lr, "val_metric": self.val_metric,
                "resumed": self.first_attempt != self.last_attempt}


# rank 0's meta keys that a new attempt inherits (worker.py sends them, stopping.py defines them)
NOTE_KEYS = ("es_best", "es_waited", "stop_epoch", "stop_requested")


class AttemptNotes:
    """Rank 0's epoch-end state as the applied log carries it: (step, {key: value}) in log order, one
    entry per message that carried any of NOTE_KEYS (at most one per epoch), bounded. `at(step)` is the
    state after the log through `step`: what an attempt that starts after `step` inherits."""

    def __init__(self, limit: int = MAX_EPOCH_ROWS) -> None:
        self.entries: list[tuple[int, dict[str, float]]] = []
        self.limit = limit
        self.dropped = 0

    def add(self, step: int, meta: Meta) -> None:
        found = {k: float(meta[k]) for k in NOTE_KEYS if k in meta}
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
