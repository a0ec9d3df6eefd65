"""Distributed transform throughput: GradshareModel.transform ÷ a hand-written
pyspark.ml.functions.predict_batch_udf on the same model and the same data, in the same run.

    PYTHONPATH=$PWD python benchmarks/bench_transform.py [--rows 200000] [--rounds 3] [--workers 2] [--json out.json]

The model is the demo MLP (64 → 128 → 10) fitted by GradshareEstimator for one epoch on digits; the data
is `--rows` rows of 64 doubles generated on the executors (spark.range + rand), cached and counted first
so neither side pays for generating it. Each measurement runs the transform to Spark's "noop" sink (every
row is computed, nothing is collected). Three ways alternate per round (the machine is shared):
  gradshare        GradshareModel.transform, prediction + probability (its default output)
  gradshare_pred   GradshareModel.transform with probabilityCol="" (prediction only)
  hand_written     predict_batch_udf(make_predict_fn) as a user would write it: the state_dict broadcast,
                   torch.load, model.eval(), argmax, the same batch size (prediction only)
  hand_written_1t  the same with torch.set_num_threads(1) in each Python worker, as gradshare sets the
                   task's CPUs (1 here): without it each of the N tasks runs torch's default threads
The figures to quote are gradshare_pred ÷ hand_written and ÷ hand_written_1t (same output);
gradshare ÷ gradshare_pred shows what the probability column costs.
"""

import argparse
import functools
import io
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="local[N] and the data's partitions")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per forward pass, both sides")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    return parser.parse_args(argv)


def hand_written_udf(sc, module, batch_size, threads=None):
    """What a user writes without gradshare.ml: predict_batch_udf around the trained module (threads: set
    torch's intra-op threads in each Python worker, as gradshare does with the task's CPUs)."""
    import torch
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import DoubleType

    from gradshare.demo import mlp

    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    weights = sc.broadcast(buffer.getvalue())

    def make_predict_fn():
        import numpy as np

        if threads:
            torch.set_num_threads(threads)
        model = mlp()
        model.load_state_dict(torch.load(io.BytesIO(weights.value), weights_only=True))
        model.eval()

        def predict(x):
            with torch.inference_mode():
                return model(torch.from_numpy(x.astype(np.float32))).argmax(dim=1).double().numpy()

        return predict

    return predict_batch_udf(
        make_predict_fn, return_type=DoubleType(), batch_size=batch_size, input_tensor_shapes=[[64]]
    )


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import functions as F

    from gradshare.demo import digits_split, mlp
    from gradshare.driver.session import session_builder
    from gradshare.ml import GradshareEstimator

    spark = session_builder(
        f"local[{args.workers}]", "gradshare-bench-transform", {"spark.default.parallelism": str(args.workers)}
    ).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        X, _, y, _ = digits_split(0)
        train = spark.createDataFrame([(x.tolist(), int(t)) for x, t in zip(X, y)], ["features", "label"])
        model = GradshareEstimator(
            functools.partial(mlp),
            numWorkers=args.workers,
            learningRate=1e-2,
            predictBatchSize=args.batch_size,
            trainerOptions={"port": 0, "network": {"bind": "127.0.0.1"}, "verbose": 0},
        ).fit(train)
        data = (
            spark.range(args.rows, numPartitions=args.workers)
            .select(F.array(*[F.rand(seed=i) for i in range(64)]).alias("features"))
            .cache()
        )
        data.count()
        ways = {
            "gradshare": lambda: model.transform(data),
            "gradshare_pred": lambda: model.copy({model.probabilityCol: ""}).transform(data),
            "hand_written": functools.partial(
                lambda udf: data.withColumn("prediction", udf("features")),
                hand_written_udf(spark.sparkContext, model.torchModel, args.batch_size),
            ),
            "hand_written_1t": functools.partial(
                lambda udf: data.withColumn("prediction", udf("features")),
                hand_written_udf(spark.sparkContext, model.torchModel, args.batch_size, threads=1),
            ),
        }
        for build in ways.values():  # warm-up: Python workers start, import torch, cache the model
            build().write.format("noop").mode("overwrite").save()
        seconds = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, build in ways.items():
                out = build()
                t0 = time.perf_counter()
                out.write.format("noop").mode("overwrite").save()
                seconds[name].append(time.perf_counter() - t0)
    finally:
        spark.stop()

    rate = {name: args.rows / statistics.median(s) for name, s in seconds.items()}
    print(
        f"transform throughput, {args.rows} rows x 64 features, local[{args.workers}], batch {args.batch_size}, "
        f"median of {args.rounds} rounds"
    )
    for name, r in rate.items():
        print(f"  {name:15s} {r:12,.0f} rows/s   ({', '.join(f'{s:.2f}' for s in seconds[name])} s)")
    ratio = {
        f"gradshare_pred/{base}": rate["gradshare_pred"] / rate[base] for base in ("hand_written", "hand_written_1t")
    }
    ratio["gradshare/gradshare_pred"] = rate["gradshare"] / rate["gradshare_pred"]
    print("  " + "   ".join(f"{k} = {v:.2f}" for k, v in ratio.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "seconds": seconds, "rows_per_s": rate, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
