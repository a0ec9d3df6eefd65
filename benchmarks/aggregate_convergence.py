"""What aggregated forwarding does to convergence: the digits MLP trained with N workers
under forwarding="per-rank" and "aggregate", side by side in one run, per-epoch validation accuracy and
loss, plus the relay's egress per step.

    python benchmarks/aggregate_convergence.py --workers 4,8 --epochs 8 --json out.json

(docs/benchmarks/data/bench-aggregate-convergence.json is that run's output.)

Runs its own local[max N] Spark session (the machine's cores are oversubscribed at N = 8: correctness,
accuracy and traffic are measured, not time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gradshare.config.options import Network


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="4,8", help="comma list of worker counts")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    workers = [int(x) for x in args.workers.split(",")]
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

    from gradshare import SharedTrainer
    from gradshare.demo import digits_split, evaluate_accuracy, mlp
    from gradshare.driver.session import session_builder

    spark = session_builder(f"local[{max(workers)}]", app_name="aggregate-convergence").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    X_train, X_test, y_train, y_test = digits_split(args.seed)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    runs = []
    try:
        for n in workers:
            rdd = spark.sparkContext.parallelize(rows, n).cache()
            for forwarding in ("per-rank", "aggregate"):
                r = SharedTrainer(
                    mlp,
                    batch_size=args.batch_size,
                    epochs=args.epochs,
                    seed=args.seed,
                    validation_data=(X_test, y_test),
                    port=0,
                    verbose=0,
                    network=Network(forwarding=forwarding, bind="127.0.0.1"),
                ).fit(rdd)
                row = {
                    "workers": n,
                    "forwarding": forwarding,
                    "steps": r.steps,
                    "val_accuracy": [h["val_metric"] for h in r.history],
                    "loss": [h["loss"] for h in r.history],
                    "final_accuracy": evaluate_accuracy(r.model, X_test, y_test),
                    "relay_bytes_out_per_step": r.counters["bytes_out"] / r.steps,
                    "aggregates": r.counters.get("aggregates", 0),
                    "param_hash": r.param_hash,
                }
                runs.append(row)
                print(
                    f"N={n} {forwarding:>9}: val acc per epoch "
                    + " ".join(f"{a:.3f}" for a in row["val_accuracy"])
                    + f" | relay egress {row['relay_bytes_out_per_step'] / 1e3:.1f} kB/step",
                    flush=True,
                )
            rdd.unpersist()
    finally:
        spark.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "workload": "digits MLP (gradshare.demo.mlp)",
                    "epochs": args.epochs,
                    "batch_size": args.batch_size,
                    "seed": args.seed,
                    "runs": runs,
                },
                f,
                indent=2,
            )
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
