"""SharedTrainer(forwarding="aggregate") on the real local Spark session: the replicas
and the relay apply only the relay's aggregates and end bit-identical (fit raises ConsistencyError
otherwise), at staleness 0 and 1, with BatchNorm buffers, and across a worker killed mid-training."""

import os
import sys

import pytest
import torch
from pyspark import cloudpickle
from torch import nn

from dying import DiesOnce
from gradshare import SharedTrainer
from gradshare.config.options import FaultTolerance, Network
from gradshare.demo import evaluate_accuracy, mlp
from gradshare.driver.plan import forwarding_for
from gradshare.driver.policy import AGGREGATE_FROM
from lab.flat_options import in_groups

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


def _fit(digits_rdd, model=mlp, **kw):
    rdd, (X_test, y_test) = digits_rdd
    result = SharedTrainer(
        model,
        batch_size=32,
        epochs=kw.pop("epochs", 4),
        seed=3,
        port=0,
        verbose=0,
        **in_groups({"bind": "127.0.0.1", "forwarding": "aggregate", **kw}),
    ).fit(rdd)
    return result, evaluate_accuracy(result.model, X_test, y_test)


def _check_aggregated(result) -> None:
    assert result.extra["forwarding"] == "aggregate"
    assert all(rep["param_hash"] == result.param_hash for rep in result.worker_reports)
    c = result.counters
    assert c["aggregates"] == result.steps  # one message per step of the log (every attempt's) ...
    for rep in result.worker_reports:  # ... and each rank applied exactly those
        assert rep["applied"] == result.steps - rep["start_step"]


def test_aggregated_fit_is_bit_identical_and_learns_at_staleness_0_and_1(digits_rdd):
    a, acc_a = _fit(digits_rdd, epochs=3)
    _check_aggregated(a)
    assert acc_a > 0.75 and a.history[-1]["loss"] < 0.75 * a.history[0]["loss"]
    s1, acc_s1 = _fit(digits_rdd, staleness=1, epochs=2)
    _check_aggregated(s1)
    assert acc_s1 > 0.6 and s1.param_hash != a.param_hash


def test_an_early_stop_travels_in_the_aggregate(digits_rdd):
    # rank 0 asks after epoch 0; the decision rides in rank 0's meta to the relay, which carries it in
    # the step's aggregate: every rank stops after the same epoch (else the hashes would differ)
    r, _ = _fit(digits_rdd, epochs=4, on_epoch_end=lambda row: row["epoch"] == 0)
    _check_aggregated(r)
    stopped = r.extra["stopped_epoch"]
    assert stopped is not None and stopped < 3
    assert [h["epoch"] for h in r.history] == list(range(stopped + 1))
    assert all(rep["stopped_epoch"] == stopped for rep in r.worker_reports)


class BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def test_aggregated_fit_carries_batchnorm_statistics_whole(digits_rdd):
    torch.manual_seed(0)
    r, acc = _fit(digits_rdd, model=BatchNormMLP, epochs=2)
    _check_aggregated(r)
    bn = r.model.net[1]
    # the running statistics moved (they travel in the aggregate's buffer section, summed), and
    # every replica has the same bits of them (the hash covers parameters and float buffers)
    assert float(bn.running_var.sub(1).abs().max()) > 0.01 and acc > 0.6


def test_a_capped_aggregated_fit_with_batchnorm_at_staleness_2_is_bit_identical(digits_rdd):
    torch.manual_seed(0)
    capped, acc = _fit(digits_rdd, model=BatchNormMLP, epochs=2, staleness=2, step_cap=0.01)
    _check_aggregated(capped)  # the relay and every replica applied each aggregate capped alike
    torch.manual_seed(0)
    plain, _ = _fit(digits_rdd, model=BatchNormMLP, epochs=2, staleness=2, step_cap=None)
    assert capped.param_hash != plain.param_hash and acc > 0.3


def test_an_aggregated_fit_with_the_workers_momentum_off_under_a_scheduler_at_staleness_2_is_bit_identical(digits_rdd):
    def one_cycle(optimizer):  # cycles Adam's β1 every step: "off" overrules it for each step only
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=200)

    torch.manual_seed(0)
    off, acc = _fit(
        digits_rdd, model=BatchNormMLP, epochs=2, staleness=2, lr_scheduler=one_cycle, optimizer_momentum="off"
    )
    _check_aggregated(off)  # the relay and every replica agree, BatchNorm statistics included
    torch.manual_seed(0)
    kept, _ = _fit(digits_rdd, model=BatchNormMLP, epochs=2, staleness=2, lr_scheduler=one_cycle)
    assert off.param_hash != kept.param_hash and acc > 0.3


def test_aggregated_fit_resumes_after_a_worker_dies(digits_rdd, tmp_path):
    marker = str(tmp_path / "died")
    r, acc = _fit(digits_rdd, model=lambda: DiesOnce(marker), epochs=3)
    assert os.path.exists(marker) and r.resumed_from >= 1
    _check_aggregated(r)
    assert acc > 0.5


def test_auto_forwarding_aggregates_from_aggregate_from_workers():
    assert forwarding_for("auto", AGGREGATE_FROM - 1) == "per-rank"
    assert forwarding_for("auto", AGGREGATE_FROM) == "aggregate"
    assert forwarding_for("per-rank", 64) == "per-rank" and forwarding_for("aggregate", 2) == "aggregate"
    with pytest.raises(ValueError, match="forwarding must be one of"):
        SharedTrainer(mlp, network=Network(forwarding="tree"))
    with pytest.raises(ValueError, match="cannot be checkpointed"):
        SharedTrainer(
            mlp, network=Network(forwarding="aggregate"), fault_tolerance=FaultTolerance(checkpoint_dir="/tmp/nowhere")
        )
