"""Rows per second into the workers from a DataFrame: the RDD path (``df.select(...).rdd``) against the
mapInArrow path (gradshare/task/arrow_rows.py), side by side on one classic local session.

Each job is what a fit's tasks do with their partition before training: the pre-pass
(`summarise_partition` over the rows) or the materialisation (`PartitionData.from_rows`, what every
worker keeps for its epochs), timed from submission to the collected result; rows/s = rows ÷ seconds.
The DataFrame is cached and counted first, so both read the same in-memory blocks.

    python benchmarks/dataframe_rows.py --rows 10000 --width 1024 --partitions 2 --repeats 3 --json out.json

(docs/benchmarks/data/bench-dataframe.json is that run's output.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gradshare.driver.session import dataframe_to_rdd, session_builder  # noqa: E402
from gradshare.task.arrow_rows import RESULT_SCHEMA, batch_rows, read_results, result_batches  # noqa: E402
from gradshare.task.partition import PartitionData, summarise_partition  # noqa: E402


def _materialise(rows):
    return len(PartitionData.from_rows(rows, "int64"))


def _arrow_task(work, names, batches):
    from pyspark import TaskContext

    index = TaskContext.get().partitionId()
    rows = batch_rows(batches, names, False)
    result = summarise_partition(index, rows).rows if work == "prepass" else _materialise(rows)
    yield from result_batches(index, result)


def rdd_job(df, col, work):
    rdd = dataframe_to_rdd(df, col, "label")
    if work == "prepass":
        return sum(rdd.mapPartitionsWithIndex(lambda i, it: [summarise_partition(i, it).rows]).collect())
    return sum(rdd.mapPartitions(lambda it: [_materialise(it)]).collect())


def arrow_job(df, col, work):
    rows = (
        df.select(col, "label")
        .mapInArrow(functools.partial(_arrow_task, work, (col, "label")), RESULT_SCHEMA)
        .collect()
    )
    return sum(read_results(rows).values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session_builder(f"local[{args.partitions}]", "gradshare-dataframe-rows").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    try:
        df = (
            spark.range(args.rows, numPartitions=args.partitions)
            .select(
                F.expr(f"transform(sequence(0, {args.width - 1}), i -> cast((i * id) % 97 as double) / 97)").alias(
                    "arr"
                ),
                (F.col("id") % 10).alias("label"),
            )
            .withColumn("vec", array_to_vector("arr"))
            .cache()
        )
        df.count()
        results = []
        for col in ("arr", "vec"):
            for work in ("prepass", "materialise"):
                times: dict[str, list[float]] = {"rdd": [], "arrow": []}
                for _ in range(args.repeats):
                    for name, job in (("rdd", rdd_job), ("arrow", arrow_job)):  # alternated: same noise
                        t0 = time.monotonic()
                        n = job(df, col, work)
                        times[name].append(time.monotonic() - t0)
                        assert n == args.rows, (name, n)
                row = {
                    "column": col,
                    "work": work,
                    **{f"{k}_rows_per_s": args.rows / statistics.median(v) for k, v in times.items()},
                    **{f"{k}_seconds": v for k, v in times.items()},
                }
                row["arrow_over_rdd"] = row["arrow_rows_per_s"] / row["rdd_rows_per_s"]
                results.append(row)
                print(
                    f"{col:>4} {work:>11}: rdd {row['rdd_rows_per_s']:9,.0f} rows/s, arrow "
                    f"{row['arrow_rows_per_s']:9,.0f} rows/s ({row['arrow_over_rdd']:.1f}x)",
                    flush=True,
                )
    finally:
        spark.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                    "date": time.strftime("%Y-%m-%d"),
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
