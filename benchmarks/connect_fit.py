"""A digits fit from a Spark Connect client against the same fit on a classic session, and the relay in the
job against the relay in the driver: accuracy, wall time of the fit, and the session's start-up apart.

Each case runs in its own Python process (a classic and a Connect session cannot share one): it starts
its session (timed: `startup`), makes the digits DataFrame (2 partitions, the same rows), runs one
`SharedTrainer(mlp, epochs=E).fit(df)` (timed: `first`, which includes starting the executors' Python
workers) and the same fit again (timed: `fit`, the steady state). Ratios are against the classic
session with the relay in the driver, from the same run.

    python benchmarks/connect_fit.py --epochs 5 --repeats 3 --json docs/benchmarks/data/bench-connect.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from gradshare.config.options import Network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {  # name: (session, relay)
    "classic, relay in the driver": ("classic", "client"),
    "classic, relay in the job": ("classic", "in-job"),
    "Connect, relay in the job": ("connect", "in-job"),
    "Connect, relay in the client": ("connect", "client"),
}


def run_case(session: str, relay: str, epochs: int) -> dict:
    """The child's body: session start, digits DataFrame, two fits; plain numbers back."""
    t0 = time.monotonic()
    if session == "connect":
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.remote("local[2]").getOrCreate()
    else:
        from gradshare.driver.session import session_builder

        spark = session_builder("local[2]", app_name="bench-connect").getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    startup = time.monotonic() - t0
    from gradshare import SharedTrainer
    from gradshare.demo import digits_split, evaluate_accuracy, mlp

    X, X_test, y, y_test = digits_split(0)
    df = spark.createDataFrame([(x.tolist(), int(v)) for x, v in zip(X, y)], ["features", "label"]).repartition(2)
    df = df.localCheckpoint() if session == "classic" else df.cache()
    df.count()
    out: dict = {"startup": startup}
    for name in ("first", "fit"):
        t = time.monotonic()
        r = SharedTrainer(
            mlp, epochs=epochs, batch_size=32, seed=3, port=0, verbose=0, network=Network(bind="127.0.0.1", relay=relay)
        ).fit(df, features_col="features", label_col="label")
        out[name] = time.monotonic() - t
        out["accuracy"] = evaluate_accuracy(r.model, X_test, y_test)
        out["relay"], out["steps"] = r.extra.relay, r.steps
    spark.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the child's
    args = ap.parse_args()
    if args.case is not None:
        session, relay = CASES[args.case]
        print("RESULT " + json.dumps(run_case(session, relay, args.epochs)), flush=True)
        return
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    for _ in range(args.repeats):  # interleaved, so a drift of the machine hits every case alike
        for name in CASES:
            proc = subprocess.run(
                [sys.executable, __file__, "--epochs", str(args.epochs), "--case", name],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{name}: no result (rc {proc.returncode}): {proc.stderr[-2000:]}")
            runs[name].append(json.loads(line[len("RESULT ") :]))
    base = "classic, relay in the driver"
    rows = []
    for name, got in runs.items():
        med = {k: statistics.median(r[k] for r in got) for k in ("startup", "first", "fit", "accuracy")}
        ratio = med["fit"] / statistics.median(r["fit"] for r in runs[base])
        rows.append({"case": name, **med, "fit_ratio": ratio, "runs": got})
        print(
            f"{name:32s} startup {med['startup']:5.1f} s  first fit {med['first']:5.1f} s  fit {med['fit']:5.1f} s "
            f"(x{ratio:.2f})  accuracy {med['accuracy']:.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(["python", "benchmarks/connect_fit.py", *sys.argv[1:]]),
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    "epochs": args.epochs,
                    "repeats": args.repeats,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
