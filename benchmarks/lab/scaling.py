"""`python benchmarks/scaling.py`: what each step teaches the model as workers are added, in lock step.

Users add Spark executors to reach a target accuracy sooner, so this benchmark asks, for N = 1 … 64
workers: the test accuracy per epoch, the epochs to a target, the best and last-3 accuracy, and the
traffic. Every run is in ONE process in lock step (lab/lockstep.py: the real Worker, ApplyLog
and codec, messages delivered through an in-memory log; no Spark, no UDP), so N = 64 fits on 2 cores.

Systems (`SYSTEMS`), each at the workload's recipe (workloads.RECIPES: Adam's lr, epochs, batch; where the
recipe is stated at a global batch, gradshare and "local" run with lr_batch_size at it):
- "gradshare":  the default, each worker's own Adam, ±τ of its update with error feedback, summed (from
                32 workers with the run-long density decay, the step cap and the workers' momentum off,
                driver/policy.py's table);
- "gradshare-nodecay": the same without the run-long decay (decay_from=0), what it buys;
- "gradshare-nocap": the same without the step cap (step_cap=None: the decay then lowers the lr), what
                the cap buys (encoding/step_cap.py); "gradshare-cap": the cap (0.1) at any N;
- "gradshare-keep": the default with the workers' Adam momentum kept (optimizer_momentum="keep"), what
                turning it off buys; "gradshare-nomomentum": the momentum off at any N;
- "local":      the same design without compression (each worker's own Adam, updates summed densely);
- "ddp", "ddp-sqrt", "ddp-linear": one Adam on the mean gradient of the N batches at lr, √N·lr, N·lr.
  "DDP tuned" in the summary is the best of the three by last-3 accuracy (mean over seeds).
N = 1 is the single process ("ddp" at N = 1). Workloads: workloads.SCALING_WORKLOADS.

Writes bench-scaling.json and bench-scaling.png (last-3 accuracy against N, one panel per workload) to
--out-dir. The full run is long (hours on 2 cores: the MNIST-1D CNN's 150 epochs at N = 64 alone are
~300 k worker-steps, ~15 min a seed); --quick is a smoke run, and --workloads/--workers/--systems/--seeds cut it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from gradshare.encoding.step_cap import DEFAULT_STEP_CAP
from lab import report
from lab.train import comma_list
from lab.workloads import RECIPES, SCALING_WORKLOADS, Workload, load

SYSTEMS = (
    "gradshare",
    "gradshare-nodecay",
    "gradshare-nocap",
    "gradshare-cap",
    "gradshare-keep",
    "gradshare-nomomentum",
    "local",
    "ddp",
    "ddp-sqrt",
    "ddp-linear",
)
# what a plain run compares: the default, what it replaced (the workers' momentum kept), the design
# without compression, and DDP at its three lrs; the other variants on request
DEFAULT_SYSTEMS = ("gradshare", "gradshare-keep", "local", "ddp", "ddp-sqrt", "ddp-linear")
# gradshare's variants: the lock-step run's arguments that make each (the default's otherwise)
VARIANTS: dict[str, dict[str, Any]] = {
    "gradshare-nodecay": {"rule": {"kind": "auto", "decay_from": 0.0}},
    "gradshare-nocap": {"step_cap": None},
    "gradshare-cap": {"step_cap": DEFAULT_STEP_CAP},
    "gradshare-keep": {"momentum": "keep"},
    "gradshare-nomomentum": {"momentum": "off"},
}
DDP_LR = {"ddp": lambda n: 1.0, "ddp-sqrt": math.sqrt, "ddp-linear": float}  # lr multiplier at N workers
DEFAULTS = {"workers": "1,2,4,8,16,32,64", "seeds": "0,1,2"}
QUICK = {"workers": "1,4", "seeds": "0", "epochs": 2, "rows": 2048, "workloads": "tabular64k"}
GAP_SLACK_PP = 0.3  # the goal: the default's last-3 accuracy ≥ tuned DDP's − 0.3 pp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=None, help=f"comma list of {','.join(SCALING_WORKLOADS)} (default all)")
    parser.add_argument("--workers", default=None, help=f"comma list of N >= 1 (default {DEFAULTS['workers']})")
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma list of {','.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument("--seeds", default=None, help=f"comma list (default {DEFAULTS['seeds']})")
    parser.add_argument("--epochs", type=int, default=None, help="epochs for every workload (default: its recipe)")
    parser.add_argument("--rows", type=int, default=None, help="keep only this many training/test rows")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} (explicit flags win)")
    parser.add_argument(
        "--out-dir", default=None, help="where bench-scaling.json/.png go (default docs/; --quick: a temp dir)"
    )


def _ints(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < minimum:
        raise ValueError(f"--{flag} takes a comma list of integers >= {minimum}, got {text!r}")
    return values


def settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)

    def given(value: Any, key: str) -> Any:
        return value if value is not None else (QUICK.get(key) if quick else DEFAULTS.get(key))

    for flag, value in (("epochs", args.epochs), ("rows", args.rows)):
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    return {
        "workloads": comma_list(
            given(args.workloads, "workloads") or ",".join(SCALING_WORKLOADS), SCALING_WORKLOADS, "workloads"
        ),
        "workers": _ints(given(args.workers, "workers"), "workers", 1),
        "systems": comma_list(args.systems, SYSTEMS, "systems"),
        "seeds": _ints(given(args.seeds, "seeds"), "seeds", 0),
        "epochs": given(args.epochs, "epochs"),
        "rows": given(args.rows, "rows"),
        "quick": quick,
    }


def runs(cfg: dict[str, Any]) -> list[tuple[str, int, str, int]]:
    """(workload, N, system, seed) of every run; N = 1 is one run, the single process."""
    out = []
    for w in cfg["workloads"]:
        for n in cfg["workers"]:
            for system in ["ddp"] if n == 1 else cfg["systems"]:
                out += [(w, n, system, seed) for seed in cfg["seeds"]]
    return out


def run_one(workload: str, world: int, system: str, seed: int, cfg: dict[str, Any], data: Workload) -> dict[str, Any]:
    from lab.lockstep import run

    recipe = RECIPES[workload]
    lr = recipe.lr * (DDP_LR[system](world) if system in DDP_LR else 1.0)
    mode = "ddp" if system in DDP_LR else "gradshare" if system in VARIANTS else system
    # a recipe stated at a global batch: the design's workers take its lr at that batch (lr_batch_size);
    # DDP's one optimizer sees the global batch itself
    lr_batch = None if mode == "ddp" else recipe.global_batch
    t0 = time.monotonic()
    out = run(
        workload=workload,
        world=world,
        epochs=cfg["epochs"] or recipe.epochs,
        seed=seed,
        lr=lr,
        batch=recipe.batch_for(world),
        system=mode,
        data=data,
        lr_batch=lr_batch,
        **VARIANTS.get(system, {}),
    )
    accuracy = [a / 100 for a in out["acc"]]
    return {
        "workload": workload,
        "workers": world,
        "system": system,
        "seed": seed,
        "lr": lr,
        "lr_batch": lr_batch,
        "batch": recipe.batch_for(world),
        "accuracy": accuracy,
        "last3": statistics.fmean(accuracy[-3:]),
        "best": max(accuracy),
        "epochs_to_target": next((e + 1 for e, a in enumerate(accuracy) if a >= data.target), None),
        "traffic_ratio": out["ratio"] if mode == "gradshare" else 1.0,
        "seconds": time.monotonic() - t0,
    }


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload × N × system over seeds, plus a "ddp-tuned" entry (the best DDP lr by last-3 mean)."""
    out = []
    for w, n, system in sorted({(r["workload"], r["workers"], r["system"]) for r in rows}):
        group = [r for r in rows if (r["workload"], r["workers"], r["system"]) == (w, n, system)]
        last3 = [r["last3"] for r in group]
        mean = [statistics.fmean(c) for c in zip(*(r["accuracy"] for r in group))]
        target = group[0].get("target")
        out.append(
            {
                "workload": w,
                "workers": n,
                "system": system,
                "seeds": [r["seed"] for r in group],
                "lr": group[0]["lr"],
                "mean": mean,
                "last3_mean": statistics.fmean(last3),
                "last3_std": statistics.stdev(last3) if len(last3) > 1 else None,
                "best_mean": statistics.fmean(r["best"] for r in group),
                "epochs_to_target": next(
                    (e + 1 for e, a in enumerate(mean) if target is not None and a >= target), None
                ),
                "traffic_ratio": statistics.fmean(r["traffic_ratio"] for r in group),
                "seconds": statistics.fmean(r["seconds"] for r in group),
            }
        )
    for w, n in sorted({(s["workload"], s["workers"]) for s in out}):
        ddps = [s for s in out if (s["workload"], s["workers"]) == (w, n) and s["system"] in DDP_LR]
        if ddps:
            out.append(dict(max(ddps, key=lambda s: s["last3_mean"]), system="ddp-tuned"))
    return out


