"""Step time of the device code path: a gradshare worker step on the torch tensor state ÷ the
same step on the NumPy state with the Numba kernels (the CPU default), measured side by side.

    PYTHONPATH=$PWD python benchmarks/device_step.py [--device cpu|cuda|auto] [--steps 60] [--json out.json]

Calls the core directly, as precision_step.py does: one real `Worker` per path (world size 1, an
in-memory log instead of the transport) takes whole steps (batch → forward/backward → optimizer step
into the residual → encode → apply) on a ~1 M-parameter MLP. The torch path runs on ``--device``; on
"cpu" it is `worker_options={"tensor_state": True}`, the GPU code path without a GPU, and slower than
Numba by design (it exists for tests). The two paths alternate step-blocks over `--rounds` (the machine is
shared); medians over the timed steps. After the same steps both replicas must hold the same bits (on
a CPU; a GPU's forward/backward kernels differ from the CPU's, so there the check is skipped and said so).
"""

import argparse
import json
import os
import sys

# this folder is on sys.path when a benchmark runs as a script
from precision_step import add_arguments as step_arguments
from precision_step import gradshare_worker, timed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="where the torch path runs: cpu, cuda, cuda:N, auto")
    step_arguments(parser)  # --steps --warmup --rounds --batch-size --widths --threads --json


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from gradshare.transport import param_hash

    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    per_round = args.warmup + args.steps
    total = per_round * args.rounds
    paths = {
        "numba": gradshare_worker("32", widths, args.batch_size, total, device="cpu"),
        "torch": gradshare_worker("32", widths, args.batch_size, total, device=args.device, tensor_state=True),
    }
    device = str(paths["torch"][2].flat.buffer.device)
    times = {name: [] for name in paths}
    for r in range(args.rounds):  # alternate, so a load change hits both paths alike
        for name, (step, _, _) in paths.items():
            times[name] += timed(step, r * per_round, args.warmup, args.steps)
    wall = {k: 1e3 * float(np.median([w for w, _ in v])) for k, v in times.items()}
    cpu = {k: 1e3 * float(np.median([c for _, c in v])) for k, v in times.items()}
    hashes = {k: param_hash(w.flat.host_state()) for k, (_, _, w) in paths.items()}
    same = hashes["numba"] == hashes["torch"] if device == "cpu" else None
    out = {
        "n_params": paths["numba"][1],
        "widths": widths,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "steps": args.steps * args.rounds,
        "device": device,
        "torch": torch.__version__,
        "median_step_ms": wall,
        "median_step_cpu_ms": cpu,
        "wall_ratio_torch_over_numba": wall["torch"] / wall["numba"],
        "cpu_ratio_torch_over_numba": cpu["torch"] / cpu["numba"],
        "bit_identical": same,
    }
    print(
        f"MLP {args.widths} ({out['n_params']:,} params), batch {args.batch_size}, {args.threads} torch "
        f"thread(s), {args.rounds} rounds x {args.steps} timed steps, torch {torch.__version__}; medians"
    )
    print(f"{'path':<22} {'wall ms':>9} {'CPU ms':>9}")
    print(f"{'numba (NumPy state)':<22} {wall['numba']:9.2f} {cpu['numba']:9.2f}")
    print(f"{'torch on ' + device:<22} {wall['torch']:9.2f} {cpu['torch']:9.2f}")
    print(
        f"torch ÷ numba: wall {out['wall_ratio_torch_over_numba']:.3f}, CPU {out['cpu_ratio_torch_over_numba']:.3f}; "
        + (
            "replicas bit-identical"
            if same
            else "REPLICAS DIFFER"
            if same is False
            else f"no bit check on {device} (its kernels are not the CPU's)"
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if same is not False else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
