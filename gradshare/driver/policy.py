"""What the "auto" options mean at N workers: every default that depends on the worker count, in one
table. The planner (plan.py), which `fit` and the lock-step harness both call, reads it; nothing else
derives a default from N.

    N workers   momentum (β1)  step cap            density decay            warm-up start   forwarding
    2 – 15      ≤ 0.5          0.06 of norm now    off                      min(7 %, 20 %/N) per-rank
    16 – 31     ≤ 0.5          0.06 of norm now    off                      20 %/N          aggregate
    32 +        off (0)        0.10 of initial     2 % → target, lr^0.35    20 %/N          aggregate

Why each column (lock step unless said; docs/benchmarks/scaling.md, lm.md and convergence.md have the
tables):
- momentum: each worker's residual already averages its past updates (error feedback), and Adam's β1
  on top is a second, lagging average. Lowered to 0.5 below 32 workers: Hugging Face Llama / GPT-2 at
  2 and 4 workers moved from 0.2–0.45 nats above the DDP equivalent toward it (with the step cap), the
  scaling workloads gained 0.3–2.5 pp at 4–16 workers, the digits MLP kept its accuracy. Off from 32:
  tabular64k at 64 workers 84.41 → 86.75 %, MNIST-1D MLP at 32 83.26 → 88.87 % (3 seeds).
- step cap (encoding/step_cap.py): each tensor's share of a step's summed messages at most this × its
  norm as the step starts. The summed steps of N workers' optimizers move a tensor up to N times as far
  as one process's; relative to the tensor's own scale that overshoot is what hurts models initialised
  small (Hugging Face's normal(0, 0.02)). Read against the norm the tensor has now (LAMB's trust ratio)
  rather than its initial one, it holds the LMs as before and no longer holds a tensor that has grown
  (docs/benchmarks/scaling.md, "The step cap against the norm a tensor has now"). From 32 workers 0.1 of
  the initial norm, as it was measured there (read against the norm now it cost the MNIST-1D MLP at 32
  1.2–2.8 pp).
- density decay (encoding/threshold.py): from 32 workers a run is too short for an entry to wait ~1/density
  steps in the residual; the density decays from 2 % over the run, the lr lowered meanwhile unless the
  step cap takes its place (plan.rule_for).
- warm-up start: every replica applies all N workers' warm-up messages, so they share one first density.
- forwarding: from 16 workers the relay's one aggregate a step costs less than N·(N−1) forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradshare.encoding.threshold import DEFAULT_DECAY_FROM, DEFAULT_DECAY_LR_POWER, DEFAULT_WARMUP_DENSITY

# the thresholds of the table's rows
AGGREGATE_FROM = 16  # forwarding="auto": the relay aggregates (measured at 10 M params, docs/benchmarks/scale.md)
MANY_WORKERS = 32  # momentum off, the 0.1 step cap and the density decay (the scaling study's large-N rows)

MOMENTUM = 0.5  # the most β1 / momentum each worker steps with below MANY_WORKERS
STEP_CAP = 0.06  # the step cap's share below MANY_WORKERS
MANY_STEP_CAP = 0.1  # and from MANY_WORKERS on
WARMUP_SHARED_DENSITY = 0.2  # the warm-up's first density shared by the N workers (each starts at this ÷ N)


@dataclass(frozen=True)
class Auto:
    """One row of the table: what each "auto" option is at a worker count."""

    momentum: float  # optimizer_momentum="auto": the most β1 / momentum each worker steps with
    step_cap: float  # step_cap="auto": each tensor's share of a step at most this × its norm
    step_cap_norm: str  # which norm: "now" (as the step starts) or "initial" (step_cap.py)
    decay_from: float  # the default τ rule's run-long density decay (0: none)
    decay_lr_power: float  # its lr lowering meanwhile (0 where the step cap takes its place)
    warmup_density: float  # the default warm-up's first density per worker
    forwarding: str  # forwarding="auto": "per-rank" or "aggregate"


def auto_for(world: int) -> Auto:
    """The row of the table for `world` workers."""
    many = world >= MANY_WORKERS
    return Auto(
        momentum=0.0 if many else MOMENTUM,
        step_cap=MANY_STEP_CAP if many else STEP_CAP,
        step_cap_norm="initial" if many else "now",
        decay_from=DEFAULT_DECAY_FROM if many else 0.0,
        decay_lr_power=DEFAULT_DECAY_LR_POWER if many else 0.0,
        warmup_density=min(DEFAULT_WARMUP_DENSITY, WARMUP_SHARED_DENSITY / max(world, 1)),
        forwarding="aggregate" if world >= AGGREGATE_FROM else "per-rank",
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


__all__ = ["AGGREGATE_FROM", "MANY_WORKERS", "WORLDS", "Auto", "auto_for", "table"]
