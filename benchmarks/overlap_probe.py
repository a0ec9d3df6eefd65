"""What overlapping the encode with backward can buy on a CPU: one process, no Spark, no sharing.

    PYTHONPATH=$PWD python benchmarks/overlap_probe.py [--rounds 6] [--steps 25] [--density 2e-3] [--json out.json]

The 8.4 M-parameter MLP of benchmarks/step_overhead.py (1024-2048-2048-1024-10, batch 64, one torch
thread), SGD with momentum stepped per parameter from its gradient hook (the worker's step in backward,
gradshare/replica/capture.py), its parameters aliased to a folded point q that the encode reads against
P (encoding/folded.py), τ at the (1 − density) quantile of q − P. Three orders of the same work,
alternated in rounds so that a busy neighbour hits all three alike:

- after:  backward with the per-parameter steps, then one encode of the whole vector (the worker's order);
- inhook: each parameter's slice encoded in its own hook right after its step, on the same thread
          (what running the encode while the slice is still in cache buys);
- thread: each slice handed to one helper thread as its hook runs (the kernels release the GIL); the
          step waits for the helper at its end (what a free core beside backward buys; DDP's buckets).

Reported per order: the median step (forward, backward, steps and encode) and the part after backward.
Both encode forms give the same codes. The probe measures the room for an overlap; it is not the
worker's code path.
"""

import argparse
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from gradshare.encoding import kernels
from step_overhead import make_mlp  # this folder is on sys.path when a benchmark runs as a script

ORDERS = ("after", "inhook", "thread")


def build(widths: list[int], density: float, seed: int):
    """The model aliased to q, P, τ and the per-parameter slices."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = make_mlp(widths)
    params = list(model.parameters())
    p_flat = np.concatenate([p.detach().numpy().ravel() for p in params]).astype(np.float32)
    q = p_flat + rng.normal(0.0, 1e-3, p_flat.size).astype(np.float32)  # a residual of some spread
    q_t = torch.from_numpy(q)
    slices, offset = [], 0
    for p in params:
        p.data = q_t[offset : offset + p.numel()].view_as(p)
        slices.append((offset, p.numel()))
        offset += p.numel()
    tau = np.float32(np.quantile(np.abs(q - p_flat)[::97], 1.0 - density))
    return model, params, q, p_flat, tau, slices


def probe(rounds: int, steps: int, density: float, widths: list[int], seed: int = 0) -> dict:
    torch.set_num_threads(1)
    model, params, q, p_flat, tau, slices = build(widths, density, seed)
    one = np.float32(1.0)
    x, y = torch.randn(64, widths[0]), torch.randint(0, widths[-1], (64,))
    loss_fn = nn.CrossEntropyLoss()
    optimizers = [torch.optim.SGD([p], lr=0.01, momentum=0.9) for p in params]
    helper = ThreadPoolExecutor(1)
    pending: list[Future] = []
    order = ["after"]
    entries = [0]

    def hook_for(i: int):
        start, n = slices[i]

        def hook(p: torch.Tensor) -> None:
            optimizers[i].step()
            p.grad = None
            if order[0] == "inhook":
                entries[0] += kernels.folded_encode_codes(
                    q[start : start + n], p_flat[start : start + n], one, tau, tau
                ).size
            elif order[0] == "thread":
                pending.append(
                    helper.submit(
                        kernels.folded_encode_codes, q[start : start + n], p_flat[start : start + n], one, tau, tau
                    )
                )

        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook_for(i))
    step_s: dict[str, list[float]] = {o: [] for o in ORDERS}
    tail_s: dict[str, list[float]] = {o: [] for o in ORDERS}
    counts: dict[str, list[int]] = {o: [] for o in ORDERS}
    warmup = 5
    for _ in range(rounds):
        for o in ORDERS:
            order[0] = o
            for i in range(warmup + steps):
                entries[0] = 0
                t0 = time.perf_counter()
                loss_fn(model(x), y).backward()
                t1 = time.perf_counter()
                if o == "after":
                    entries[0] = kernels.folded_encode_codes(q, p_flat, one, tau, tau).size
                elif o == "thread":
                    entries[0] = sum(f.result().size for f in pending)
                    pending.clear()
                t2 = time.perf_counter()
                if i >= warmup:
                    step_s[o].append(t2 - t0)
                    tail_s[o].append(t2 - t1)
                    counts[o].append(entries[0])
    helper.shutdown()
    out = {
        o: {
            "step_ms": 1e3 * float(np.median(step_s[o])),
            "after_backward_ms": 1e3 * float(np.median(tail_s[o])),
            "entries": float(np.mean(counts[o])),
        }
        for o in ORDERS
    }
    encode = out["after"]["after_backward_ms"]
    for o in ORDERS:
        out[o]["hidden_ms"] = out["after"]["step_ms"] - out[o]["step_ms"]
        out[o]["hidden_share"] = out[o]["hidden_ms"] / encode if encode > 0 else 0.0
    return {"n_params": int(q.size), "tau": float(tau), "rounds": rounds, "steps": steps, "orders": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=25, help="timed steps per order and round")
    parser.add_argument("--density", type=float, default=2e-3)
    parser.add_argument("--widths", default="1024,2048,2048,1024,10")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = probe(args.rounds, args.steps, args.density, [int(w) for w in args.widths.split(",")])
    print(f"MLP {args.widths} ({result['n_params']:,} params), one torch thread, τ {result['tau']:.2e}")
    for o, row in result["orders"].items():
        print(
            f"{o:7s} step {row['step_ms']:6.2f} ms   after backward {row['after_backward_ms']:5.2f} ms   "
            f"hidden {row['hidden_ms']:+5.2f} ms ({100 * row['hidden_share']:+.0f} % of the encode)   "
            f"entries {row['entries']:.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
