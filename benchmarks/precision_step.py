"""Step time by precision: a gradshare worker step under "bf16-mixed" / "fp16-mixed" ÷ "32".

    PYTHONPATH=$PWD python benchmarks/precision_step.py [--steps 60] [--widths 1024,768,256,10] [--json out.json]

Calls the core directly: one real `Worker` (world size 1, an in-memory log instead of the transport, so
the network is not in the figure) takes its steps (batch → autocast forward/backward → optimizer step
into the residual → encode → apply) on a ~1 M-parameter MLP. Beside it, the same model trained by plain
torch (no gradshare) under the same autocast: the part of the ratio that is torch's own. Precisions
alternate step-blocks over `--rounds` (the machine is shared), medians over the timed steps. Whether
bf16 is faster on a CPU depends on its bf16 support (oneDNN uses AVX512-BF16/AMX where present).
"""

import argparse
import json
import math
import os
import sys
import time

from step_overhead import make_mlp  # this folder is on sys.path when a benchmark runs as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a worker-step benchmark (device_step.py takes them too)."""
    parser.add_argument("--steps", type=int, default=60, help="timed steps per precision per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each block")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--widths", default="1024,768,256,10", help="MLP layer widths (default ~1 M params)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a worker's task CPUs)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")


def gradshare_worker(precision, widths, batch, total_steps, **options):
    """(step function, n_params, the Worker); `options`: the device and worker_options (device_step.py: device,
    tensor_state)."""
    import numpy as np
    import torch

    from gradshare import encoding
    from gradshare.config.options import Runtime
    from gradshare.task.apply_log import ApplyLog
    from gradshare.task.config import DataPlan, JobIdentity, StepRule, UserCode, WorkerConfig
    from gradshare.task.partition import PartitionData
    from gradshare.task.worker import Worker
    from gradshare.transport.testing.shared_log import LogPeer, SharedLog

    rng = np.random.default_rng(0)
    X = rng.normal(size=(batch * 8, widths[0])).astype(np.float32)
    y = rng.integers(0, widths[-1], size=len(X)).astype(np.int64)
    torch.manual_seed(0)
    device = {"device": options.pop("device")} if "device" in options else {}
    cfg = WorkerConfig(
        job=JobIdentity(("127.0.0.1", 1), bytes(32), 1, 1),
        user=UserCode(
            model=make_mlp(widths),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
            loss=torch.nn.CrossEntropyLoss(),
        ),
        rule=StepRule(encoding.CalibratedThreshold(), encoding.ResidualClipping(clip=5.0)),
        data=DataPlan((8,), math.ceil(total_steps / 8), batch, 0, "int64"),
        runtime=Runtime(precision=precision, **device, worker_options=options or None),
    )
    worker = Worker(cfg, 0, PartitionData(X, y))
    peer = LogPeer(SharedLog(1), 0)  # the transport's part for one rank: its messages come back to it
    worker.log = ApplyLog(peer, worker.flat, 0, 10.0)

    def step(t):
        worker.log.apply_through(t - 1)
        worker.step(peer, t)

    return step, worker.flat.n_params, worker


def torch_loop(precision, widths, batch):
    """The same model and step in plain torch, no gradshare: autocast's own cost or gain."""
    import torch

    from gradshare.replica.precision import Precision

    torch.manual_seed(0)
    model = make_mlp(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    prec = Precision(precision)
    x = torch.randn(batch, widths[0])
    y = torch.randint(0, widths[-1], (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(t):
        opt.zero_grad(set_to_none=True)
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        prec.step(opt)

    return step


def timed(step, first, warmup, steps):
    """(wall, CPU of this thread) seconds of each step after `warmup` untimed ones. With one torch
    thread the CPU time is the step's own work, whatever else the shared machine runs."""
    for t in range(first, first + warmup):
        step(t)
    out = []
    for t in range(first + warmup, first + warmup + steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step(t)
        out.append((time.perf_counter() - t0, time.thread_time() - c0))
    return out


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    per_round = args.warmup + args.steps
    workers, loops, n_params = {}, {}, 0
    for p in PRECISIONS:
        workers[p], n_params, _ = gradshare_worker(p, widths, args.batch_size, per_round * args.rounds)
        loops[p] = torch_loop(p, widths, args.batch_size)
    times = {(kind, p): [] for kind in ("gradshare", "torch") for p in PRECISIONS}
    for r in range(args.rounds):  # alternate, so a load change hits every precision alike
        for p in PRECISIONS:
            times["gradshare", p] += timed(workers[p], r * per_round, args.warmup, args.steps)
            times["torch", p] += timed(loops[p], r * per_round, args.warmup, args.steps)
    keys = [f"{kind}/{p}" for kind in ("gradshare", "torch") for p in PRECISIONS]
    wall = {f"{k}/{p}": 1e3 * float(np.median([w for w, _ in v])) for (k, p), v in times.items()}
    cpu = {f"{k}/{p}": 1e3 * float(np.median([c for _, c in v])) for (k, p), v in times.items()}
    out = {
        "n_params": n_params,
        "widths": widths,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "steps": args.steps * args.rounds,
        "torch": torch.__version__,
        "median_step_ms": wall,
        "median_step_cpu_ms": cpu,
        "ratio_vs_32": {k: wall[k] / wall[k.split("/")[0] + "/32"] for k in keys},
        "cpu_ratio_vs_32": {k: cpu[k] / cpu[k.split("/")[0] + "/32"] for k in keys},
    }
    print(
        f"MLP {args.widths} ({n_params:,} params), batch {args.batch_size}, {args.threads} torch thread(s), "
        f"{args.rounds} rounds x {args.steps} timed steps, torch {torch.__version__}; medians, ratio = ÷ '32'"
    )
    print(f"{'':<12} {'gradshare step (ms)':^34} {'plain torch step (ms)':^34}")
    print(f"{'precision':<12} " + 2 * f"{'wall':>8} {'ratio':>7} {'CPU':>8} {'ratio':>7}  ")
    for p in PRECISIONS:
        cols = ""
        for k in (f"gradshare/{p}", f"torch/{p}"):
            cols += f"{wall[k]:8.2f} {out['ratio_vs_32'][k]:7.3f} {cpu[k]:8.2f} {out['cpu_ratio_vs_32'][k]:7.3f}  "
        print(f"{p:<12} {cols}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
