"""A model too large for a worker is refused on the driver before training starts (driver/capacity.py): the
optimizer's state measured by stepping its own factory, the budget read from the session's configuration,
and the refusal naming the model's size, the bytes a parameter and the limit."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gradshare import MemoryLimitError, SharedTrainer
from gradshare.config.options import Network
from gradshare.driver import capacity
from gradshare.driver.capacity import check_fits, optimizer_state_bytes, parse_bytes, worker_budget

MIB, GIB = 1 << 20, 1 << 30


@pytest.mark.parametrize(
    "factory, held",
    [
        (lambda p: torch.optim.Adam(p, lr=1e-3), 8),
        (lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), 8),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 4),
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.Adagrad(p, lr=0.1), 4),
    ],
    ids=["adam", "adamw-fused", "sgd-momentum", "sgd", "adagrad"],
)
def test_the_optimizer_state_an_entry_holds_is_measured_on_the_factory_itself(factory, held):
    assert optimizer_state_bytes(factory) == held


def test_a_factory_the_probe_cannot_step_counts_no_state():
    def two_groups_only(params):
        a, b = params  # needs two tensors: the single probe cannot build it
        return torch.optim.Adam([a, b])

    assert optimizer_state_bytes(two_groups_only) == 0


def test_spark_sizes_read_as_spark_reads_them():
    assert parse_bytes("4g") == 4 * GIB and parse_bytes("512m") == 512 * MIB and parse_bytes("1024k") == MIB
    assert parse_bytes("2048") == 2048 * MIB and parse_bytes("1.5g") == int(1.5 * GIB) and parse_bytes("3GB") == 3 * GIB


def conf_of(**values):
    table = {k.replace("_", "."): v for k, v in values.items()}
    return table.get


def test_the_budget_is_what_each_python_worker_may_hold_under_each_master():
    # spark.executor.pyspark.memory limits each Python worker, whatever the master
    budget = worker_budget(conf_of(spark_master="yarn", spark_executor_pyspark_memory="2g"), 8, None)
    assert budget == (2 * GIB, "spark.executor.pyspark.memory=2g")
    # a local master runs every worker on this host: its available memory split over them
    size, said = worker_budget(conf_of(spark_master="local[4]"), 4, 8 * GIB)
    assert size == 2 * GIB and "split over 4 workers" in said
    assert worker_budget(conf_of(spark_master="local[4]"), 4, None) is None
    assert worker_budget(conf_of(spark_master="spark://10.0.0.1:7077"), 4, 8 * GIB) is None  # no container
    # YARN / Kubernetes: Python lives in the overhead, shared by the executor's concurrent tasks
    size, said = worker_budget(
        conf_of(spark_master="yarn", spark_executor_memoryOverhead="1g", spark_executor_cores="4"), 8, None
    )
    assert size == 256 * MIB and "spark.executor.memoryOverhead=1g" in said and "4 task(s)" in said
    size, said = worker_budget(conf_of(spark_master="k8s://https://api:6443", spark_executor_memory="8g"), 8, None)
    assert size == int(8 * GIB * 0.10) and "default" in said
    size, _ = worker_budget(conf_of(spark_master="yarn"), 8, None)  # 1g heap: the 384 MiB floor
    assert size == 384 * MIB
    with pytest.raises(ValueError, match=r"spark.executor.memoryOverhead='lots' is not a size"):
        worker_budget(conf_of(spark_master="yarn", spark_executor_memoryOverhead="lots"), 8, None)


def test_a_model_over_the_budget_is_refused_naming_its_size_the_bytes_a_parameter_and_the_limit():
    with pytest.raises(MemoryLimitError) as refused:
        check_fits(100_000_000, 8, (GIB, "spark.executor.pyspark.memory=1g"))
    said = str(refused.value)
    assert "100,000,000 parameters" in said and "1,526 MiB" in said and "16 bytes a parameter" in said
    assert "1,024 MiB" in said and "spark.executor.pyspark.memory=1g" in said
    check_fits(50_000_000, 8, (GIB, "x"))  # 763 MiB: fits
    check_fits(10**12, 8, None)  # no bound known: nothing to refuse on


@pytest.mark.spark
def test_a_fit_whose_model_cannot_fit_a_worker_fails_before_training(spark, monkeypatch):
    monkeypatch.setattr(capacity, "available_memory", lambda: 4 * MIB)  # this host, as if nearly full
    rows = [(np.full(64, i % 5, np.float32), i % 3) for i in range(64)]
    rdd = spark.sparkContext.parallelize(rows, 2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 3))
    started = time.monotonic()
    # 278,531 parameters × 16 bytes (P, residual, Adam's two moments) = 4.25 MiB against 4 MiB ÷ 2 workers
    with pytest.raises(MemoryLimitError, match=r"278,531 parameters need at least 4 MiB .* more than the 2 MiB"):
        SharedTrainer(model, epochs=1, port=0, verbose=0, network=Network(bind="127.0.0.1")).fit(rdd)
    assert time.monotonic() - started < 60  # the pre-pass ran; no worker trained
