"""`python benchmarks/convergence.py`: test accuracy per epoch of gradshare vs DDP dense vs one process.

Users buy epochs and time to a target accuracy. For every workload × LR schedule × seed this command trains
- "single":    one process on the whole training set (independent of N: run once),
- "gradshare": `SharedTrainer` with N barrier tasks, the relay on the driver (loopback),
- "ddp":       DDP over Gloo in N processes (pyspark `TorchDistributor(num_processes=N, local_mode=False)`),
for every N of `--workers`, all in ONE embedded `local[4]` Spark session on loopback, with the same data,
seed, Adam(lr 1e-3), batch per worker and schedule (`systems.lr_scheduler_factory`: a torch LambdaLR
stepped once per optimizer step, over each process's own steps). gradshare's τ is `threshold="auto"`
unless `--threshold` gives one. Per epoch it records the test accuracy (and for gradshare τ, the share of
sent entries and of silent steps, the lr); across seeds it reports mean ± std per epoch, epochs to target,
final accuracy (mean of the last 3 epochs), bytes per worker-step and wall seconds, checks the
convergence targets (docs/benchmarks/convergence.md), prints a table and writes `bench-convergence.json`
and `bench-convergence.png` to `--out-dir`.

Every configuration is bounded by `--budget`; a configuration that fails or runs out of budget is a failed
row (its error kept), never a hang. The DDP runs of one workload × N share one TorchDistributor launch
(`ddp.run_ddp_batch`), whose start-up costs ~15-25 s on the 2-core VM; each row carries its share.
Top-level imports are stdlib only (the CLI imports this module to build its parser).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from gradshare.cli import threshold_arg
from gradshare.config import TrainConfig
from gradshare.config.options import Compression
from lab import report, systems
from lab.convergence_runs import epochs_to_target, run_configs
from lab.report import accuracy_panel, fmt, human_bytes, machine, save_figure
from lab.systems import LR_SCHEDULES, STEP_DECAY_AT, STEP_DECAY_GAMMA
from lab.train import comma_list
from lab.workloads import WORKLOADS

SYSTEMS = ("single", "gradshare", "ddp")
QUICK: dict[str, Any] = {"rows": 256, "epochs": 2, "seeds": "0", "workers": "2", "schedules": "cosine"}
# Epochs per workload of the full run, sized so that 3 workloads × 3 schedules × 3 seeds × N ∈ {2, 4} ×
# 3 systems fit in about an hour on the 2-core VM (docs/benchmarks/convergence.md has the timings). On
# seed 0 with cosine every system had crossed its target by epoch 5 (MLP), 7 (CNN, of 8: too few to see
# N=4 settle) and 6 (tabular), and moved by at most 1.1 pp over its last 3 epochs.
DEFAULT_EPOCHS = {"mlp": 12, "cnn": 10, "tabular": 10}
DEFAULT_BUDGET = 240.0  # seconds of training per configuration; far above any measured run
ACCURACY_SLACK_PP = 0.3  # target: gradshare's final accuracy ≥ DDP's − 0.3 pp
TRAFFIC_TARGETS = {"mlp": 300.0, "cnn": 100.0}  # target: dense ÷ gradshare bytes, at least


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="mlp,cnn,tabular", help="comma list of mlp,cnn,tabular (default all)")
    parser.add_argument(
        "--schedules",
        default=None,
        help="comma list of constant,cosine,step (default all; cosine: to 0 over each process's "
        "steps; step: x0.1 at 50%% and 75%% of them)",
    )
    parser.add_argument("--seeds", default=None, help="comma list of seeds (default 0,1,2)")
    parser.add_argument("--workers", default=None, help="comma list of worker counts N >= 2 (default 2,4)")
    parser.add_argument(
        "--systems", default="single,gradshare,ddp", help="comma list of single,gradshare,ddp (default all)"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help=f"epochs for every workload (default {DEFAULT_EPOCHS})"
    )
    parser.add_argument(
        "--aggregate",
        choices=("sum", "mean"),
        default=Compression.aggregate,
        help="gradshare's Compression(aggregate=): replicas add every message (sum, default) "
        "or every message × 1/N (mean)",
    )
    parser.add_argument(
        "--threshold",
        default=TrainConfig.threshold,
        help="gradshare's τ: 'auto' (default: calibrated per worker to a target density) or a "
        "number (the initial τ of the adaptive rule)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="rows per step per worker (default 64)")
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        help=f"seconds of training per configuration before it is stopped and reported as "
        f"failed (default {DEFAULT_BUDGET:g})",
    )
    parser.add_argument("--rows", type=int, default=None, help="keep only this many training/test rows")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['rows']} rows, {QUICK['epochs']} epochs, seed {QUICK['seeds']}, "
        f"N={QUICK['workers']}, {QUICK['schedules']} only (explicit flags win)",
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="where bench-convergence.json/.png go (default docs/, or a temp dir with --quick)",
    )


def _ints(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--{flag} takes a comma list of distinct integers >= {minimum}; got {text!r}")
    return values


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The resolved configuration (validated, every error naming its flag; --quick applied)."""
    quick = bool(args.quick)
    for flag, value in (("epochs", args.epochs), ("batch-size", args.batch_size), ("rows", args.rows)):
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if not args.budget > 0:
        raise ValueError(f"--budget must be > 0 seconds, got {args.budget}")

    def given(value: str | None, full: str, smoke: str) -> str:  # an explicit flag wins over --quick
        return value if value is not None else (smoke if quick else full)

    workloads = comma_list(args.workloads, WORKLOADS, "workloads")
    epochs = {w: args.epochs or (QUICK["epochs"] if quick else DEFAULT_EPOCHS[w]) for w in workloads}
    return {
        "workloads": workloads,
        "schedules": comma_list(
            given(args.schedules, ",".join(LR_SCHEDULES), QUICK["schedules"]), LR_SCHEDULES, "schedules"
        ),
        "seeds": _ints(given(args.seeds, "0,1,2", QUICK["seeds"]), "seeds", 0),
        "workers": sorted(_ints(given(args.workers, "2,4", QUICK["workers"]), "workers", 2)),
        "systems": comma_list(args.systems, SYSTEMS, "systems"),
        "epochs": epochs,
        "threshold": threshold_arg(args.threshold),
        "aggregate": args.aggregate,
        "batch_size": args.batch_size,
        "budget": args.budget,
        "rows": args.rows or (QUICK["rows"] if quick else None),
        "quick": quick,
    }


