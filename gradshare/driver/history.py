"""A fit's history: one row per epoch, merged from the workers' reports and, where a retried stage
resumed inside an epoch, the relay's tally of the applied log (which holds the killed attempts' steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TypeAlias

import numpy as np

from gradshare.reports import EpochStats, WorkerReport

# (rank, epoch) -> the relay's tally of the applied log (Relay.epoch_tallies, EpochTally.as_dict)
Tallies: TypeAlias = Mapping[tuple[int, int], Mapping[str, float | None]]


def rank_rows(
    reports: list[WorkerReport], tallies: Tallies, steps_per_epoch: tuple[int, ...], epochs: int
) -> dict[tuple[int, int], EpochStats]:
    """(rank, epoch) -> that rank's history row. The last attempt's own row where it trained the whole
    epoch; otherwise (a retried stage resumed inside it, or after it) a row made from the relay's tally
    of the applied log, which holds the killed attempts' steps too. "resumed" says which."""
    own = {(r.rank, h.epoch): h for r in reports for h in r.history}
    rows: dict[tuple[int, int], EpochStats] = {}
    for rank, spe in enumerate(steps_per_epoch):
        for e in range(epochs):
            row, tally = own.get((rank, e)), tallies.get((rank, e))
            if tally is None and row is None:  # the log went on without this rank (on_rank_loss="continue")
                rows[(rank, e)] = EpochStats(
                    epoch=e,
                    steps=0,
                    loss=0.0,
                    sparsity=0.0,
                    payload_bytes=0,
                    bytes_sent=0,
                    bytes_received=0,
                    tau=None,
                    lr=None,
                    silent_steps=0,
                    seconds=0.0,
                    val_metric=None,
                    resumed=False,
                    skipped_steps=spe,
                )
                continue
            if row is not None and (tally is None or (not tally["resumed"] and row.steps == tally["steps"])):
                rows[(rank, e)] = replace(row, resumed=False, skipped_steps=spe - row.steps)
                continue
            assert tally is not None  # no tally: continued above, with or without a row
            steps = int(_tallied(tally, "steps"))
            n = max(steps, 1)
            rows[(rank, e)] = EpochStats(
                epoch=e,
                steps=steps,
                loss=_tallied(tally, "loss") / n,
                sparsity=_tallied(tally, "sparsity") / n,
                payload_bytes=int(_tallied(tally, "payload")),
                tau=tally["tau"],
                lr=tally["lr"],
                silent_steps=int(_tallied(tally, "silent")),
                # the workers' own counters and clocks: only the attempt that finished the epoch reported them
                bytes_sent=row.bytes_sent if row else 0,
                bytes_received=row.bytes_received if row else 0,
                seconds=row.seconds if row else 0.0,
                # rank 0's score: its own row's, or the one its next message carried (a killed attempt's)
                val_metric=row.val_metric if row and row.val_metric is not None else tally.get("val_metric"),
                resumed=bool(tally["resumed"]),  # its steps were applied in more than one attempt
                skipped_steps=spe - steps,
            )
    return rows


def _tallied(tally: Mapping[str, float | None], key: str) -> float:
    """One of a tally's counts or sums (EpochTally.as_dict: those are never None; tau, lr, val_metric may be)."""
    value = tally[key]
    assert value is not None
    return value


def merge_history(
    reports: list[WorkerReport], tallies: Tallies, steps_per_epoch: tuple[int, ...], epochs: int
) -> tuple[list[EpochStats], int]:
    """One row per epoch across workers: sums for bytes, means for loss/sparsity/τ, max for time; and
    the steps of data skipped in all (on_rank_loss="continue")."""
    by_rank = rank_rows(reports, tallies, steps_per_epoch, epochs)
    merged = []
    for e in sorted({e for _, e in by_rank}):
        rows = [by_rank[k] for k in sorted(by_rank) if k[1] == e]
        steps = sum(h.steps for h in rows)
        val = [h.val_metric for h in rows if h.val_metric is not None]
        taus = [h.tau for h in rows if h.tau is not None]
        merged.append(
            EpochStats(
                epoch=e,
                steps=steps,
                loss=sum(h.loss * h.steps for h in rows) / max(steps, 1),
                sparsity=sum(h.sparsity * h.steps for h in rows) / max(steps, 1),
                payload_bytes=sum(h.payload_bytes for h in rows),
                bytes_sent=sum(h.bytes_sent for h in rows),
                bytes_received=sum(h.bytes_received for h in rows),
                tau=float(np.mean(taus)) if taus else float("nan"),
                lr=next((h.lr for h in rows if h.lr is not None), None),  # rank 0's unless it had none
                silent_steps=sum(h.silent_steps for h in rows),
                seconds=max(h.seconds for h in rows),
                val_metric=val[0] if val else None,
                resumed=any(h.resumed for h in rows),
                skipped_steps=sum(h.skipped_steps or 0 for h in rows),
            )
        )
    return merged, sum(h.skipped_steps or 0 for h in merged)
