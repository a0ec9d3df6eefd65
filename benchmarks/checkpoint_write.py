"""Checkpoint write time and size (the checkpoint target) for the 10.5 M-parameter benchmark MLP
(1024-2048-2048-2048-10, lab/workloads.py), with Adam (the default optimizer).

    PYTHONPATH=$PWD SPARK_LOCAL_IP=127.0.0.1 python benchmarks/checkpoint_write.py [--epochs 2]
        [--steps 4] [--json out.json]

One local[2] session, 2 workers, random rows (batch 64, `--steps` steps per epoch per worker). After a
1-epoch warm-up fit, the same fit runs twice side by side: without checkpoints, then with a checkpoint
after every epoch. Reported: the checkpoint's size on disk (and as a multiple of the parameter bytes:
params + each worker's residual and two Adam moments ≈ 1 + 3 × workers), each rank's seconds spent
writing (worker reports' checkpoint_seconds; rank 0's include waiting for the other rank's files and
writing the manifest), and the fit's wall time with and without, as a ratio.

--hadoop adds a third fit whose checkpoint_dir is a Hadoop-FS URI (viewfs://, a Hadoop mount of a local
temp directory): the workers stream their files to the driver's checkpoint service, which writes them
through Spark's FileSystem API; its per-rank write times are reported beside the direct path's.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

from gradshare.config.options import FaultTolerance, Network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json")
    parser.add_argument("--hadoop", action="store_true", help="also checkpoint through a viewfs:// URI")
    args = parser.parse_args()

    import numpy as np

    from gradshare import SharedTrainer
    from lab.systems import local_spark_env
    from lab.workloads import mlp

    local_spark_env()  # this interpreter and the lab on the executors too: Spark pickles `mlp` by reference
    from gradshare.driver.session import session_builder

    spark = session_builder("local[2]", app_name="checkpoint-bench").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(1024, dtype=np.float32), int(rng.integers(10))) for _ in range(2 * 64 * args.steps)]
    rdd = spark.sparkContext.parallelize(rows, 2).cache()
    rdd.count()
    root = tempfile.mkdtemp(prefix="gradshare-ckpt-bench-")
    try:
        options = dict(epochs=args.epochs, batch_size=64, port=0, network=Network(bind="127.0.0.1"), verbose=0)
        SharedTrainer(mlp, **{**options, "epochs": 1}).fit(rdd)  # warm-up: Python workers, imports, kernels
        plain = SharedTrainer(mlp, **options).fit(rdd)
        saved = SharedTrainer(mlp, **options, fault_tolerance=FaultTolerance(checkpoint_dir=root)).fit(rdd)
        via_driver = None
        if args.hadoop:
            os.makedirs(os.path.join(root, "hadoop"))
            spark.sparkContext._jsc.hadoopConfiguration().set(
                "fs.viewfs.mounttable.gradshare-bench.link./ckpt", f"file://{root}/hadoop"
            )
            via_driver = SharedTrainer(
                mlp, **options, fault_tolerance=FaultTolerance(checkpoint_dir="viewfs://gradshare-bench/ckpt/run")
            ).fit(rdd)
        last = os.path.join(root, f"epoch-{args.epochs:05d}")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(last) for f in files)
        param_bytes = 4 * saved.n_params
        per_rank = [r["checkpoint_seconds"] / args.epochs for r in saved.worker_reports]
        result = {
            "n_params": saved.n_params,
            "workers": saved.world_size,
            "epochs": args.epochs,
            "steps_per_epoch": args.steps,
            "checkpoint_bytes": size,
            "checkpoint_x_param_bytes": size / param_bytes,
            "write_seconds_per_checkpoint_by_rank": per_rank,
            "fit_seconds_plain": plain.seconds,
            "fit_seconds_checkpointed": saved.seconds,
            "train_seconds_per_epoch_rank0": plain.worker_reports[0]["train_seconds"] / args.epochs,
        }
        if via_driver is not None:
            result["hadoop_write_seconds_per_checkpoint_by_rank"] = [
                r["checkpoint_seconds"] / args.epochs for r in via_driver.worker_reports
            ]
            result["fit_seconds_hadoop"] = via_driver.seconds
    finally:
        shutil.rmtree(root, ignore_errors=True)
        spark.stop()
    print(f"model: {result['n_params']:,} parameters ({param_bytes / 1e6:.1f} MB), {result['workers']} workers, Adam")
    print(f"checkpoint size: {size / 1e6:.1f} MB = {result['checkpoint_x_param_bytes']:.2f} x parameter bytes")
    print("write time per checkpoint by rank: " + ", ".join(f"{s:.3f} s" for s in per_rank))
    print(f"training time per epoch (rank 0, no checkpoints): {result['train_seconds_per_epoch_rank0']:.2f} s")
    print(
        f"fit wall time: {plain.seconds:.2f} s without, {saved.seconds:.2f} s with a checkpoint per epoch "
        f"({saved.seconds / plain.seconds:.2f}x)"
    )
    if via_driver is not None:
        print(
            "through the driver to viewfs://, write time per checkpoint by rank: "
            + ", ".join(f"{s:.3f} s" for s in result["hadoop_write_seconds_per_checkpoint_by_rank"])
            + f"; fit wall time {via_driver.seconds:.2f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
