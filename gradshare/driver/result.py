"""FitResult: what `SharedTrainer.fit` returns (the model with the relay's parameters, the history, the
transport's counters and the workers' reports), and FitExtras, the fit's facts beside them."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from gradshare.driver.plotting import plot_result
from gradshare.reports import Counters, WorkerReport


@dataclass(frozen=True, eq=False)  # eq: Mapping's, so it compares like the dict it was
class FitExtras(Mapping[str, Any]):
    """What the fit chose and what happened to it (`SharedTrainer.fit`'s docstring), read as attributes or
    by key like a dict: ``result.extra.loss`` is ``result.extra["loss"]``. None where a FitResult is made
    by hand (a fit sets every field but the epochs and the checkpoint it did not have)."""

    loss: str | None = None  # the loss's or train step's name (each history row's "loss_fn")
    label_dtype: str | None = None  # "int64" | "float32"
    inputs: str | None = None  # dtype and shape per input: "float32[64]" or "(float32[4], int64[])"
    probe: str | None = None  # the driver's one-row forward: its output shape, or why it was skipped
    incidents: list[str] = field(default_factory=list)  # the relay's liveness incidents
    stopped_epoch: int | None = None  # the last epoch run after an early stop (None: every epoch ran)
    stop_requested_epoch: int | None = None  # the epoch whose end asked for the stop
    resumed_from: str | None = None  # fit(resume_from=...)'s checkpoint directory
    rolled_back: list[dict[str, int]] = field(default_factory=list)  # {"attempt", "from", "to"}: log steps
    checkpoint_service_errors: list[str] = field(default_factory=list)  # at most 100
    forwarding: str | None = None  # "per-rank" | "aggregate": what ran
    relay: str | None = None  # "client" | "in-job": where the relay ran
    # relay="in-job": each time a failed stage was run again, {"error": its first line, "from": the
    # checkpoint it resumed from, or None: from scratch}
    restarts: list[dict[str, str | None]] = field(default_factory=list)
    # relay="in-job": the relay's statuses that reached this process (0: its pushes cannot reach it)
    relay_statuses: int | None = None
    step_cap: float | None = None  # the step cap that ran (step_cap="auto" resolved; None: none)
    # an elastic fit's re-forms, in order: {"kind": "shrink" | "grow", "reason", "epoch" (the whole-training
    # epoch the new job started at), "from", "to" (workers), "at_step" (the old job's log step), "steps_redone",
    # "rows_skipped", "seconds" (from the detection to the new job's first step)}; a resume at another world
    # size adds {"kind": "resume", ...} first
    reforms: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        if key not in _EXTRAS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_EXTRAS)

    def __len__(self) -> int:
        return len(_EXTRAS)


_EXTRAS = tuple(f.name for f in fields(FitExtras))


@dataclass
class FitResult:
    """What `fit` returns. `history` has one dict per epoch (see `SharedTrainer.fit`)."""

    model: nn.Module
    # EpochStats.as_dict() rows: plain dicts users index, JSON-dump and log. Values are of the row's
    # several types (int, float, str, bool, None), read by key: Any, as the bare `dict` said before.
    history: list[dict[str, Any]]
    counters: Counters  # the relay's transport counters (read like a dict: counters["applied"])
    worker_reports: list[WorkerReport]  # one per rank (read like a dict: report["param_hash"])
    param_hash: str
    world_size: int
    n_params: int
    steps: int  # steps of the longest-running rank; an elastic fit's, over all its jobs (a re-run epoch's twice)
    resumed_from: int  # 0, or the step a retried stage continued from
    seconds: float
    extra: FitExtras = field(default_factory=FitExtras)  # read like a dict too: extra["loss"]
    # steps of data the log went on without (only on_rank_loss="continue" skips any)
    skipped_steps: int = 0

    @property
    def bytes_sent(self) -> int:
        """UDP bytes the workers sent (datagrams incl. headers, acks and retransmits)."""
        return sum(r.counters.bytes_sent for r in self.worker_reports)

    @property
    def bytes_received(self) -> int:
        """UDP bytes the workers received for training (the model's snapshot downloads apart)."""
        return sum(r.counters.training_bytes_in for r in self.worker_reports)

    @property
    def snapshot_bytes(self) -> int:
        """UDP bytes of the model's downloads from the relay: every worker's initial state (4 B × the
        state's entries, plus headers) and a resumed attempt's. Not in `bytes_received`/`traffic_ratio`:
        it is the model's distribution, once per task, not the training's traffic."""
        return sum(r.counters.snapshot_bytes_in for r in self.worker_reports)

    @property
    def dense_bytes(self) -> int:
        """What dense float32 sharing would move for the same steps: each worker sends 4·N bytes per
        step and receives every other worker's 4·N (a parameter-server / relay layout)."""
        steps = sum(r.last_step + 1 for r in self.worker_reports)
        return 4 * self.n_params * steps * self.world_size

    @property
    def traffic_ratio(self) -> float:
        """dense bytes ÷ bytes actually moved (sent + received by the workers)."""
        moved = self.bytes_sent + self.bytes_received
        return self.dense_bytes / moved if moved else math.inf

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Write a PNG of loss, validation metric and traffic per epoch to `path` (gradshare/driver/plotting.py;
        needs matplotlib). Returns the path."""
        return plot_result(self, path)
