"""The runs of `python benchmarks/convergence.py`: every configuration of a resolved config, workload by
workload (single, then per N gradshare and DDP, the DDP runs of one workload × N in one TorchDistributor
launch), each a result row, a failed one (its error kept) where it fails or runs out of its budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lab import ddp, systems
from lab.report import Row, final_accuracy
from lab.systems import Measured
from lab.workloads import Workload, load

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DDP_START_SECONDS = 180.0  # a DDP batch's hard limit: this + (budget + 30 s) per run


# ------------------------------------------------------------------------------------------ rows
def epochs_to_target(accuracies: list[float], target: float) -> int | None:
    """The first epoch (1-based) whose accuracy is ≥ `target`; None if none is."""
    return next((e + 1 for e, a in enumerate(accuracies) if a >= target), None)


def make_row(
    system: str, workload: str, schedule: str, seed: int, workers: int, measured: Measured, target: float, epochs: int
) -> dict[str, Any]:
    """One result row from a `systems.Measured`; a run stopped by its budget is a failed row (curve kept)."""
    curve = [(float(t), float(a)) for t, a in measured.curve]
    accuracy = [a for _, a in curve]
    extra = measured.extra
    row = {
        "system": system,
        "workload": workload,
        "schedule": schedule,
        "seed": seed,
        "workers": workers,
        "status": "ok",
        "epochs": epochs,
        "target": target,
        "n_params": int(measured.n_params),
        "steps": len(measured.walls),
        "accuracy": accuracy,
        "train_seconds": [t for t, _ in curve],
        "final_accuracy": final_accuracy(curve),
        "epochs_to_target": epochs_to_target(accuracy, target),
        "wall_seconds": sum(measured.walls),
    }
    if system == "gradshare":
        history = extra["epochs_history"]
        row.update(
            {
                "bytes_per_step": extra["worker_udp_bytes_per_step"],
                "traffic_ratio": extra["traffic_ratio"],
                "tau": [h["tau"] for h in history],
                "sparsity": [h["sparsity"] for h in history],
                "silent_share": [h["silent_steps"] / h["steps"] if h["steps"] else None for h in history],
                "lr": [h["lr"] for h in history],
                "fit_seconds": extra["fit_seconds"],
                "param_hash": extra["param_hash"],
            }
        )
    elif system == "ddp":  # not measured: the dense float32 gradient one worker contributes per step
        row.update({"bytes_per_step": 4.0 * measured.n_params, "traffic_ratio": 1.0})
    else:
        row.update({"bytes_per_step": 0.0, "traffic_ratio": None})
    if measured.stopped_by_budget or len(accuracy) < epochs:
        row["status"] = "error"
        row["error"] = f"stopped by the per-configuration budget after {len(accuracy)} of {epochs} epochs"
    return row


def failed_row(
    system: str, workload: str, schedule: str, seed: int, workers: int, error: str | BaseException
) -> dict[str, Any]:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    first = text.strip().splitlines()[0][:300] if text.strip() else "error"
    return {
        "system": system,
        "workload": workload,
        "schedule": schedule,
        "seed": seed,
        "workers": workers,
        "status": "error",
        "error": first,
        "accuracy": [],
    }


# ------------------------------------------------------------------------------------------ running
def run_configs(
    cfg: dict[str, Any], spark: SparkSession | None, on_part: Callable[[list[Row], list[Row]], object] | None = None
) -> tuple[list[Row], list[Row]]:
    """Every configuration of `cfg`, workload by workload: single, then per N gradshare and DDP.
    Returns (rows, parts: seconds per workload × system × N). `on_part(rows, parts)` after each part."""
    rows: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    budget, bs = cfg["budget"], cfg["batch_size"]
    runs = [(schedule, seed) for schedule in cfg["schedules"] for seed in cfg["seeds"]]

    def part(workload: str, system: str, workers: int, new: list[dict[str, Any]], seconds: float) -> None:
        rows.extend(new)
        parts.append(
            {
                "workload": workload,
                "system": system,
                "workers": workers,
                "configs": len(new),
                "failed": sum(r["status"] != "ok" for r in new),
                "seconds": seconds,
            }
        )
        print(f"[convergence] {workload} {system} N={workers}: {len(new)} configs in {seconds:.0f} s", flush=True)
        if on_part is not None:
            on_part(rows, parts)

    def one(
        system: str, wl: Workload, schedule: str, seed: int, workers: int, epochs: int, train: Callable[[], Measured]
    ) -> Row:
        t0 = time.monotonic()
        try:
            r = make_row(system, wl.name, schedule, seed, workers, train(), wl.target, epochs)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
            r = failed_row(system, wl.name, schedule, seed, workers, e)
        r["elapsed"] = time.monotonic() - t0
        return _said(r)

    for name in cfg["workloads"]:
        epochs = cfg["epochs"][name]
        data = {seed: load(name, seed, None, cfg["rows"]) for seed in cfg["seeds"]}
        common = {"epochs": epochs, "batch_size": bs, "budget": budget}
        if "single" in cfg["systems"]:
            t0 = time.monotonic()
            new = [
                one(
                    "single",
                    data[seed],
                    sch,
                    seed,
                    1,
                    epochs,
                    lambda: systems.run_single(data[seed], seed=seed, lr_schedule=sch, **common),
                )
                for sch, seed in runs
            ]
            part(name, "single", 1, new, time.monotonic() - t0)
        for n in cfg["workers"]:
            if "gradshare" in cfg["systems"]:
                assert spark is not None  # run() starts Spark for every system but the single process
                t0 = time.monotonic()
                # the fit's start-up (Spark jobs, relay, worker imports) is inside the cancel timer
                new = [
                    one(
                        "gradshare",
                        data[seed],
                        sch,
                        seed,
                        n,
                        epochs,
                        lambda: systems.run_gradshare(
                            spark,
                            data[seed],
                            seed=seed,
                            lr_schedule=sch,
                            workers=n,
                            threshold=cfg["threshold"],
                            aggregate=cfg["aggregate"],
                            **dict(common, budget=budget + 60),
                        ),
                    )
                    for sch, seed in runs
                ]
                part(name, "gradshare", n, new, time.monotonic() - t0)
            if "ddp" in cfg["systems"]:
                assert spark is not None  # as above
                t0 = time.monotonic()
                new = _ddp_part(spark, cfg, name, n, runs, data, epochs)
                part(name, "ddp", n, new, time.monotonic() - t0)
    return rows, parts


def _ddp_part(
    spark: SparkSession,
    cfg: dict[str, Any],
    name: str,
    workers: int,
    runs: list[tuple[str, int]],
    data: dict[int, Workload],
    epochs: int,
) -> list[Row]:
    """Every (schedule, seed) of one workload × N in one TorchDistributor launch; each row's `elapsed`
    is its own run plus an equal share of the launch's start-up."""
    specs = [
        ddp.ddp_spec(
            name,
            seed=seed,
            epochs=epochs,
            batch_size=cfg["batch_size"],
            budget=cfg["budget"],
            lr_schedule=sch,
            rows=cfg["rows"],
        )
        for sch, seed in runs
    ]
    t0 = time.monotonic()
    try:
        measured, seconds = ddp.run_ddp_batch(
            spark, specs, workers=workers, hard_timeout=DDP_START_SECONDS + len(specs) * (cfg["budget"] + 30)
        )
    except Exception as e:  # noqa: BLE001 - the whole batch failed: one failed row per run
        seconds = time.monotonic() - t0
        return [
            _said(dict(failed_row("ddp", name, sch, seed, workers, e), elapsed=seconds / len(runs)))
            for sch, seed in runs
        ]
    share = max(seconds - sum(m.extra["seconds"] for m in measured), 0.0) / len(measured)
    new = []
    for (sch, seed), m in zip(runs, measured):
        r = make_row("ddp", name, sch, seed, workers, m, data[seed].target, epochs)
        r["elapsed"], r["launch_share"] = m.extra["seconds"] + share, share
        new.append(_said(r))
    return new


def _said(r: dict[str, Any]) -> dict[str, Any]:
    """`r`, after a progress line about it."""
    acc = r["accuracy"][-1] if r["accuracy"] else math.nan
    print(
        f"[convergence]   {r['workload']} {r['schedule']} seed {r['seed']} {r['system']} N={r['workers']}: "
        f"{r['status']} in {r['elapsed']:.1f} s, last acc {acc:.3f}"
        + (f" ({r['error']})" if r["status"] != "ok" else ""),
        flush=True,
    )
    return r
