"""What the "auto" options mean at N workers: every default that depends on the worker count, in one
literal table (`ROWS`). The planner (plan.py), which `fit` and the lock-step harness both call, reads it;
nothing else derives a default from N. docs/guide/defaults.md prints it (`table`); docs/research/defaults.md
has the measurements behind each value.

- momentum: each worker's residual already averages its past updates (error feedback, Strom 2015), and
  Adam's β1 on top is a second, lagging average (replica/momentum.py).
- step cap (encoding/step_cap.py): N workers' summed steps move a tensor up to N times as far as one
  process's; each tensor's share of a step is capped at this × its norm now (LAMB's trust ratio) or, from
  32 workers, × its initial norm.
- density decay (encoding/threshold.py): from 32 workers a run is too short for an entry to wait ~1/density
  steps in the residual; the lr is lowered meanwhile unless the step cap takes its place (plan.rule_for).
- warm-up start: every replica applies all N workers' warm-up messages, so they share one first density
  (a formula in N, not a row: `auto_for`).
- forwarding: from 16 workers the relay's one aggregate a step costs less than N·(N−1) forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradshare.encoding.threshold import DEFAULT_DECAY_FROM, DEFAULT_DECAY_LR_POWER, DEFAULT_WARMUP_DENSITY


@dataclass(frozen=True)
class Row:
    """What each "auto" option is from `workers` workers on, up to the next row's."""

    workers: int
    momentum: float  # optimizer_momentum="auto": the most β1 / momentum each worker steps with
    step_cap: float  # step_cap="auto": each tensor's share of a step at most this × its norm
    step_cap_norm: str  # which norm: "now" (as the step starts) or "initial" (step_cap.py)
    decay_from: float  # the default τ rule's run-long density decay (0: none)
    decay_lr_power: float  # its lr lowering meanwhile (0 where the step cap takes its place)
    forwarding: str  # forwarding="auto": "per-rank" or "aggregate"


AGGREGATE_FROM = 16  # the relay aggregates (measured at 10 M params, docs/benchmarks/scale.md)
MANY_WORKERS = 32  # momentum off, the cap of the initial norm and the density decay (docs/benchmarks/scaling.md)

# fmt: off
ROWS = (
    #   from            momentum  step cap  of         decay from          decay's lr power        forwarding
    Row(1,              0.5,      0.06,     "now",     0.0,                0.0,                    "per-rank"),
    Row(AGGREGATE_FROM, 0.5,      0.06,     "now",     0.0,                0.0,                    "aggregate"),
    Row(MANY_WORKERS,   0.0,      0.1,      "initial", DEFAULT_DECAY_FROM, DEFAULT_DECAY_LR_POWER, "aggregate"),
)
# fmt: on

WARMUP_SHARED_DENSITY = 0.2  # the warm-up's first density shared by the N workers (each starts at this ÷ N)


@dataclass(frozen=True)
class Auto:
    """What each "auto" option is at a worker count: its row of `ROWS` and the warm-up's first density."""

    momentum: float
    step_cap: float
    step_cap_norm: str
    decay_from: float
    decay_lr_power: float
    warmup_density: float  # the default warm-up's first density per worker
    forwarding: str


def auto_for(world: int) -> Auto:
    """The row of the table for `world` workers."""
    row = [r for r in ROWS if r.workers <= max(world, 1)][-1]
    return Auto(
        momentum=row.momentum,
        step_cap=row.step_cap,
        step_cap_norm=row.step_cap_norm,
        decay_from=row.decay_from,
        decay_lr_power=row.decay_lr_power,
        warmup_density=min(DEFAULT_WARMUP_DENSITY, WARMUP_SHARED_DENSITY / max(world, 1)),
        forwarding=row.forwarding,
    )


WORLDS = (1, 2, 4, 8, 16, 32, 64)  # the worker counts docs/guide/defaults.md shows


def table(worlds: tuple[int, ...] = WORLDS) -> str:
    """The table as markdown, one row per worker count: docs/guide/defaults.md holds it as printed here
    (tests/docs checks that it does)."""
    lines = [
        "| workers | momentum (β1) at most | step cap | density decay from | decay's lr power | "
        "warm-up's first density | forwarding |",
        "|---|---|---|---|---|---|---|",
    ]
    for world in worlds:
        row = auto_for(world)
        momentum = "off (0)" if row.momentum == 0 else f"{row.momentum:g}"
        decay = "off" if row.decay_from == 0 else f"{row.decay_from:g}"
        power = "–" if row.decay_from == 0 else f"{row.decay_lr_power:g}"
        cap = f"{row.step_cap:g} × {'norm now' if row.step_cap_norm == 'now' else 'initial norm'}"
        lines.append(
            f"| {world} | {momentum} | {cap} | {decay} | {power} | {row.warmup_density:.4g} | {row.forwarding} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["AGGREGATE_FROM", "MANY_WORKERS", "ROWS", "WORLDS", "Auto", "Row", "auto_for", "table"]
