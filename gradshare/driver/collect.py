"""The fit's last stage: the replicas checked against the relay, the model given the relay's parameters and
the history merged over the workers (`collect_result`), and a resume at another world size as the first
re-form of the run's record (`regrouped`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from gradshare.driver.checkpoint import Manifest
from gradshare.driver.history import merge_history
from gradshare.driver.records import Outcome, Prepared, RunPlan
from gradshare.driver.result import FitExtras, FitResult
from gradshare.errors import ConsistencyError
from gradshare.replica.flat import load_int_buffers


def collect_result(
    prep: Prepared,
    run: RunPlan,
    out: Outcome,
    t_start: float,
    relay: str = "client",
    restarts: list[dict[str, str | None]] | None = None,
) -> FitResult:
    """The replicas checked against the relay (ConsistencyError on a mismatch), the model given the
    relay's parameters and rank 0's integer buffers, and the history merged over the workers."""
    bad = [(r.rank, r.param_hash) for r in out.reports if r.param_hash != out.relay_hash]
    if bad:
        raise ConsistencyError(
            f"replicas diverged from the relay (hash {out.relay_hash}): "
            + ", ".join(f"rank {r} has {h}" for r, h in bad)
        )
    model, flat, first_epoch = prep.model, run.flat, run.first_epoch
    with torch.no_grad():  # the relay's parameters, each tensor in its own storage (see `shipped`)
        offset = 0
        for t in flat.tensors:
            n = t.numel()
            t.data = torch.tensor(out.final[offset : offset + n]).reshape(t.shape)  # a copy: `final` may be read-only
            offset += n
    reports = sorted(out.reports, key=lambda r: r.rank)
    load_int_buffers(model, dict(reports[0].int_buffers))
    stopped = reports[0].stopped_epoch  # the log carried it: every rank has the same one
    epochs_run = run.epochs if stopped is None else stopped + 1
    merged, skipped = merge_history(reports, out.tallies, run.steps_per_epoch, epochs_run)
    # a resumed fit's log counts its own epochs from 0; its rows count from the training's start
    history = [replace(row, epoch=row.epoch + first_epoch, loss_fn=prep.plan.name).as_dict() for row in merged]
    extra = FitExtras(
        loss=prep.plan.name,
        label_dtype=prep.plan.label_dtype,
        inputs=prep.features.describe(),
        probe=prep.plan.probe,
        incidents=[i.describe() for i in out.incidents],
        stopped_epoch=_offset(stopped, first_epoch),
        stop_requested_epoch=_offset(reports[0].stop_requested_epoch, first_epoch),
        resumed_from=None if out.resume is None else out.resume["directory"],
        # a retried stage restarted at a checkpoint: the steps it went back from and to
        rolled_back=out.rolled_back,
        checkpoint_service_errors=out.service_errors,
        forwarding=run.forwarding,
        relay=relay,
        restarts=list(restarts or ()),
        relay_statuses=out.statuses,
        step_cap=run.steps.cap_share,
        reforms=regrouped(prep.resume, prep.job.world),
    )
    return FitResult(
        model=model,
        history=history,
        counters=out.counters,
        worker_reports=reports,
        param_hash=out.relay_hash,
        world_size=prep.job.world,
        n_params=flat.n_params,
        steps=max(r.last_step for r in reports) + 1,
        resumed_from=max(r.start_step for r in reports),
        seconds=time.monotonic() - t_start,
        extra=extra,
        skipped_steps=skipped,
    )


def regrouped(resume: Manifest | None, world: int) -> list[dict[str, Any]]:
    """A resume at another world size, as the first of extra["reforms"] (task/checkpoint.sources maps the ranks)."""
    if resume is None or resume["job"]["world_size"] == world:
        return []
    return [
        {
            "kind": "resume",
            "reason": f"resume_from={resume['directory']}",
            "epoch": resume["epochs_done"],
            "from": resume["job"]["world_size"],
            "to": world,
            "at_step": None,
            "steps_redone": 0,
            "rows_skipped": 0,
            "seconds": None,
        }
    ]


def _offset(epoch: int | None, first_epoch: int) -> int | None:
    return None if epoch is None else epoch + first_epoch


__all__ = ["collect_result", "regrouped"]
