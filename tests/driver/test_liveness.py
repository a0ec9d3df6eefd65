"""Liveness end to end on the real local Spark session: a paused worker process is waited
for and the fit is bit-identical to an undisturbed one; a stuck training thread is named with its step;
a partition that loads 40 s slower joins fine; the restart and continue policies. (A killed worker's
resumed history: tests/driver/test_trainer.py, test_worker_killed_mid_training_resumes_from_the_relay.)"""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer, TrainingError
from gradshare.config.options import FaultTolerance, Network
from gradshare.demo import mlp

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


@pytest.fixture(scope="module")
def digits(digits_rdd):
    return digits_rdd[0]


def _rank():
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return None if ctx is None else ctx.partitionId()


class Pauses(nn.Module):
    """Rank 1's Python worker stops itself (SIGSTOP: the whole process, every thread) in its 10th
    forward; the test continues it after `pause` seconds."""

    def __init__(self, marker):
        super().__init__()
        self.net, self.marker, self.calls = mlp(), marker, 0

    def forward(self, x):
        self.calls += 1
        if _rank() == 1 and self.calls == 10 and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.net(x)


def _continue_after(marker: str, pause: float) -> threading.Thread:
    """SIGCONT the process whose pid `marker` holds, `pause` s after it stopped; nothing if it is gone
    by then (on_rank_loss="restart": Spark killed it for the retry)."""

    def state(pid):
        try:
            return open(f"/proc/{pid}/stat").read().split(") ")[1][0]
        except (FileNotFoundError, ProcessLookupError):
            return None

    def run():
        while not os.path.exists(marker) or not open(marker).read():
            time.sleep(0.01)
        pid = int(open(marker).read())
        while state(pid) not in ("T", None):  # wait until it really stopped
            time.sleep(0.01)
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:
            if state(pid) != "T":
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_paused_worker_is_waited_for_and_the_fit_is_bit_identical(digits, tmp_path):
    marker, liveness = str(tmp_path / "paused"), 1.0
    kw = dict(epochs=1, batch_size=32, seed=5, fault_tolerance=FaultTolerance(liveness_timeout=liveness), **LOOPBACK)
    thread = _continue_after(marker, 2 * liveness)
    paused = SharedTrainer(lambda: Pauses(marker), **kw).fit(digits)
    thread.join(5)
    assert os.path.exists(marker)  # rank 1 really stopped
    calm = SharedTrainer(lambda: Pauses(marker), **kw).fit(digits)  # the marker exists: no pause now
    assert paused.param_hash == calm.param_hash  # k = 0, same seed: the same run, step for step
    assert paused.resumed_from == 0 and paused.skipped_steps == 0 and paused.counters.get("gone", 0) == 0
    assert [h["steps"] for h in paused.history] == [h["steps"] for h in calm.history]
    assert paused.counters["applied"] == calm.counters["applied"] == paused.steps * 2  # every step once
    assert any("rank 1" in i and "suspected" in i for i in paused.extra["incidents"])
    assert any("came back" in i for i in paused.extra["incidents"])


class Hangs(nn.Module):
    """Rank 1's forward never returns from its 5th call (the process keeps answering)."""

    def __init__(self, marker):
        super().__init__()
        self.net, self.marker, self.calls = mlp(), marker, 0

    def forward(self, x):
        self.calls += 1
        if _rank() == 1 and self.calls == 5:
            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
            time.sleep(120)
        return self.net(x)


def test_a_stuck_training_thread_is_named_with_its_step_within_step_timeout(digits, tmp_path):
    marker = str(tmp_path / "stuck")
    with pytest.raises(
        TrainingError,
        match=r"worker rank 1 \(attempt \d+, at step 4\) stuck in step 4: "
        r"no step finished for 2\.\d s \(step_timeout\)",
    ):
        SharedTrainer(
            lambda: Hangs(marker), epochs=1, **LOOPBACK, fault_tolerance=FaultTolerance(step_timeout=2.0)
        ).fit(digits)
    assert time.time() - float(open(marker).read()) < 2.0 + 5.0


class LoadsSlowly:
    """Partition 1's rows arrive 40 s late in the training task (not in the driver's pre-pass)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, index, rows):
        from pyspark import BarrierTaskContext, TaskContext

        if index == 1 and isinstance(TaskContext.get(), BarrierTaskContext):
            time.sleep(self.seconds)
        return rows


def test_a_partition_that_loads_40_s_slower_joins_under_the_default_settings(spark):
    rows = [(np.full(3, (i % 7) * 0.1, np.float32), i % 2) for i in range(64)]
    rdd = spark.sparkContext.parallelize(rows, 2).mapPartitionsWithIndex(LoadsSlowly(40.0))
    t0 = time.monotonic()
    result = SharedTrainer(lambda: nn.Linear(3, 2), epochs=1, batch_size=8, **LOOPBACK).fit(rdd)
    assert time.monotonic() - t0 > 40
    assert result.steps == 4 and result.skipped_steps == 0 and result.counters.get("gone", 0) == 0
    assert [h["steps"] for h in result.history] == [8]


def test_continue_goes_on_without_the_paused_rank_and_counts_what_it_skipped(digits, tmp_path):
    marker = str(tmp_path / "paused")
    _continue_after(marker, 3.0)
    result = SharedTrainer(
        lambda: Pauses(marker),
        epochs=2,
        batch_size=32,
        seed=5,
        **LOOPBACK,
        fault_tolerance=FaultTolerance(liveness_timeout=1.0, on_rank_loss="continue"),
    ).fit(digits)
    spe = [-(-len(p) // 32) for p in digits.glom().collect()]
    assert any("declared gone" in i and "rank 1" in i for i in result.extra["incidents"])
    assert result.skipped_steps > 0
    assert [h["steps"] + h["skipped_steps"] for h in result.history] == [sum(spe)] * 2
    assert sum(h["skipped_steps"] for h in result.history) == result.skipped_steps


def test_restart_retries_the_stage_at_once_and_skips_nothing(digits, tmp_path):
    marker = str(tmp_path / "paused")
    _continue_after(marker, 60.0)  # never, in practice: Spark kills the stopped worker for the retry
    result = SharedTrainer(
        lambda: Pauses(marker),
        epochs=1,
        batch_size=32,
        seed=5,
        **LOOPBACK,
        fault_tolerance=FaultTolerance(liveness_timeout=1.0, on_rank_loss="restart"),
    ).fit(digits)
    spe = [-(-len(p) // 32) for p in digits.glom().collect()]
    assert result.resumed_from > 0 and result.skipped_steps == 0 and result.counters.get("gone", 0) == 0
    assert [h["steps"] for h in result.history] == [sum(spe)] and result.history[0]["resumed"]
    assert any("restarts the stage" in i and "rank 1" in i for i in result.extra["incidents"])
