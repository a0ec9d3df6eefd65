"""Results of `python benchmarks/train.py`: one row per (workload, link, system), the target checks,
a terminal table, a JSON file and a PNG plot (accuracy vs training wall-clock)."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from typing import TYPE_CHECKING, Any

from lab.profile import summarise

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from lab.systems import Measured

Row = dict[str, Any]  # one result row, as the JSON report holds it

WARMUP_STEPS = 3  # steps left out of s/step: JIT compilation, allocator and socket warm-up
# "Final accuracy" is the mean test accuracy of the last FINAL_EVALS per-epoch evaluations. One
# evaluation is too noisy to compare systems by: with Adam at a constant lr 1e-3 the single process's
# test accuracy on the 450 MLP test rows swings by 2-13 pp from one epoch to the next after it has
# converged (e.g. 95.1, 97.3, 94.7, 95.6, 95.1, 92.2 in epochs 11-16 of one run, 95.6, 84.9, 96.4 in another; after 16
# epochs its last-epoch accuracy over seeds 0-4 has a standard deviation of 3.1 pp, the mean of the last 3 one of
# 1.3 pp), while a 0.5 pp target is 2 test rows. The last evaluation alone is kept as `last_accuracy`.
FINAL_EVALS = 3


def final_accuracy(curve: list[tuple[float, float]], evals: int = FINAL_EVALS) -> float | None:
    """Mean accuracy of the last `evals` points of `curve` (all of them if there are fewer); None if empty."""
    if evals < 1:
        raise ValueError(f"evals must be >= 1, got {evals}")
    tail = [a for _, a in curve[-evals:]]
    return sum(tail) / len(tail) if tail else None


def row(system: str, workload: str, link: str, measured: Measured, target: float) -> Row:
    """One result row from a `systems.Measured`."""
    walls = list(measured.walls)
    skip = min(WARMUP_STEPS, max(len(walls) - 1, 0))
    steady = walls[skip:]
    curve = [(float(t), float(a)) for t, a in measured.curve if a is not None]
    steps = len(walls)
    r = {
        "system": system,
        "workload": workload,
        "link": link,
        "status": "ok",
        "n_params": int(measured.n_params),
        "steps": steps,
        "sec_per_step": sum(steady) / len(steady) if steady else None,
        "lo_bytes_per_step": measured.lo_bytes / steps if measured.lo_bytes is not None and steps else None,
        "time_to_target": next((t for t, a in curve if a >= target), None),
        "target": target,
        "final_accuracy": final_accuracy(curve),
        "last_accuracy": curve[-1][1] if curve else None,
        "train_seconds": sum(walls),
        "stopped_by_budget": bool(measured.stopped_by_budget),
        "curve": curve,
    }
    extra = dict(measured.extra)
    steps_profile = extra.pop("profile_steps", None)
    if steps_profile is not None:
        r["profile"] = summarise(steps_profile, WARMUP_STEPS)
    if "relay_bytes" in extra and steps:
        r["relay_bytes_per_step"] = extra["relay_bytes"] / steps
    r.update(extra)
    return r


def failed_row(system: str, workload: str, link: str, error: BaseException | str) -> dict[str, Any]:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {
        "system": system,
        "workload": workload,
        "link": link,
        "status": "error",
        "error": text.strip().splitlines()[0][:300] if text.strip() else "error",
        "curve": [],
    }


def _find(rows: list[Row], system: str, workload: str, link: str) -> Row | None:
    for r in rows:
        if (r["system"], r["workload"], r["link"]) == (system, workload, link) and r["status"] == "ok":
            return r
    return None


def _baseline_single(rows: list[Row], workload: str) -> Row | None:
    """The single-process row (run once, unshaped: it sends nothing)."""
    return next(
        (r for r in rows if r["system"] == "single" and r["workload"] == workload and r["status"] == "ok"), None
    )


def _ratio(a: Any, b: Any) -> float | None:  # numbers from result rows (JSON), or None
    return a / b if a is not None and b not in (None, 0) else None


def targets(rows: list[dict[str, Any]], workload: str = "mlp") -> list[dict[str, Any]]:
    """The step-time, traffic and time-to-accuracy targets for `workload`: each with the measured value,
    the limit and pass/miss."""
    out = []
    single = _baseline_single(rows, workload)

    def add(name: str, value: float | None, limit: float, ok: Callable[[float, float], bool]) -> None:
        out.append(
            {"target": name, "value": value, "limit": limit, "met": None if value is None else bool(ok(value, limit))}
        )

    gs1, dd1 = _find(rows, "gradshare", workload, "1gbit"), _find(rows, "ddp", workload, "1gbit")
    gs100, dd100 = _find(rows, "gradshare", workload, "100mbit"), _find(rows, "ddp", workload, "100mbit")
    le = lambda v, lim: v <= lim  # noqa: E731
    # ≤ 1.15 (was 1.25): a step should cost about what one process's step costs (work hidden behind compute)
    add(
        "1gbit: gradshare s/step ÷ single s/step",
        _ratio(gs1 and gs1["sec_per_step"], single and single["sec_per_step"]),
        1.15,
        le,
    )
    add(
        "1gbit: gradshare s/step ÷ DDP dense s/step",
        _ratio(gs1 and gs1["sec_per_step"], dd1 and dd1["sec_per_step"]),
        0.25,
        le,
    )
    add(
        "100mbit: gradshare s/step ÷ DDP dense s/step",
        _ratio(gs100 and gs100["sec_per_step"], dd100 and dd100["sec_per_step"]),
        0.05,
        le,
    )
    for link in ("1gbit", "100mbit", "unshaped"):
        for peer, label in (("powersgd", "DDP+PowerSGD"), ("ddp", "DDP dense")):  # time to target: ahead of both
            gs, ps = _find(rows, "gradshare", workload, link), _find(rows, peer, workload, link)
            if gs and ps:
                g, p = gs["time_to_target"], ps["time_to_target"]
                value = None if g is None else (g / p if p else 0.0)  # 0.0: the peer never reached it
                add(f"{link}: gradshare time-to-target ÷ {label}", value, 1.0, lambda v, lim: v < lim)
    gs1 = _find(rows, "gradshare", workload, "1gbit")
    if single and gs1 and single["time_to_target"]:
        # at most 0.7 of the single process's time (was 0.5): two workers on this benchmark's 2-core VM
        # cannot go below ~0.51 even with no warm-up cost at all (docs/benchmarks/train.md)
        g = gs1["time_to_target"]
        add("1gbit: gradshare time-to-target ÷ single", None if g is None else g / single["time_to_target"], 0.7, le)
    if single:
        for link in ("1gbit", "unshaped"):
            gs = _find(rows, "gradshare", workload, link)
            if gs and gs["final_accuracy"] is not None:
                diff = 100 * (single["final_accuracy"] - gs["final_accuracy"])
                add(f"{link}: single − gradshare final acc. (pp, last {FINAL_EVALS})", diff, 0.5, le)
    for link in ("1gbit", "unshaped", "100mbit"):
        gs, dd = _find(rows, "gradshare", workload, link), _find(rows, "ddp", workload, link)
        if gs and dd:
            add(
                f"{link}: DDP dense ÷ gradshare bytes/step (lo)",
                _ratio(dd["lo_bytes_per_step"], gs["lo_bytes_per_step"]),
                300,
                lambda v, lim: v >= lim,
            )
    return out


def fmt(v: Any, spec: str, unit: str = "") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{unit}"


def human_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.1f} {unit}"
    return f"{b:.0f} B"


def table(rows: list[dict[str, Any]]) -> str:
    """The terminal table: per workload and link, each system with ratios to single and DDP dense.

    "final acc" is the mean of the last FINAL_EVALS epochs' test accuracy, "last acc" the last one."""
    lines = []
    head = (
        f"{'workload':<8} {'link':<9} {'system':<10} {'steps':>5} {'s/step':>8} {'×single':>8} {'×DDP':>7} "
        f"{'bytes/step':>11} {'dense÷this':>10} {'t→target':>9} {'final acc':>9} {'last acc':>8}  note"
    )
    lines += [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['workload']:<8} {r['link']:<9} {r['system']:<10} {'':>5} {'failed':>8}  {r['error']}")
            continue
        single = _baseline_single(rows, r["workload"])
        ddp = _find(rows, "ddp", r["workload"], r["link"])
        note = "budget reached" if r["stopped_by_budget"] else ""
        lines.append(
            f"{r['workload']:<8} {r['link']:<9} {r['system']:<10} {r['steps']:>5} "
            f"{fmt(r['sec_per_step'], '.3f'):>8} "
            f"{fmt(_ratio(r['sec_per_step'], single and single['sec_per_step']), '.2f'):>8} "
            f"{fmt(_ratio(r['sec_per_step'], ddp and ddp['sec_per_step']), '.3f'):>7} "
            f"{human_bytes(r['lo_bytes_per_step']):>11} "
            f"{fmt(_ratio(ddp and ddp['lo_bytes_per_step'], r['lo_bytes_per_step']), ',.0f'):>10} "
            f"{fmt(r['time_to_target'], '.1f', ' s'):>9} "
            f"{fmt(r['final_accuracy'] and 100 * r['final_accuracy'], '.2f', '%'):>9} "
            f"{fmt(r.get('last_accuracy') and 100 * r['last_accuracy'], '.2f', '%'):>8}  {note}"
        )
    for r in rows:
        if r.get("profile"):
            p = r["profile"]
            share = "  ".join(f"{k} {1000 * p[k]:.1f}" for k in ("compute", "encode", "send", "wait", "apply", "other"))
            lines.append(
                f"profile gradshare {r['workload']}/{r['link']} (ms/step, wall {1000 * p['wall']:.1f}): {share}"
            )
            if p.get("detail"):
                lines.append("  of which: " + "  ".join(f"{k} {1000 * v:.1f}" for k, v in p["detail"].items()))
    return "\n".join(lines)


