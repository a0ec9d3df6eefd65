"""What the step cap costs whoever applies a step (the relay, and every worker from 32 workers on): one
step's N messages applied with the cap against the same messages applied plainly, in the same run.

    PYTHONPATH=$PWD python benchmarks/step_cap.py [--params 10000000] [--world 32] [--density 1e-3] [--repeat 7]

--world 1 is a step of aggregated forwarding (the default from 16 workers): one message a step, the relay's.

The messages are drawn the way a step's are (each rank's entries uniform over the parameters, ±τ), laid out
over the 10.5 M-parameter benchmark MLP's tensor sizes by default. Three ways, each the median of
--repeat applications of the whole step to a float32 state:
- plain: `apply_update` message by message (what a fit without a cap does);
- cap, not binding: the cap's triangle-inequality check settles the step (the usual case);
- cap, binding: every tensor over its bound, so the entries are merged by index (a window of indices at
  a time) and re-scaled.
Prints the ratios to plain and the extra milliseconds per step, and the most the cap holds at once (a
window's codes, whatever the step's size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from gradshare.encoding import Message, StepUpdate, apply_update
from gradshare.encoding.step_cap import WINDOW, StepCap, apply_step

MLP_SIZES = (1024 * 1024, 1024, 2048 * 1024, 2048, 2048 * 2048, 2048, 1024 * 2048, 1024, 10 * 1024, 10)


def sizes_for(n: int) -> list[int]:
    """The benchmark MLP's tensor sizes scaled to about n parameters (the last one takes the rest)."""
    total = sum(MLP_SIZES)
    out = [max(1, round(s * n / total)) for s in MLP_SIZES[:-1]]
    return [*out, max(1, n - sum(out))]


def step_messages(n: int, world: int, density: float, rng: np.random.Generator) -> list[StepUpdate]:
    out = []
    for _ in range(world):
        idx = np.unique(rng.integers(0, n, size=max(1, int(density * n))))
        codes = (idx.astype(np.int64) << 1) | (rng.random(idx.size) < 0.5)
        out.append(StepUpdate(Message.from_codes(codes, float(np.float32(2e-3)), n)))
    return out


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--world", type=int, default=32)
    parser.add_argument("--density", type=float, default=1e-3)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sizes = sizes_for(args.params)
    n = sum(sizes)
    initial = rng.standard_normal(n).astype(np.float32)
    messages = step_messages(n, args.world, args.density, rng)
    state = initial.copy()

    def plain() -> None:
        for u in messages:
            apply_update(u, state)

    loose, tight = StepCap.of(sizes, initial, 1e6), StepCap.of(sizes, initial, 1e-6)
    for cap in (loose, tight):  # check the two regimes are the ones named
        factors = cap.factors(messages, 1.0, state)
        assert (factors < 1).any() == (cap is tight)
    base = timed(plain, args.repeat)
    free = timed(lambda: apply_step(messages, state, 1.0, loose), args.repeat)
    bound = timed(lambda: apply_step(messages, state, 1.0, tight), args.repeat)
    entries = sum(u.message.n_entries for u in messages)
    out = {
        "params": n,
        "world": args.world,
        "density": args.density,
        "entries_per_step": entries,
        "plain_ms": round(1e3 * base, 2),
        "cap_not_binding_ms": round(1e3 * free, 2),
        "cap_binding_ms": round(1e3 * bound, 2),
        "not_binding_ratio": round(free / base, 2),
        "binding_ratio": round(bound / base, 2),
        # a window's codes, copied out of the streams and joined (int64 each, twice) at once
        "binding_extra_mib": round(min(entries, WINDOW) * 16 / 2**20, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
