"""lr_batch_size: each worker's optimizer steps at lr × (batch_size ÷ lr_batch_size) ** ½ (or the ratio,
lr_scaling="linear"), while the optimizer, its scheduler and a checkpoint keep the lr as given."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gradshare import SharedTrainer, encoding
from gradshare.config.options import Compression
from gradshare.task.apply_log import ApplyLog
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from gradshare.transport.testing.shared_log import LogPeer, SharedLog
from worker_configs import worker_config


def _trained(lr: float, factor: float, steps: int = 10) -> Worker:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(128, 5)).astype(np.float32), rng.integers(0, 3, 128).astype(np.int64)
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        threshold_rule=encoding.CalibratedThreshold(density=0.1, min_entries=0),
        residual_clip=None,
        steps_per_epoch=(8,),
        epochs=2,
        batch_size=16,
        staleness=0,
        seed=0,
        label_dtype="int64",
        lr_factor=factor,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 4, 0.5),
    )
    w, log = Worker(cfg, 0, PartitionData(X, y)), LogPeer(SharedLog(1), 0)
    w.log = ApplyLog(log, w.flat, 0, 10.0)
    for t in range(steps):
        w.log.apply_through(t - 1)
        w.step(log, t)
    w.log.apply_through(steps - 1)
    return w


def test_a_worker_steps_at_the_scaled_lr_and_its_optimizer_keeps_the_lr_given():
    scaled, same = _trained(0.1, 0.25), _trained(0.025, 1.0)  # 0.1 × 0.25 == 0.025 exactly in binary
    assert np.array_equal(scaled.flat.array, same.flat.array)  # every step took the scaled lr, bit for bit
    assert not np.array_equal(scaled.flat.array, _trained(0.1, 1.0).flat.array)
    # the scheduler halved the lr it was given twice (steps 4 and 8); the factor never reached it
    assert scaled.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)
    assert same.optimizer.param_groups[0]["lr"] == pytest.approx(0.025 / 4)


def test_the_factor_follows_the_rule_chosen():
    assert Compression(lr_batch_size=100).lr_factor(2) == pytest.approx(math.sqrt(0.02))
    assert Compression(lr_batch_size=100, lr_scaling="linear").lr_factor(2) == pytest.approx(0.02)
    assert Compression().lr_factor(64) == 1.0 and Compression(lr_batch_size=64).lr_factor(64) == 1.0
    model = nn.Linear(2, 2)
    assert SharedTrainer(model, batch_size=25, compression=Compression(lr_batch_size=100)).config.lr_factor == 0.5
    assert (
        SharedTrainer(
            model, batch_size=8, compression=Compression(lr_batch_size=32, lr_scaling="linear")
        ).config.lr_factor
        == 0.25
    )
    assert SharedTrainer(model, batch_size=8).config.lr_factor == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr_batch_size": 0}, "lr_batch_size must be None or an int >= 1"),
        ({"lr_batch_size": -4}, "lr_batch_size"),
        ({"lr_batch_size": True}, "lr_batch_size"),
        ({"lr_batch_size": 2.5}, "lr_batch_size"),
        ({"lr_batch_size": "100"}, "lr_batch_size"),
        ({"lr_batch_size": 100, "lr_scaling": "cube"}, "lr_scaling must be 'sqrt' or 'linear'"),
    ],
)
def test_bad_lr_batch_options_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SharedTrainer(nn.Linear(2, 2), compression=Compression(**kwargs))
