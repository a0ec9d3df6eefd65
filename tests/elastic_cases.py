"""Elastic fits that need more task slots than the tests' shared local[2] session: run as a subprocess (a JVM
holds one SparkContext) by tests/driver/test_elastic.py, one JSON line on stdout.

    python tests/elastic_cases.py    # a standalone cluster of 3 workers: checkpoints resumed at another world
                                     # size; a fit that grows onto a free node, then loses one for good
"""

import json
import os
import sys
import tempfile

import numpy as np

from gradshare.config.options import Network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

ROWS = 960  # divides into 2, 3 and 4 partitions of whole batches of 16 or 40


def digits(spark, partitions, rows=ROWS):
    from gradshare.demo import digits_split

    X, X_test, y, y_test = digits_split(0)
    data = list(zip(X[:rows], (int(v) for v in y[:rows])))
    return spark.sparkContext.parallelize(data, partitions).cache(), X_test, y_test


def sgd(lr):
    import torch

    return lambda params: torch.optim.SGD(params, lr=lr)


def no_loss(outputs, labels):
    """A loss with no gradient: every update is 0, so only what the residuals hold can move."""
    return (outputs * 0.0).sum()


def trainer(epochs, optimizer, model=None, batch_size=40, **options):
    from gradshare import SharedTrainer
    from gradshare.demo import mlp
    from lab.flat_options import in_groups  # benchmarks/ is on sys.path from here (above)

    return SharedTrainer(
        model or mlp,
        epochs=epochs,
        batch_size=batch_size,
        seed=5,
        optimizer=optimizer,
        threshold=2e-3,
        port=0,
        verbose=0,
        **in_groups({**options, "network": Network(bind="127.0.0.1")}),
    )  # grouped options named flat


def residual_sum(directory, world):
    return sum(np.load(os.path.join(directory, f"rank-{r}", "residual.npy")).astype(np.float64) for r in range(world))


def resume_cases(spark):
    """A 2-worker checkpoint resumed at 3 and a 3-worker one at 2: with no gradient the only change is the residuals'
    mass above τ moving into the parameters, so P + the residuals' sum is the same in the resumed fit's own
    checkpoint as in the one it resumed from, and every new replica ends equal to the relay."""
    out = {}
    for saved, resumed in ((2, 3), (3, 2)):
        rdd, X_test, y_test = digits(spark, saved)
        with tempfile.TemporaryDirectory() as root:
            first = os.path.join(root, "first")
            trainer(1, sgd(0.05), num_workers=saved, checkpoint_dir=first).fit(rdd)
            before = os.path.join(first, "epoch-00001")
            still = os.path.join(root, "still")
            # no gradient: only residual mass moves
            frozen = trainer(2, sgd(0.05), num_workers=resumed, checkpoint_dir=still, loss=no_loss).fit(
                rdd, resume_from=first
            )
            after = os.path.join(still, "epoch-00002")
            p_before = np.load(os.path.join(before, "params.npy")).astype(np.float64)
            p_after = np.load(os.path.join(after, "params.npy")).astype(np.float64)
            n = residual_sum(before, saved).size
            out[f"{saved}->{resumed}"] = {
                # P + the residuals' sum: what a message moves from a residual into P, so at lr 0 it stays
                "mass_diff": float(
                    np.abs(
                        (p_after[:n] + residual_sum(after, resumed)) - (p_before[:n] + residual_sum(before, saved))
                    ).max()
                ),
                "moved": float(np.abs(p_after - p_before).max()),  # the residuals' mass above τ was sent
                "model_equal_relay": bool(np.array_equal(p_after.astype(np.float32), _flat(frozen.model))),
                "residual_sum_before": float(np.abs(residual_sum(before, saved)).sum()),
                "reforms": frozen.extra["reforms"],
                "world": frozen.world_size,
                "history_epochs": [h["epoch"] for h in frozen.history],
                "hashes": sorted({r["param_hash"] for r in frozen.worker_reports} | {frozen.param_hash}),
                "steps": [h["steps"] for h in frozen.history],
            }
    return out


def _flat(model):
    import torch

    with torch.no_grad():
        return np.concatenate(
            [t.detach().reshape(-1).numpy() for t in model.state_dict().values() if t.is_floating_point()]
        ).astype(np.float32)


def cluster_case(spark):
    """The fit starts at 2 of the 3 workers, so it grows to 3 at an epoch's end; then rank 2's node is killed
    for good (its Worker daemon and executor JVM), and the fit finishes at 2."""
    from elastic import KillsNode  # benchmarks/elastic.py
    from gradshare import Elastic
    from gradshare.demo import evaluate_accuracy

    with tempfile.TemporaryDirectory() as scratch:
        rdd, X_test, y_test = digits(spark, 2)
        rdd.count()
        # rank 2 exists only once the fit has grown; 20 steps an epoch there: its 50th step is inside an epoch
        # 20 ms a step: 0.6 s an epoch at 2 workers, so the grow (about 3 s in) comes early in the fit
        model = KillsNode(os.path.join(scratch, "killed"), rank=2, at=50, pause=0.02)
        result = trainer(
            20,
            sgd(0.05),
            model=lambda: model,
            batch_size=16,
            num_workers=2,
            elastic=Elastic(min_workers=2, max_workers=3, slot_wait=0.0),
        ).fit(rdd)
        return {
            "reforms": result.extra["reforms"],
            "workers": [h["workers"] for h in result.history],
            "epochs": [h["epoch"] for h in result.history],
            "world": result.world_size,
            "steps": [h["steps"] for h in result.history],
            "hashes": sorted({r["param_hash"] for r in result.worker_reports} | {result.param_hash}),
            "accuracy": evaluate_accuracy(result.model, X_test, y_test),
        }


def main():
    """One standalone cluster of 3 workers for both: its JVMs take longer to start than the fits run."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")])
    from standalone import Cluster

    with Cluster() as cluster:
        cluster.add_workers(3)
        spark = cluster.session(**{"spark.ui.showConsoleProgress": "false"})
        cluster.wait_slots(3)
        resumed = resume_cases(spark)
        print(json.dumps({"resume": resumed, "cluster": cluster_case(spark)}))


if __name__ == "__main__":
    main()
