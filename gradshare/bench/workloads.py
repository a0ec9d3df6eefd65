"""The workloads of `gradshare bench train` and `bench convergence`: the same data,
model and seed for every system. Nothing is downloaded.

- "mlp": communication-heavy, 1024 → 2048 → 2048 → 2048 → 10 (10.5 M parameters, ~40 MB dense), and
- "cnn": compute-heavy, three 3×3 convolutions on 1×32×32 (64 k parameters, ~9 M MACs per row), both on
  scikit-learn's handwritten digits (ship inside the package), upsampled from 8×8 to 32×32 (bilinear)
  so that the first layer of the MLP is large;
- "tabular": data of another kind, scikit-learn's `make_classification` (TABULAR: 8,000 rows, 100
  features of which 20 informative, 5 classes, generated with random_state = seed), standardised with
  the training split's mean and std; MLP 100 → 1024 → 512 → 5 (631 k parameters).

Every split is 75/25 stratified with random_state = seed; the training rows are cut into contiguous
shards, one per worker, exactly as `sc.parallelize(rows, N)` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("mlp", "cnn", "tabular")
TABULAR = {"n_samples": 8000, "n_features": 100, "n_informative": 20, "n_redundant": 10, "n_classes": 5}
# Test accuracy whose first crossing is "time/epochs to target". Tabular, from a dense run (seed 0,
# cosine, 10 epochs, 2026-11-23): the single process plateaus at 0.81, DDP at 0.80 (N=2) / 0.78 (N=4);
# 0.75 is about 95 % of DDP's plateau, crossed by DDP at epoch 4 (N=2) and 5 (N=4).
TARGETS = {"mlp": 0.90, "cnn": 0.90, "tabular": 0.75}


@dataclass(frozen=True)
class Workload:
    name: str
    X_train: np.ndarray  # float32 (n, 1024) for the MLP, (n, 1, 32, 32) for the CNN
    y_train: np.ndarray  # int64
    X_test: np.ndarray
    y_test: np.ndarray
    target: float  # test accuracy whose first crossing is "time to target"

    def shard(self, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of worker `rank`: the contiguous slice `parallelize(rows, world)` gives partition `rank`."""
        n = len(self.y_train)
        lo, hi = rank * n // world, (rank + 1) * n // world
        return self.X_train[lo:hi], self.y_train[lo:hi]


def upsampled_digits(seed: int = 0, size: int = 32):
    """Digits scaled to [0, 1] and resized to size×size: (X_train, X_test, y_train, y_test), X as (n, size, size)."""
    from scipy.ndimage import zoom
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    images = (X / 16.0).reshape(-1, 8, 8)
    big = zoom(images, (1, size / 8, size / 8), order=1).astype(np.float32)
    return train_test_split(big, y.astype(np.int64), test_size=0.25, random_state=seed, stratify=y)


def tabular_data(seed: int = 0):
    """`make_classification` (TABULAR) standardised: (X_train, X_test, y_train, y_test), X float32 (n, 100)."""
    from sklearn.datasets import make_classification
    from sklearn.model_selection import train_test_split

    X, y = make_classification(**TABULAR, random_state=seed)
    X_train, X_test, y_train, y_test = train_test_split(X, y.astype(np.int64), test_size=0.25,
                                                        random_state=seed, stratify=y)
    mean, std = X_train.mean(axis=0), X_train.std(axis=0)
    return ((X_train - mean) / std).astype(np.float32), ((X_test - mean) / std).astype(np.float32), y_train, y_test


def load(name: str, seed: int = 0, target: float | None = None, rows: int | None = None) -> Workload:
    """The workload `name` (one of WORKLOADS); `rows` keeps only the first rows of each split (smoke runs)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    if name == "tabular":
        X_train, X_test, y_train, y_test = tabular_data(seed)
    else:
        X_train, X_test, y_train, y_test = upsampled_digits(seed)
    if rows is not None:
        X_train, y_train, X_test, y_test = X_train[:rows], y_train[:rows], X_test[:rows], y_test[:rows]
    if name == "mlp":
        X_train, X_test = X_train.reshape(len(X_train), -1), X_test.reshape(len(X_test), -1)
    elif name == "cnn":
        X_train, X_test = X_train[:, None], X_test[:, None]
    return Workload(name, np.ascontiguousarray(X_train), y_train, np.ascontiguousarray(X_test), y_test,
                    TARGETS[name] if target is None else float(target))


def model_factory(name: str):
    """A zero-argument factory for the workload's model (module-level, so Spark pickles it by reference)."""
    return {"mlp": mlp, "cnn": cnn, "tabular": tabular}[name]


def mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def cnn():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )


def tabular():
    from torch import nn

    return nn.Sequential(nn.Linear(TABULAR["n_features"], 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                         nn.Linear(512, TABULAR["n_classes"]))


def test_accuracy(model, X: np.ndarray, y: np.ndarray, batch: int = 512) -> float:
    """Share of test rows whose arg-max output is the label (eval mode, no grad)."""
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    device = next(model.parameters()).device     # a model trained on a GPU is scored there
    with torch.no_grad():
        for b in range(0, len(y), batch):
            out = model(torch.from_numpy(X[b : b + batch]).to(device))
            correct += int((out.argmax(dim=1).cpu().numpy() == y[b : b + batch]).sum())
    model.train(was_training)
    return correct / max(len(y), 1)
