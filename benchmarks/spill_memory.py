"""Data larger than memory: a worker's peak RSS with a partition of N x spill_bytes,
streamed from its spill file, vs the same partition held in memory, measured side by side in one run.

    PYTHONPATH=$PWD SPARK_LOCAL_IP=127.0.0.1 python benchmarks/spill_memory.py [--spill-mib 1]
        [--times 10,40] [--width 1024] [--epochs 2] [--json out.json]

Two measurements:
- data: in a fresh `python` process per point (VmHWM is per process), materialise a partition of
  N x spill_bytes from a row generator and read `epochs` epochs of batches of 64 (`Worker._batch`'s
  reads without torch), for spill_bytes = the budget (spilled) and a limit above the partition (in
  memory). Growth = VmHWM - RSS before the rows; ms/batch = the epochs' batch reads.
- spark: SharedTrainer fits on a local[2] session, rank 1 with the N x spill_bytes partition (the first
  of --times), rank 0 with 64 rows, once spilled and once in memory. Every task runs in a fresh Python
  worker whose peak holds gradshare's imports alike on both ranks, so rank 1's peak growth minus rank
  0's is what the partition adds.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def rows_of(index, rows, width):
    import numpy as np

    rng = np.random.default_rng(index)
    for _ in range(rows):
        x = rng.standard_normal(width, dtype=np.float32)
        yield x, int(np.argmax(x[:4]))


def child_data(spill_bytes, rows, width, epochs):
    import tempfile

    import numpy as np

    import gradshare.task.train  # noqa: F401 - the task body's modules, loaded before its baseline as in a task
    from gradshare.task.memory import proc_status_bytes, reset_peak_rss
    from gradshare.task.partition import PartitionData, epoch_order

    start = reset_peak_rss()
    data = PartitionData.from_rows(
        rows_of(1, rows, width), "int64", spill_bytes=spill_bytes, spill_dir=tempfile.gettempdir()
    )
    batches = -(-rows // 64)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        for b in range(batches):
            if data.spilled:
                data.batch(epoch, b, 64, seed=0, rank=1)
            else:  # what Worker._batch does with an in-memory partition
                if b == 0:
                    order = epoch_order(rows, 0, 1, epoch)
                idx = np.sort(order[b * 64 : (b + 1) * 64])
                _ = [np.ascontiguousarray(a[idx]) for a in data.inputs], data.labels[idx]
    ms = (time.perf_counter() - t0) * 1e3 / (epochs * batches)
    out = {"spilled": data.spilled, "growth": proc_status_bytes("VmHWM") - start, "ms_per_batch": ms}
    data.close()
    return out


def run_data(spill_bytes, rows, width, epochs, in_memory):
    limit = 1 << 40 if in_memory else spill_bytes
    cmd = [sys.executable, __file__, "--child", json.dumps([limit, rows, width, epochs])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.splitlines()[-1])


def run_spark(spill_bytes, rows, width, epochs):
    import torch
    from torch import nn

    from gradshare import SharedTrainer
    from gradshare.config.options import Network
    from gradshare.driver.session import session_builder

    spark = session_builder("local[2]").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    results = {}
    try:
        rdd = spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(
            lambda i, _: rows_of(i, rows if i == 1 else 64, width)
        )
        for name, limit in (("spilled", spill_bytes), ("in memory", 1 << 40)):
            r = SharedTrainer(
                lambda: nn.Linear(width, 4),
                batch_size=64,
                epochs=epochs,
                seed=0,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                port=0,
                verbose=0,
                network=Network(spill_bytes=limit, bind="127.0.0.1"),
            ).fit(rdd)
            small, large = sorted(r.worker_reports, key=lambda w: w["rank"])
            growth = [w["peak_rss_bytes"] - w["start_rss_bytes"] for w in (small, large)]
            results[name] = {
                "spilled": large["spilled"],
                "rank0_growth": growth[0],
                "rank1_growth": growth[1],
                "added": growth[1] - growth[0],
                "rank1_train_seconds": large["train_seconds"],
                "final_loss": r.history[-1]["loss"],
            }
    finally:
        spark.stop()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spill-mib", type=float, default=1.0, help="spill_bytes in MiB")
    parser.add_argument("--times", default="10,40", help="partition sizes as multiples of spill_bytes")
    parser.add_argument("--width", type=int, default=1024, help="float32 features per row")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child_data(*json.loads(args.child))), flush=True)
        return
    spill_bytes = int(args.spill_mib * MIB)
    record = 4 * args.width + 8
    out = {"spill_bytes": spill_bytes, "width": args.width, "data": [], "spark": None}
    print(f"spill_bytes {spill_bytes / MIB:g} MiB, rows of {args.width} float32 + an int64 label\n")
    print(f"{'partition':>12}{'':12}{'peak growth':>14}{'ms/batch':>10}")
    for times in (float(t) for t in args.times.split(",")):
        rows = int(times * spill_bytes / record)
        for in_memory in (False, True):
            r = run_data(spill_bytes, rows, args.width, args.epochs, in_memory)
            out["data"].append(dict(r, times=times, rows=rows))
            label = "in memory" if not r["spilled"] else "spilled"
            print(f"{rows * record / MIB:>9.1f} MiB{label:>12}{r['growth'] / MIB:>10.1f} MiB{r['ms_per_batch']:>10.3f}")
    times = float(args.times.split(",")[0])
    rows = int(times * spill_bytes / record)
    print(f"\nSharedTrainer, rank 1 with {rows * record / MIB:.1f} MiB, rank 0 with 64 rows, {args.epochs} epochs")
    out["spark"] = run_spark(spill_bytes, rows, args.width, args.epochs)
    for name, r in out["spark"].items():
        print(
            f"{name:>10}: rank 1 peak growth {r['rank1_growth'] / MIB:.1f} MiB, rank 0 {r['rank0_growth'] / MIB:.1f} "
            f"MiB, the partition adds {r['added'] / MIB:.1f} MiB; rank 1 trained {r['rank1_train_seconds']:.2f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