def targets_table(checks: list[dict[str, Any]]) -> str:
    lines = []
    for c in checks:
        met = {True: "met", False: "MISSED", None: "not measured"}[c["met"]]
        lines.append(f"  {c['target']:<52} {fmt(c['value'], '.3f'):>10}  (limit {c['limit']})  {met}")
    return "\n".join(lines)


def command_line(subcommand: str) -> str:
    """How this process was started: `python benchmarks/<subcommand>.py ...` when through its script, else argv."""
    if os.path.basename(sys.argv[0]) == f"{subcommand}.py":
        return f"python benchmarks/{subcommand}.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return " ".join(shlex.quote(a) for a in sys.argv)


def machine() -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }  # the machine may be shared: say how busy it was
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    for package in ("torch", "pyspark"):  # their versions, without importing them
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return info


def write_json(
    path: str, rows: list[dict[str, Any]], *, command: str, config: dict[str, Any], notes: list[str]
) -> dict[str, Any]:
    doc = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": command,
        "config": config,
        "notes": notes,
        "bytes_source": "lo transmit counter (/proc/net/dev) inside the benchmark's network namespace, "
        "over the timed steps, all processes; relay_bytes_per_step: the relay's own counters",
        "results": rows,
        "targets": {w: targets(rows, w) for w in sorted({r["workload"] for r in rows})},
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    return doc


