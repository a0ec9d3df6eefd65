"""A real SharedTrainer fit on Spark beside the lock-step run of the same configuration.

`benchmarks/scaling.py` measures in lock step (lab/lockstep.py: the real Worker, ApplyLog
and codec, one process). This script checks that a fit on Spark learns the same: the same workload,
shards, seed, batch order, τ rule, staleness 0 and Adam lr, once through `SharedTrainer` on a Spark master
(local[N], or local-cluster[N,1,1024] for separate executor JVMs) and once in lock step; it prints the two
accuracy curves and whether the final parameters are the same bits.

    python benchmarks/spark_vs_lockstep.py --workload tabular64k --workers 4 --master "local-cluster[4,1,1024]"
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tabular64k")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--master", default=None, help="Spark master (default local[N])")
    parser.add_argument("--epochs", type=int, default=None, help="default: the workload's recipe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--step-cap", default="auto", help="SharedTrainer's step_cap: auto, none or a share")
    parser.add_argument(
        "--momentum", default="auto", help="SharedTrainer's optimizer_momentum: auto, off, keep or a number"
    )
    args = parser.parse_args()

    from gradshare.driver.session import session_builder
    from lab import systems
    from lab.lockstep import run
    from lab.workloads import RECIPES, load

    recipe = RECIPES[args.workload]
    epochs, batch, n = args.epochs or recipe.epochs, recipe.batch_for(args.workers), args.workers
    named = {"auto": "auto", "none": None}
    step_cap = named[args.step_cap.lower()] if args.step_cap.lower() in named else float(args.step_cap)
    momentum = args.momentum if args.momentum in ("auto", "off", "keep") else float(args.momentum)
    wl = load(args.workload, args.seed, None, args.rows)
    t0 = time.monotonic()
    lock = run(
        workload=args.workload,
        world=n,
        epochs=epochs,
        seed=args.seed,
        lr=recipe.lr,
        batch=batch,
        data=wl,
        step_cap=step_cap,
        momentum=momentum,
    )
    lock_seconds = time.monotonic() - t0

    systems.local_spark_env()
    spark = session_builder(args.master or f"local[{n}]", app_name="gradshare-spark-vs-lockstep").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        t0 = time.monotonic()
        fit = systems.run_gradshare(
            spark,
            wl,
            epochs=epochs,
            batch_size=batch,
            seed=args.seed,
            budget=3600.0,
            lr=recipe.lr,
            workers=n,
            staleness=0,
            timeout=600.0,
            step_cap=step_cap,
            optimizer_momentum=momentum,
        )
        spark_seconds = time.monotonic() - t0
    finally:
        spark.stop()
    spark_acc = [round(100 * a, 2) for _, a in fit.curve]
    print(
        json.dumps(
            {
                "workload": args.workload,
                "workers": n,
                "master": args.master or f"local[{n}]",
                "epochs": epochs,
                "batch": batch,
                "lr": recipe.lr,
                "seed": args.seed,
                "step_cap": step_cap,
                "momentum": momentum,
                "lockstep": {
                    "acc": lock["acc"],
                    "final3": lock["final3"],
                    "ratio": lock["ratio"],
                    "seconds": round(lock_seconds),
                },
                "spark": {
                    "acc": spark_acc,
                    "final3": round(float(np.mean(spark_acc[-3:])), 2),
                    "ratio": round(fit.extra["traffic_ratio"]),
                    "seconds": round(spark_seconds),
                    "param_hash": fit.extra["param_hash"],
                },
                "same_curve": spark_acc == lock["acc"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
