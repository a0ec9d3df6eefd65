"""The two workloads of `gradshare bench train` (issue 5): the same data, model and seed for every system.

Data: scikit-learn's handwritten digits (ships inside the package, nothing downloaded), upsampled from
8×8 to 32×32 (bilinear) so that the first layer of the MLP is large. Split 75/25 stratified; the
training rows are cut into contiguous halves, one per worker, exactly as `sc.parallelize(rows, 2)` does.

- "mlp": communication-heavy, 1024 → 2048 → 2048 → 2048 → 10 (10.5 M parameters, ~40 MB dense).
- "cnn": compute-heavy, three 3×3 convolutions on 1×32×32 (≈ 70 k parameters, ~9 M MACs per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("mlp", "cnn")


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


def load(name: str, seed: int = 0, target: float | None = None, rows: int | None = None) -> Workload:
    """The workload `name` ("mlp" or "cnn"); `rows` keeps only the first rows of each split (smoke runs)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    X_train, X_test, y_train, y_test = upsampled_digits(seed)
    if rows is not None:
        X_train, y_train, X_test, y_test = X_train[:rows], y_train[:rows], X_test[:rows], y_test[:rows]
    if name == "mlp":
        X_train, X_test = X_train.reshape(len(X_train), -1), X_test.reshape(len(X_test), -1)
    else:
        X_train, X_test = X_train[:, None], X_test[:, None]
    default_target = 0.90
    return Workload(name, np.ascontiguousarray(X_train), y_train, np.ascontiguousarray(X_test), y_test,
                    default_target if target is None else float(target))


def model_factory(name: str):
    """A zero-argument factory for the workload's model (module-level, so Spark pickles it by reference)."""
    return {"mlp": mlp, "cnn": cnn}[name]


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


def test_accuracy(model, X: np.ndarray, y: np.ndarray, batch: int = 512) -> float:
    """Share of test rows whose arg-max output is the label (eval mode, no grad)."""
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for b in range(0, len(y), batch):
            out = model(torch.from_numpy(X[b : b + batch]))
            correct += int((out.argmax(dim=1).numpy() == y[b : b + batch]).sum())
    model.train(was_training)
    return correct / max(len(y), 1)