def gaps(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gradshare's (and the dense local design's) last-3 accuracy minus tuned DDP's, in pp, per workload × N."""
    found = []
    for s in summary:
        if s["system"] not in ("gradshare", *VARIANTS, "local"):
            continue
        tuned = next(
            (
                t
                for t in summary
                if t["system"] == "ddp-tuned" and (t["workload"], t["workers"]) == (s["workload"], s["workers"])
            ),
            None,
        )
        if tuned is not None:
            gap = 100 * (s["last3_mean"] - tuned["last3_mean"])
            found.append(
                {
                    "workload": s["workload"],
                    "workers": s["workers"],
                    "system": s["system"],
                    "gap_pp": gap,
                    "tuned_lr": tuned["lr"],
                    "met": gap >= -GAP_SLACK_PP,
                }
            )
    return found


def plot(path: str, summary: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({s["workload"] for s in summary})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.6 * len(workloads), 3.4), squeeze=False)
    colors = {
        "gradshare": "tab:green",
        "gradshare-nodecay": "tab:cyan",
        "gradshare-nocap": "tab:blue",
        "gradshare-cap": "tab:brown",
        "gradshare-keep": "tab:gray",
        "gradshare-nomomentum": "tab:pink",
        "local": "tab:olive",
        "ddp": "tab:red",
        "ddp-sqrt": "tab:orange",
        "ddp-linear": "tab:purple",
        "ddp-tuned": "black",
    }
    for ax, w in zip(axes[0], workloads):
        for system in colors:
            pts = sorted(
                (s["workers"], 100 * s["last3_mean"]) for s in summary if s["workload"] == w and s["system"] == system
            )
            if pts:
                ax.plot(
                    *zip(*pts),
                    marker=".",
                    label=system,
                    color=colors[system],
                    linestyle="--" if system == "ddp-tuned" else "-",
                )
        ax.set_xscale("log", base=2)
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("workers N")
        ax.set_ylabel("last-3 test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    report.save_figure(fig, path, title)


def run(args: argparse.Namespace) -> int:
    cfg = settings(args)
    out_dir = args.out_dir or (
        tempfile.mkdtemp(prefix="gradshare-scaling-") if cfg["quick"] else "docs/benchmarks/data"
    )
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    cache: dict[tuple[str, int], Workload] = {}
    for workload, world, system, seed in runs(cfg):
        if (workload, seed) not in cache:
            cache = {(workload, seed): load(workload, seed, None, cfg["rows"])}
        data = cache[(workload, seed)]
        try:
            row = run_one(workload, world, system, seed, cfg, data)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
            row = {
                "workload": workload,
                "workers": world,
                "system": system,
                "seed": seed,
                "error": f"{type(e).__name__}: {e}"[:300],
            }
        row["target"] = data.target
        rows.append(row)
        print(
            f"[scaling] {workload} N={world} {system} seed {seed}: "
            + (
                row.get("error")
                or f"last-3 {100 * row['last3']:.2f} %, traffic {row['traffic_ratio']:,.0f}x, {row['seconds']:.0f} s"
            ),
            flush=True,
        )
    ok = [r for r in rows if "error" not in r]
    summary = summarise(ok)
    doc: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": report.machine(),
        "command": report.command_line("scaling"),
        "config": cfg,
        "recipes": {w: vars(RECIPES[w]) for w in cfg["workloads"]},
        "summary": summary,
        "gaps": gaps(summary),
        "rows": rows,
        "total_seconds": time.monotonic() - t0,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench-scaling.json"), "w") as f:
        json.dump(doc, f, indent=1, default=float)
    plot(os.path.join(out_dir, "bench-scaling.png"), summary, f"{doc['date']}, lock step")
    print(f"{'workload':<12} {'N':>3} {'system':<17} {'last-3 %':>14} {'best %':>7} {'→target':>7} {'traffic':>8}")
    for s in summary:
        std = f" ± {100 * s['last3_std']:.2f}" if s["last3_std"] is not None else ""
        print(
            f"{s['workload']:<12} {s['workers']:>3} {s['system']:<17} {100 * s['last3_mean']:>7.2f}{std:<7} "
            f"{100 * s['best_mean']:>7.2f} {s['epochs_to_target'] or '—':>7} {s['traffic_ratio']:>7,.0f}x"
        )
    for g in doc["gaps"]:
        print(f"  {g['workload']} N={g['workers']} {g['system']} − DDP tuned: {g['gap_pp']:+.2f} pp")
    print(f"{len(rows)} runs in {doc['total_seconds']:.0f} s; wrote {out_dir}/bench-scaling.json and .png")
    return 0 if len(ok) == len(rows) else 1
