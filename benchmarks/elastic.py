"""Elastic fits on a real multi-executor cluster on this machine (a standalone master, one Worker JVM per
slot, started and killed by this script: benchmarks/standalone.py), beside the uninterrupted fits.

    python benchmarks/elastic.py '{"scenario": "shrink", "seed": 0}'     # 4 workers, one killed for good mid-fit
    python benchmarks/elastic.py '{"scenario": "whole", "world": 3}'     # uninterrupted, at 3 workers
    python benchmarks/elastic.py '{"scenario": "grow", "seed": 0}'       # 2 workers, 2 more started mid-fit
    python benchmarks/elastic.py '{"scenario": "resume", "world": 2}'    # a 4-worker checkpoint resumed at 2

Prints one JSON line: test accuracy, seconds, the re-forms (extra["reforms"]), workers per epoch, and the
steps per second before and after a grow. The workload is scikit-learn's digits with the demo MLP
(`gradshare.demo`), the fit's defaults, batch 16, so that an epoch has enough steps to be cut inside.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from pyspark import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradshare.config.options import Network
from lab.flat_options import in_groups
from standalone import Cluster  # noqa: E402 - this folder's helper

DEFAULTS = {
    "scenario": "whole",
    "world": 4,
    "seed": 0,
    "epochs": 8,
    "batch_size": 16,
    "kill_at": 0.4,
    "grow_after": 2.0,
}


class KillsNode(torch.nn.Module):
    """The demo MLP whose rank `rank` kills its own node on its `at`-th training forward, once (the marker
    file): the process group of the standalone Worker it runs under (the Worker daemon, its executor JVM
    and Python workers), so the slot never comes back. Refuses anywhere but under a standalone Worker."""

    def __init__(self, marker: str, rank: int, at: int, pause: float = 0.0) -> None:
        """pause: seconds every training forward sleeps (a test's fit then lasts long enough to grow)."""
        super().__init__()
        from gradshare.demo import mlp

        self.net = mlp()
        self.marker, self.rank, self.at, self.calls, self.pause = marker, rank, at, 0, pause

    def forward(self, x: Any) -> Any:
        from pyspark import TaskContext

        if self.training and self.pause:
            time.sleep(self.pause)
        ctx = TaskContext.get()
        if self.training and ctx is not None and ctx.partitionId() == self.rank:
            self.calls += 1
            if self.calls == self.at and not os.path.exists(self.marker):
                worker = _ancestor(b"deploy.worker.Worker")
                if worker is None:
                    raise RuntimeError("KillsNode runs under a standalone Worker only")
                open(self.marker, "w").close()
                os.killpg(os.getpgid(worker), signal.SIGKILL)  # the Worker and the executor JVM it forked
                os.killpg(os.getpgid(0), signal.SIGKILL)  # pyspark's daemon and its Python workers, this one too
        return self.net(x)


def _ancestor(marker: bytes) -> int | None:
    """The nearest ancestor process whose command line holds `marker`."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return None


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this script


def rdd_of(spark: Any, seed: int, partitions: int) -> tuple[Any, Any, Any]:
    from gradshare.demo import digits_split

    X_train, X_test, y_train, y_test = digits_split(seed)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    return spark.sparkContext.parallelize(rows, partitions).cache(), X_test, y_test


def trainer(cfg: dict[str, Any], model: Any = None, **options: Any) -> Any:
    from gradshare import SharedTrainer
    from gradshare.demo import mlp

    return SharedTrainer(
        model or mlp,
        epochs=cfg["epochs"],
        batch_size=cfg["batch_size"],
        seed=cfg["seed"],
        port=0,
        verbose=0,
        **in_groups({**options, "network": Network(bind="127.0.0.1")}),
    )


def summary(result: Any, X_test: Any, y_test: Any, seconds: float, batch: int) -> dict[str, Any]:
    from gradshare.demo import evaluate_accuracy

    # rows per second of each job's epochs but its first (which holds the job's start), by workers
    rates: dict[int, list[float]] = {}
    for before, row in zip([None, *result.history], result.history):
        if before is not None and before.get("workers") == row.get("workers") and row["seconds"] > 0:
            rates.setdefault(row.get("workers") or 0, []).append(row["steps"] * batch / row["seconds"])
    return {
        "rows_per_second": {k: round(sum(v) / len(v)) for k, v in rates.items()},
        "accuracy": round(100 * evaluate_accuracy(result.model, X_test, y_test), 2),
        "seconds": round(seconds, 1),
        "reforms": result.extra["reforms"],
        "workers": [h.get("workers") for h in result.history],
        "rows": [h["epoch"] for h in result.history],
        "steps": [h["steps"] for h in result.history],
        "seconds_per_epoch": [round(h["seconds"], 2) for h in result.history],
    }


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    from gradshare import Elastic

    scenario, world = cfg["scenario"], cfg["world"]
    slots = {"whole": world, "shrink": 4, "grow": 2, "resume": max(world, 4)}[scenario]
    with Cluster() as cluster:
        cluster.add_workers(slots)
        spark = cluster.session(**{"spark.ui.showConsoleProgress": "false"})
        cluster.wait_slots(slots)
        rdd, X_test, y_test = rdd_of(spark, cfg["seed"], world if scenario != "grow" else 2)
        rdd.count()
        t0 = time.monotonic()
        if scenario == "whole":
            result = trainer(cfg, num_workers=world).fit(rdd)
            return {**cfg, **summary(result, X_test, y_test, time.monotonic() - t0, cfg["batch_size"])}
        if scenario == "resume":
            with tempfile.TemporaryDirectory() as root:
                half = max(cfg["epochs"] // 2, 1)
                trainer({**cfg, "epochs": half}, num_workers=4, checkpoint_dir=root).fit(rdd)
                t0 = time.monotonic()
                result = trainer(cfg, num_workers=world).fit(rdd, resume_from=root)
                return {**cfg, **summary(result, X_test, y_test, time.monotonic() - t0, cfg["batch_size"])}
        elastic = Elastic(min_workers=2, max_workers=4, slot_wait=5.0)
        if scenario == "shrink":
            # rank 3 kills its node `kill_at` of the way through the fit, inside an epoch
            steps = -(-len(X_test) * 3 // (4 * cfg["batch_size"]))  # about a rank's steps per epoch
            at = max(int(cfg["kill_at"] * cfg["epochs"] * steps) + steps // 2, 1)
            with tempfile.TemporaryDirectory() as scratch:
                model = KillsNode(os.path.join(scratch, "killed"), rank=3, at=at)
                result = trainer(cfg, model=lambda: model, num_workers=4, elastic=elastic).fit(rdd)
        else:
            timer = threading.Timer(cfg["grow_after"], cluster.add_workers, args=(2,))
            timer.start()
            try:
                result = trainer(cfg, num_workers=2, elastic=elastic).fit(rdd)
            finally:
                timer.cancel()
        return {**cfg, **summary(result, X_test, y_test, time.monotonic() - t0, cfg["batch_size"])}


def main(argv: list[str]) -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    cfg = {**DEFAULTS, **(json.loads(argv[0]) if argv else {})}
    print(json.dumps(run(cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
