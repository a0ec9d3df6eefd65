"""One gradshare worker stepped by itself (world size 1, a one-rank lock-step log): what a test of the
replica's update path compares, bit for bit, between two ways of taking the same steps."""

import numpy as np
import torch
from torch import nn

from gradshare import encoding
from gradshare.task.apply_log import ApplyLog
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from gradshare.transport import param_hash
from gradshare.transport.testing.shared_log import LogPeer, SharedLog
from worker_configs import worker_config

STEPS = 6


def mlp():
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4))


def run_one_worker(
    make_optimizer,
    model=mlp,
    precision="32",
    in_backward=True,
    direct=True,
    steps=STEPS,
    staleness=0,
    tensor_state=False,
    **options,
):
    """(worker, hashes of the parameters after each step, the residual)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(64, 16)).astype(np.float32), rng.integers(0, 4, 64).astype(np.int64)
    torch.manual_seed(0)  # the same initial weights every time
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=model(),
        loss=nn.CrossEntropyLoss(),
        optimizer=make_optimizer,
        threshold_rule=encoding.CalibratedThreshold(),
        residual_clip=None,
        steps_per_epoch=(4,),
        epochs=2,
        batch_size=16,
        staleness=staleness,
        seed=0,
        label_dtype="int64",
        precision=precision,
        direct_update=direct,
        tensor_state=tensor_state,
        step_in_backward=in_backward,
        **options,
    )
    worker, log = Worker(cfg, 0, PartitionData(X, y)), LogPeer(SharedLog(1), 0)
    worker.log = ApplyLog(log, worker.flat, 0, 10.0)
    hashes = []
    for t in range(steps):
        worker.log.apply_through(t - 1 - staleness)
        worker.step(log, t)
        hashes.append(param_hash(worker.flat.host_state()))
    residual = worker.state.residual_values()
    return worker, hashes, residual.cpu().numpy().copy() if tensor_state else residual.copy()
