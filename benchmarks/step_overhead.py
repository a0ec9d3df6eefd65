"""Step overhead on loopback: gradshare step ÷ single-process step, same model, same batch, one run.

    PYTHONPATH=$PWD SPARK_LOCAL_IP=127.0.0.1 python benchmarks/step_overhead.py [--steps 40] [--json out.json]

Both sides use one torch thread per process. The single-process baseline runs in the driver while Spark
is idle; gradshare runs SharedTrainer with 2 workers on an embedded local[2] session (relay on
127.0.0.1) and times each worker's step loop only (Spark start-up and partition materialisation are not
steps). Issue 4's target: ratio <= 1.25. The model defaults to the 8.4 M-parameter MLP of DESIGN.md's
peer comparison (1024-2048-2048-1024-10, batch 64).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="steps per worker (and for the baseline)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--widths", default="1024,2048,2048,1024,10", help="MLP layer widths")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures to this file")


def make_mlp(widths):
    from torch import nn

    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def single_process_step_seconds(widths, batch, steps, seed=0) -> float:
    import numpy as np
    import torch

    from gradshare.trainer import default_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = make_mlp(widths)
    opt = default_optimizer(list(model.parameters()))
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(batch, widths[0])).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, widths[-1], size=batch))
    for _ in range(3):  # warm-up
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from gradshare import SharedTrainer
    from gradshare.spark import get_or_create_session

    widths = [int(w) for w in args.widths.split(",")]
    single = single_process_step_seconds(widths, args.batch_size, args.steps)

    spark, created = get_or_create_session(2)
    try:
        rng = np.random.default_rng(1)
        rows = args.steps * args.batch_size
        data = [(rng.normal(size=widths[0]).astype(np.float32), int(rng.integers(0, widths[-1])))
                for _ in range(2 * rows)]
        rdd = spark.sparkContext.parallelize(data, 2).cache()
        rdd.count()
        trainer = SharedTrainer(lambda: make_mlp(widths), batch_size=args.batch_size, epochs=1,
                                staleness=args.staleness, port=0, bind="127.0.0.1", verbose=0)
        result = trainer.fit(rdd)
    finally:
        if created:
            spark.stop()
    reps = result.worker_reports
    step = float(np.mean([r["train_seconds"] / r["steps_run"] for r in reps]))
    log = float(np.mean([r["log_seconds"] / r["steps_run"] for r in reps]))
    enc = float(np.mean([r["encode_seconds"] / r["steps_run"] for r in reps]))
    out = {
        "n_params": result.n_params, "batch_size": args.batch_size, "steps": args.steps,
        "staleness": args.staleness, "single_step_ms": 1e3 * single, "gradshare_step_ms": 1e3 * step,
        "ratio": step / single, "log_wait_ms": 1e3 * log, "encode_ms": 1e3 * enc,
        "mean_sparsity": float(np.mean([h["sparsity"] for h in result.history])),
        "traffic_ratio": result.traffic_ratio,
    }
    print(f"model: MLP {args.widths} ({result.n_params:,} params), batch {args.batch_size}, "
          f"{args.steps} steps, 2 workers on local[2], 1 torch thread each, staleness {args.staleness}")
    print(f"single-process step   {out['single_step_ms']:8.2f} ms")
    print(f"gradshare step        {out['gradshare_step_ms']:8.2f} ms   (of which: waiting for/applying the log "
          f"{out['log_wait_ms']:.2f} ms, encode {out['encode_ms']:.2f} ms)")
    print(f"ratio                 {out['ratio']:8.3f}   (target <= 1.25)")
    print(f"traffic vs dense      {out['traffic_ratio']:8.1f}x less, mean sparsity {out['mean_sparsity']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))