def plot(path: str, rows: list[dict[str, Any]], title: str = "") -> None:
    """Accuracy vs training wall-clock: one panel per (workload, link), one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    links = [link for link in ("unshaped", "1gbit", "100mbit") if any(r["link"] == link for r in rows)]
    fig, axes = plt.subplots(
        len(workloads), len(links), figsize=(4 * len(links), 3 * len(workloads)), squeeze=False, sharey=True
    )
    colors = {"gradshare": "tab:green", "ddp": "tab:red", "powersgd": "tab:orange", "single": "tab:gray"}
    for i, w in enumerate(workloads):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for r in rows:
                if r["workload"] != w or not r["curve"]:
                    continue
                if r["link"] == link or (r["system"] == "single" and r["link"] == "unshaped"):
                    t, a = zip(*r["curve"])
                    ax.plot(
                        t,
                        [100 * v for v in a],
                        marker=".",
                        label=r["system"],
                        color=colors.get(r["system"]),
                        linestyle="--" if r["system"] == "single" else "-",
                    )
            target = next((r["target"] for r in rows if r["workload"] == w and "target" in r), None)
            accuracy_panel(ax, f"{w}, {link}", "training wall-clock (s)", target, ylabel=j == 0)
    save_figure(fig, path, title)


def accuracy_panel(
    ax: Axes, title: str, xlabel: str, target: float | None, *, ylabel: bool, legend_size: int = 7
) -> None:
    """Labels, the target line and the legend of one test-accuracy panel (the train and convergence studies)."""
    if target:
        ax.axhline(100 * target, color="black", linewidth=0.5, linestyle=":")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    if ylabel:
        ax.set_ylabel("test accuracy (%)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=legend_size)


def save_figure(fig: Figure, path: str, title: str = "") -> None:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