# ------------------------------------------------------------------------------------------ summary
def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _per_epoch(rows: list[dict[str, Any]], key: str) -> list[float | None]:
    """The mean over `rows` of the per-epoch list `key`, epoch by epoch (None where a row has None)."""
    series = [r[key] for r in rows if r.get(key)]
    out = []
    for e in range(min((len(s) for s in series), default=0)):
        values = [s[e] for s in series]
        out.append(None if None in values else statistics.fmean(values))
    return out


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per workload × schedule × N × system over its seeds (ok rows only): accuracy mean ± std
    per epoch, epochs to target of the mean curve and of every seed, final accuracy mean ± std, bytes per
    worker-step, traffic ratio, seconds; gradshare also τ, sent share and silent-step share per epoch."""
    keys = sorted(
        {(r["workload"], r["schedule"], r["workers"], r["system"]) for r in rows},
        key=lambda k: (k[0], k[1], k[2], SYSTEMS.index(k[3])),
    )
    out = []
    for workload, schedule, workers, system in keys:
        group = [
            r
            for r in rows
            if (r["workload"], r["schedule"], r["workers"], r["system"]) == (workload, schedule, workers, system)
        ]
        ok = [r for r in group if r["status"] == "ok"]
        n_epochs = min((len(r["accuracy"]) for r in ok), default=0)
        curves = [[r["accuracy"][e] for r in ok] for e in range(n_epochs)]
        mean = [statistics.fmean(c) for c in curves]
        target = ok[0]["target"] if ok else None
        final = _mean_std([r["final_accuracy"] for r in ok])
        s = {
            "workload": workload,
            "schedule": schedule,
            "workers": workers,
            "system": system,
            "seeds": [r["seed"] for r in ok],
            "failed": [{"seed": r["seed"], "error": r.get("error")} for r in group if r["status"] != "ok"],
            "target": target,
            "mean": mean,
            "std": [_mean_std(c)[1] for c in curves],
            "epochs_to_target": epochs_to_target(mean, target) if target is not None else None,  # None: no ok seed
            "epochs_to_target_per_seed": [r["epochs_to_target"] for r in ok],
            "final_mean": final[0],
            "final_std": final[1],
            "bytes_per_step": _mean_std([r["bytes_per_step"] for r in ok])[0],
            "traffic_ratio": _mean_std([r["traffic_ratio"] for r in ok if r["traffic_ratio"] is not None])[0],
            "wall_seconds": _mean_std([r["wall_seconds"] for r in ok])[0],
            "elapsed": _mean_std([r["elapsed"] for r in group if "elapsed" in r])[0],
        }
        if system == "gradshare":
            s.update({k: _per_epoch(ok, k) for k in ("tau", "sparsity", "silent_share")})
        out.append(s)
    return out


def _find(
    summary: list[dict[str, Any]], workload: str, schedule: str, workers: int, system: str
) -> dict[str, Any] | None:
    return next(
        (
            s
            for s in summary
            if (s["workload"], s["schedule"], s["workers"], s["system"]) == (workload, schedule, workers, system)
            and s["seeds"]
        ),
        None,
    )


def checks(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The convergence targets for every workload × schedule × N that has gradshare or DDP rows: gradshare's mean
    final accuracy ≥ DDP's − 0.3 pp; its epochs to target (mean curve) ≤ DDP's; traffic ≥ 300× less than
    dense on the MLP, ≥ 100× on the CNN (FitResult.traffic_ratio, mean over seeds). `met` is None where a
    side has no successful seed (not measured)."""
    out = []
    combos = sorted(
        {(s["workload"], s["schedule"], s["workers"]) for s in summary if s["system"] in ("gradshare", "ddp")}
    )
    for workload, schedule, workers in combos:
        gs = _find(summary, workload, schedule, workers, "gradshare")
        dd = _find(summary, workload, schedule, workers, "ddp")
        where = {"workload": workload, "schedule": schedule, "workers": workers}
        both = gs is not None and dd is not None
        diff = 100 * (gs["final_mean"] - dd["final_mean"]) if gs is not None and dd is not None else None
        out.append(
            {
                **where,
                "check": "final acc. gradshare − DDP (pp)",
                "value": diff,
                "limit": -ACCURACY_SLACK_PP,
                "met": None if diff is None else diff >= -ACCURACY_SLACK_PP,
            }
        )
        g_ett, d_ett = (gs or {}).get("epochs_to_target"), (dd or {}).get("epochs_to_target")
        # gradshare never reaching the target misses; DDP never reaching it is beaten by any crossing
        met = None if not both else (g_ett is not None and (d_ett is None or g_ett <= d_ett))
        out.append({**where, "check": "epochs to target: gradshare ≤ DDP", "value": g_ett, "limit": d_ett, "met": met})
        if workload in TRAFFIC_TARGETS:
            ratio, limit = (gs or {}).get("traffic_ratio"), TRAFFIC_TARGETS[workload]
            out.append(
                {
                    **where,
                    "check": "dense ÷ gradshare traffic",
                    "value": ratio,
                    "limit": limit,
                    "met": None if ratio is None else ratio >= limit,
                }
            )
    return out


