"""Frozen parameters (requires_grad=False: a LoRA model's base) are not in the shared state, so every replica
must start from the driver's: the driver ships their digest, and a worker whose copy differs refuses to
train, naming the model (replica/flat.frozen_digest, task/worker.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from gradshare import ConsistencyError, encoding
from gradshare.replica.flat import frozen_digest
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from worker_configs import worker_config


class Adapted(nn.Module):
    """A frozen base layer and a trainable adapter on top of it."""

    def __init__(self) -> None:
        super().__init__()
        self.base, self.adapter = nn.Linear(6, 6), nn.Linear(6, 3)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(torch.relu(self.base(x)))


def test_the_digest_covers_exactly_the_frozen_parameters():
    torch.manual_seed(0)
    model = Adapted()
    same = copy.deepcopy(model)
    assert frozen_digest(model) == frozen_digest(same) is not None
    with torch.no_grad():
        same.adapter.weight.add_(1.0)  # trainable: the shared state's, not the digest's
    assert frozen_digest(same) == frozen_digest(model)
    with torch.no_grad():
        same.base.weight[2, 3] = torch.nextafter(same.base.weight[2, 3], torch.tensor(1.0))  # one ulp
    assert frozen_digest(same) != frozen_digest(model)
    assert frozen_digest(nn.Linear(3, 2)) is None  # nothing frozen, nothing to compare


def make_worker(model: nn.Module, digest: str | None) -> Worker:
    cfg = worker_config(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        threshold_rule=encoding.CalibratedThreshold(),
        steps_per_epoch=(2,),
        epochs=1,
        batch_size=4,
        frozen_digest=digest,
    )
    x = np.ones((8, 6), np.float32)
    return Worker(cfg, 0, PartitionData(x, np.zeros(8, np.int64)))


def test_a_worker_whose_frozen_weights_differ_from_the_drivers_refuses_naming_the_model():
    torch.manual_seed(0)
    driver = Adapted()
    torch.manual_seed(1)
    built_elsewhere = Adapted()  # another initialisation of the frozen base, as a worker building it would
    make_worker(driver, frozen_digest(driver))  # the same weights: it builds
    with pytest.raises(ConsistencyError, match=r"rank 0: the frozen parameters .* of Adapted differ from the driver"):
        make_worker(built_elsewhere, frozen_digest(driver))


@pytest.mark.spark
def test_a_model_with_a_frozen_base_fits_on_spark_and_keeps_the_base(spark):
    from pyspark import cloudpickle

    from gradshare import SharedTrainer
    from gradshare.config.options import Network

    cloudpickle.register_pickle_by_value(__import__(__name__))  # executors cannot import this test module
    torch.manual_seed(0)
    model = Adapted()
    base = model.base.weight.detach().clone()
    rows = [(np.full(6, i % 5, np.float32), i % 3) for i in range(64)]
    result = SharedTrainer(model, epochs=2, batch_size=8, port=0, verbose=0, network=Network(bind="127.0.0.1")).fit(
        spark.sparkContext.parallelize(rows, 2)
    )
    assert torch.equal(result.model.base.weight, base)  # every worker checked its copy against this one
    assert result.steps > 0
