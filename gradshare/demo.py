"""`gradshare demo`: a small MLP on scikit-learn's handwritten digits, 2 workers on an embedded Spark.

Prints per-epoch loss and test accuracy, the traffic actually sent vs dense float32, and the test
accuracy of a single-process run of the same model, optimizer, batch size and epochs. The data set
ships inside scikit-learn: nothing is downloaded. The CLI imports this module only to run the demo
(or print its --help: gradshare/cli.py, the import seam), so it imports torch and pyspark at module
level. scikit-learn stays in `digits_split`: executors import this module too, to unpickle `mlp` (the
demo's and many tests' model factory), and never need it (~0.8 s a fresh Python worker would pay).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from torch import nn

from gradshare.cli import threshold_arg
from gradshare.config import OptimizerFactory, TrainConfig
from gradshare.config.options import Compression, Network, ThresholdAlgorithm
from gradshare.driver.session import get_or_create_session
from gradshare.driver.trainer import SharedTrainer, default_optimizer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# the options the demo shares with SharedTrainer default to SharedTrainer's (TrainConfig); the demo's
# own are its workers and its epochs (30: enough for the digits MLP to converge)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="barrier tasks / Spark partitions (default 2)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over each partition (default 30)")
    parser.add_argument(
        "--batch-size", type=int, default=TrainConfig.batch_size, help="rows per step per worker (default %(default)s)"
    )
    parser.add_argument(
        "--threshold",
        type=_threshold_type,
        default=TrainConfig.threshold,
        help="'auto' (default: τ calibrated to a target density every step) or an initial τ",
    )
    parser.add_argument(
        "--threshold-algorithm",
        choices=["adaptive", "fixed"],
        default=Compression.threshold_algorithm,
        help="how a numeric τ moves (default %(default)s)",
    )
    parser.add_argument(
        "--staleness", type=int, default=Compression.staleness, help="k: apply the log through t-1-k before step t"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=TrainConfig.port,
        help="relay UDP port on the driver (0: ephemeral; default %(default)s)",
    )
    parser.add_argument("--bind", default=Network.bind, help="relay bind address (127.0.0.1: loopback only)")
    parser.add_argument(
        "--master",
        default=None,
        help="Spark master (default: an active session, else embedded local[workers]); "
        "e.g. local-cluster[2,1,1024] or spark://host:7077",
    )
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _threshold_type(text: str) -> float | str:
    try:
        return threshold_arg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def digits_split(
    seed: int = 0,
) -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.int64], NDArray[np.int64]]:
    """Digits scaled to [0, 1], split 75/25 stratified: (X_train, X_test, y_train, y_test)."""
    from sklearn.datasets import load_digits  # lazy: the module docstring says why
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y.astype(np.int64), test_size=0.25, random_state=seed, stratify=y
    )
    return X_train, X_test, y_train, y_test


def mlp(hidden: int = 128) -> nn.Module:
    """The demo model: 64 → hidden → 10 with ReLU."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def evaluate_accuracy(model: nn.Module, X: ArrayLike, y: ArrayLike) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(np.asarray(X, np.float32))).argmax(dim=1).numpy()
    return float((pred == np.asarray(y)).mean())


def train_single_process(
    model_factory: Callable[[], nn.Module],
    X: ArrayLike,
    y: ArrayLike,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    optimizer: OptimizerFactory | None = None,
) -> nn.Module:
    """The baseline: the same model, optimizer and batch size in one process, seeded shuffles."""
    torch.manual_seed(seed)
    model = model_factory()
    opt = (optimizer or default_optimizer)(list(model.parameters()))
    loss_fn = torch.nn.CrossEntropyLoss()
    X, y = torch.from_numpy(np.asarray(X, np.float32)), torch.from_numpy(np.asarray(y, np.int64))
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(y))
        for b in range(0, len(y), batch_size):
            idx = torch.from_numpy(np.sort(order[b : b + batch_size]))
            opt.zero_grad(set_to_none=True)
            loss_fn(model(X[idx]), y[idx]).backward()
            opt.step()
    return model


def digits_experiment(
    spark: SparkSession,
    *,
    workers: int = 2,
    epochs: int = 30,
    batch_size: int = TrainConfig.batch_size,
    threshold: float | Literal["auto"] = TrainConfig.threshold,
    threshold_algorithm: ThresholdAlgorithm = Compression.threshold_algorithm,
    staleness: int = Compression.staleness,
    port: int = 0,
    seed: int = TrainConfig.seed,
    verbose: int = 0,
    bind: str = Network.bind,
    single: bool = True,
) -> dict[str, Any]:
    """Train the demo MLP with gradshare (and, if `single`, in one process); return the figures."""
    X_train, X_test, y_train, y_test = digits_split(seed)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    rdd = spark.sparkContext.parallelize(rows, workers)
    trainer = SharedTrainer(
        mlp,
        threshold=threshold,
        port=port,
        batch_size=batch_size,
        epochs=epochs,
        seed=seed,
        verbose=verbose,
        validation_data=(X_test, y_test),
        network=Network(bind=bind),
        compression=Compression(threshold_algorithm=threshold_algorithm, staleness=staleness),
    )
    result = trainer.fit(rdd)
    out: dict[str, Any] = {"result": result, "gp_accuracy": evaluate_accuracy(result.model, X_test, y_test)}
    if single:
        base = train_single_process(mlp, X_train, y_train, epochs=epochs, batch_size=batch_size, seed=seed)
        out["single_accuracy"] = evaluate_accuracy(base, X_test, y_test)
    return out


def run(args: argparse.Namespace) -> int:
    spark, created = get_or_create_session(args.workers, args.master)
    try:
        out = digits_experiment(
            spark,
            workers=args.workers,
            epochs=args.epochs,
            batch_size=args.batch_size,
            threshold=args.threshold,
            threshold_algorithm=args.threshold_algorithm,
            staleness=args.staleness,
            port=args.port,
            seed=args.seed,
            bind=args.bind,
            verbose=0 if args.quiet else 1,
        )
    finally:
        if created:
            spark.stop()
    r = out["result"]
    print(
        f"\ngradshare: {r.world_size} workers, {r.n_params:,} parameters, {r.steps} steps, "
        f"{r.seconds:.1f} s (Spark master {args.master or 'embedded local'})"
    )
    print(f"{'epoch':>5} {'loss':>8} {'test acc':>9} {'density':>9} {'tau':>9} {'KB sent':>9} {'seconds':>8}")
    for h in r.history:
        acc = "" if h["val_metric"] is None else f"{100 * h['val_metric']:.2f}%"
        print(
            f"{h['epoch'] + 1:>5} {h['loss']:>8.4f} {acc:>9} {h['sparsity']:>9.2e} {h['tau']:>9.2e} "
            f"{h['bytes_sent'] / 1024:>9.1f} {h['seconds']:>8.2f}"
        )
    moved = r.bytes_sent + r.bytes_received
    print(
        f"\ntraffic: {moved / 1024:,.1f} KB sent+received by workers vs {r.dense_bytes / 1024:,.1f} KB "
        f"dense float32 ({r.traffic_ratio:,.0f}x less)"
    )
    print(
        f"test accuracy: gradshare {100 * out['gp_accuracy']:.2f}%   "
        f"single process (same model, epochs, batch) {100 * out['single_accuracy']:.2f}%"
    )
    print(f"replicas verified bit-identical to the relay (param hash {r.param_hash[:16]}...)")
    return 0