# ------------------------------------------------------------------------------------------ output
def _pm(mean: float | None, std: float | None, scale: float = 100.0) -> str:
    if mean is None:
        return "—"
    return f"{scale * mean:.2f}" + (f" ± {scale * std:.2f}" if std is not None else "")


def table(summary: list[dict[str, Any]]) -> str:
    head = (
        f"{'workload':<8} {'schedule':<8} {'N':>2} {'system':<9} {'seeds':>5} {'final acc %':>15} "
        f"{'→target':>7} {'per seed':<11} {'bytes/step':>10} {'dense÷this':>10} {'train s':>8} {'elapsed':>8}"
    )
    lines = [head, "-" * len(head)]
    for s in summary:
        per_seed = ",".join("—" if e is None else str(e) for e in s["epochs_to_target_per_seed"])
        failed = f"  failed seeds {[f['seed'] for f in s['failed']]}: {s['failed'][0]['error']}" if s["failed"] else ""
        lines.append(
            f"{s['workload']:<8} {s['schedule']:<8} {s['workers']:>2} {s['system']:<9} {len(s['seeds']):>5} "
            f"{_pm(s['final_mean'], s['final_std']):>15} {fmt(s['epochs_to_target'], 'd'):>7} {per_seed:<11} "
            f"{human_bytes(s['bytes_per_step']):>10} {fmt(s['traffic_ratio'], ',.0f'):>10} "
            f"{fmt(s['wall_seconds'], '.1f'):>8} {fmt(s['elapsed'], '.1f'):>8}{failed}"
        )
    return "\n".join(lines)


def checks_table(found: list[dict[str, Any]]) -> str:
    lines = []
    for c in found:
        met = {True: "met", False: "MISSED", None: "not measured"}[c["met"]]
        value = fmt(c["value"], "d" if isinstance(c["value"], int) else ",.2f")
        limit = fmt(c["limit"], "d" if isinstance(c["limit"], int) else ",.2f")
        lines.append(
            f"  {c['workload']:<8} {c['schedule']:<8} N={c['workers']}  {c['check']:<34} "
            f"{value:>8}  (limit {limit:>6})  {met}"
        )
    return "\n".join(lines)


def plot(path: str, summary: list[dict[str, Any]], title: str = "") -> None:
    """Accuracy per epoch: one panel per workload × schedule, one line (mean) and ±std band per system × N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    workloads = sorted({s["workload"] for s in summary})
    schedules = [x for x in ("constant", "cosine", "step") if any(s["schedule"] == x for s in summary)]
    fig, axes = plt.subplots(
        len(workloads), len(schedules), figsize=(4.2 * len(schedules), 3.2 * len(workloads)), squeeze=False
    )
    colors = {"gradshare": "tab:green", "ddp": "tab:red", "single": "tab:gray"}
    styles = {1: ":", 2: "-", 4: "--"}
    for i, w in enumerate(workloads):
        for j, sch in enumerate(schedules):
            ax = axes[i][j]
            for s in summary:
                if (s["workload"], s["schedule"]) != (w, sch) or not s["mean"]:
                    continue
                epochs = list(range(1, len(s["mean"]) + 1))
                mean = [100 * a for a in s["mean"]]
                label = s["system"] if s["system"] == "single" else f"{s['system']} N={s['workers']}"
                ax.plot(
                    epochs,
                    mean,
                    marker=".",
                    label=label,
                    color=colors[s["system"]],
                    linestyle=styles.get(s["workers"], "-."),
                )
                std = [100 * (d or 0.0) for d in s["std"]]
                ax.fill_between(
                    epochs,
                    [m - d for m, d in zip(mean, std)],
                    [m + d for m, d in zip(mean, std)],
                    color=colors[s["system"]],
                    alpha=0.12,
                    linewidth=0,
                )
            target = next((s["target"] for s in summary if s["workload"] == w and s["target"]), None)
            accuracy_panel(ax, f"{w}, {sch}", "epoch", target, ylabel=j == 0, legend_size=6)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    save_figure(fig, path, title)


NOTES = [
    "final_accuracy: mean test accuracy of the last 3 epochs (report.final_accuracy); epochs_to_target: first "
    "epoch (1-based) whose accuracy (per seed) or mean accuracy over seeds (summary) is >= the target",
    "bytes_per_step: gradshare: UDP bytes sent + received by the workers per worker-step (FitResult, acks and "
    "retransmits included); traffic_ratio = FitResult.traffic_ratio (4 x params x world per worker-step, the "
    "relay layout, / bytes moved); ddp: NOT measured, the dense float32 gradient of one worker per step "
    "(4 x params; ring allreduce moves 2(N-1)/N of it each way), traffic_ratio 1 by definition; single: 0",
    "elapsed: wall seconds of the configuration, start-up included (ddp: its run plus an equal share of its "
    "batch's TorchDistributor start-up, launch_share); wall_seconds: training steps only (rank 0)",
    "gradshare per epoch: tau (mean of the workers' tau at the epoch's last step), sparsity (sent entries / "
    "params), silent_share (steps that sent no entry / steps), lr (rank 0's at the epoch's first step)",
]


def write_json(
    path: str, rows: list[dict[str, Any]], parts: list[dict[str, Any]], *, command: str, config: dict[str, Any]
) -> dict[str, Any]:
    summary = summarise(rows)
    doc = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": command,
        "config": config,
        "notes": NOTES,
        "schedules": {
            "constant": "lr 1e-3",
            "cosine": "1e-3 x 0.5(1 + cos(pi t / T)), T = the process's steps",
            "step": f"1e-3 x {STEP_DECAY_GAMMA} at each of {STEP_DECAY_AT} x T",
        },
        "parts": parts,
        "total_seconds": sum(p["seconds"] for p in parts),
        "summary": summary,
        "checks": checks(summary),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    return doc


def run(args: argparse.Namespace) -> int:
    cfg = settings(args)
    out_dir = args.out_dir or (
        tempfile.mkdtemp(prefix="gradshare-convergence-") if cfg["quick"] else "docs/benchmarks/data"
    )
    json_path = os.path.join(out_dir, "bench-convergence.json")
    png_path = os.path.join(out_dir, "bench-convergence.png")
    command = report.command_line("convergence")
    systems.local_spark_env()
    need_spark = any(s != "single" for s in cfg["systems"])
    spark = systems.local_spark(max(4, *cfg["workers"]), "gradshare-bench-convergence") if need_spark else None
    t0 = time.monotonic()
    try:
        rows, parts = run_configs(
            cfg, spark, on_part=lambda r, p: write_json(json_path, r, p, command=command, config=cfg)
        )
    finally:
        if spark is not None:
            spark.stop()
    doc = write_json(json_path, rows, parts, command=command, config=cfg)
    plot(
        png_path,
        doc["summary"],
        title=f"{doc['date']}, {doc['machine'].get('cpu') or ''} ({doc['machine']['cpus']} cpus)",
    )
    print()
    print(table(doc["summary"]))
    print("\nconvergence targets:")
    print(checks_table(doc["checks"]))
    print(f"\n{len(rows)} configurations in {time.monotonic() - t0:.0f} s; wrote {json_path} and {png_path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1
