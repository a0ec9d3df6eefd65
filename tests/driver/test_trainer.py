"""SharedTrainer end to end on the real local Spark session: acceptance, determinism,
staleness, DataFrames, bad input and failures (each a clear driver-side error, nothing left running),
a worker killed mid-training, and local-cluster in a subprocess (a JVM holds one SparkContext)."""

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from pyspark import cloudpickle
from torch import nn

from dying import DiesOnce
from gradshare import ConsistencyError, SharedTrainer, TrainingError, TransportTimeout  # noqa: F401
from gradshare.config.options import Network, Runtime
from gradshare.demo import digits_experiment, digits_split, evaluate_accuracy, mlp
from lab.flat_options import in_groups

# Executors cannot import this test module: ship its model classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the repo
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


def _threads():
    return {t.ident for t in threading.enumerate()}


def assert_nothing_left(spark, before_threads):
    """No Spark job, no gradshare thread left (relay/peer threads end when closed)."""
    sc = spark.sparkContext
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before_threads and t.is_alive()]
        ours = [t for t in extra if not t.name.startswith(("Thread-", "py4j", "pyspark"))]
        if not sc.statusTracker().getActiveJobsIds() and not ours:
            return
        time.sleep(0.2)
    raise AssertionError(f"left running: jobs {sc.statusTracker().getActiveJobsIds()}, threads {ours}")


# ------------------------------------------------------------------------------------ acceptance
def test_digits_two_workers_match_single_process_at_a_fraction_of_the_traffic(spark):
    out = digits_experiment(spark, workers=2, epochs=30, port=0, bind="127.0.0.1")
    r = out["result"]
    assert abs(out["gp_accuracy"] - out["single_accuracy"]) <= 0.015, out
    assert out["gp_accuracy"] > 0.9
    assert r.traffic_ratio >= 50, (r.bytes_sent, r.bytes_received, r.dense_bytes)
    assert r.bytes_sent > 0 and r.bytes_received > 0  # measured, not assumed
    assert [h["epoch"] for h in r.history] == list(range(30))
    assert r.history[-1]["loss"] < r.history[0]["loss"]
    assert all(rep["param_hash"] == r.param_hash for rep in r.worker_reports)
    assert r.history[-1]["val_metric"] is not None and r.resumed_from == 0
    # the trained model saves and loads the torch way
    buf = io.BytesIO()
    torch.save(r.model.state_dict(), buf)
    buf.seek(0)
    fresh = mlp()
    fresh.load_state_dict(torch.load(buf))
    X_test = torch.from_numpy(digits_split(0)[1])
    assert torch.equal(fresh(X_test), r.model(X_test))


def _fit_digits(digits_rdd, **kw):
    rdd, (X_test, y_test) = digits_rdd
    result = SharedTrainer(mlp, batch_size=32, epochs=kw.pop("epochs", 6), seed=3, **in_groups({**LOOPBACK, **kw})).fit(
        rdd
    )  # grouped options named flat
    return result, evaluate_accuracy(result.model, X_test, y_test)


def test_same_seed_gives_identical_parameters_and_staleness_two_converges_bit_identical(digits_rdd):
    a, acc_a = _fit_digits(digits_rdd)
    # A spilled partition streams in its own seeded block order (gradshare/task/spill.py), not the in-memory
    # permutation: with the same seed it trains bit-identically again and learns as well, but not
    # bit-identically to the in-memory run `a`.
    b, acc_b = _fit_digits(digits_rdd, spill_bytes=4096)
    b2, _ = _fit_digits(digits_rdd, spill_bytes=4096)
    assert all(r["spilled"] for r in b.worker_reports) and not any(r["spilled"] for r in a.worker_reports)
    assert b.param_hash == b2.param_hash != a.param_hash and acc_b > 0.85
    for pb, pb2 in zip(b.model.parameters(), b2.model.parameters()):
        assert torch.equal(pb, pb2)
    s2, acc_s2 = _fit_digits(digits_rdd, staleness=2)
    # fit() itself raises ConsistencyError unless every replica's hash equals the relay's
    assert all(rep["param_hash"] == s2.param_hash for rep in s2.worker_reports)
    assert s2.history[-1]["loss"] < 0.5 * s2.history[0]["loss"]
    assert acc_a > 0.85 and acc_s2 > 0.85
    assert s2.param_hash != a.param_hash  # a different trajectory, not a no-op option


def test_profiled_workers_train_the_same_and_account_for_their_steps(digits_rdd):
    from gradshare.task.profiling import PHASES
    from lab.profile import summarise

    _, (X_test, y_test) = digits_rdd
    plain, _ = _fit_digits(digits_rdd, epochs=2, staleness=1)
    timed, _ = _fit_digits(
        digits_rdd, epochs=2, staleness=1, validation_data=(X_test, y_test), worker_options={"profile": True}
    )
    assert timed.param_hash == plain.param_hash  # the timers do not change what is trained
    assert "profile" not in plain.worker_reports[0]
    general, acc = _fit_digits(digits_rdd, epochs=2, staleness=1, worker_options={"direct_update": False})
    assert {r["update_path"] for r in plain.worker_reports} == {"direct"}  # default Adam writes into the residual
    assert {r["update_path"] for r in general.worker_reports} == {"general"}
    assert all(rep["param_hash"] == general.param_hash for rep in general.worker_reports)
    assert general.param_hash != plain.param_hash and acc > 0.5  # measured against a twin: other rounding
    for rep in timed.worker_reports:
        prof = rep["profile"]
        steps = prof["steps"]
        assert set(steps) == {*PHASES, "wall", "cpu"}
        assert all(len(v) == rep["steps_run"] for v in steps.values())
        walls = np.array(steps["wall"])
        phases = np.sum([steps[p] for p in PHASES], axis=0)
        assert np.all(np.array([steps[p] for p in PHASES]) >= 0) and np.all(phases <= walls)
        assert np.sum(steps["compute"]) > 0 and np.sum(steps["encode"]) > 0
        assert np.all(np.array(steps["cpu"]) <= walls + 0.02)  # thread CPU clock: coarser than perf_counter
        assert prof["threads_cpu"]["(calling thread)"] > 0 and any(
            k.startswith("gradshare-peer") for k in prof["threads_cpu"]
        )
        # /proc/net/dev is always readable on Linux (None only where it does not exist). The counter
        # spans the steps and counts the whole namespace; the first epoch's updates were surely sent
        # within it (with k = 1 the second epoch's steps wait for them), so they bound it from below.
        first = rep["history"][0]["payload_bytes"]
        assert isinstance(prof["lo_tx_bytes"], int) and prof["lo_tx_bytes"] >= first > 0
        if rep["rank"] == 0:  # the validation curve against training time: one point per epoch
            assert [a for _, a in prof["curve"]] == [h["val_metric"] for h in rep["history"]]
            clocks = [c for c, _ in prof["curve"]]
            assert clocks[0] < clocks[1] and clocks[1] == pytest.approx(walls.sum())
    s = summarise(timed.worker_reports[0]["profile"]["steps"], warmup=2)
    assert s["other"] == pytest.approx(s["wall"] - sum(s[p] for p in ("compute", "encode", "send", "wait", "apply")))
    assert s["compute"] == pytest.approx(
        sum(s["detail"][p] for p in ("batch", "lookahead", "compute", "snapshot", "optimizer"))
    )


def test_worker_options_are_checked_by_name():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['profil'\]"):
        SharedTrainer(mlp, runtime=Runtime(worker_options={"profil": True}))
    with pytest.raises(ValueError, match=r"worker_options\['direct_update'\] must be True or False"):
        SharedTrainer(mlp, runtime=Runtime(worker_options={"direct_update": "no"}))


def test_dataframe_with_vector_and_array_columns(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    vec = spark.createDataFrame([(Vectors.dense(x.tolist()), float(v)) for x, v in zip(X, y)], ["features", "label"])
    arr = spark.createDataFrame([(x.tolist(), int(v)) for x, v in zip(X, y)], ["f", "y"])
    model = lambda: nn.Linear(4, 2)  # noqa: E731
    for df, cols, dtype in ((vec, ("features", "label"), "int64"), (arr, ("f", "y"), None)):
        r = SharedTrainer(model, epochs=2, batch_size=8, **LOOPBACK, runtime=Runtime(label_dtype=dtype)).fit(
            df.repartition(2), features_col=cols[0], label_col=cols[1]
        )
        assert r.world_size == 2 and r.steps == 2 * 4
    with pytest.raises(ValueError, match=r"no column\(s\) \['nope'\]"):
        SharedTrainer(model, **LOOPBACK).fit(arr, features_col="nope", label_col="y")
    with pytest.raises(ValueError, match="features_col= and label_col="):
        SharedTrainer(model, **LOOPBACK).fit(arr)


def test_fewer_workers_than_partitions_trains_on_every_row(spark):
    """num_workers below the partition count: the rows are reshuffled into that many partitions (a
    coalesced parent is refused by Spark's barrier scheduler, SPARK-24820) and none is lost."""
    rdd = small_rdd(spark, rows=[(np.full(3, i, np.float32), i % 2) for i in range(32)], parts=4)
    r = SharedTrainer(tiny_model, num_workers=2, epochs=1, batch_size=4, **LOOPBACK).fit(rdd)
    assert r.world_size == 2
    # 32 rows in batches of 4 on two ranks: 8 steps in all, 9 when the split is not a multiple of 4
    assert sum(w["steps_run"] for w in r.worker_reports) in (8, 9)


# ------------------------------------------------------------------------------------ bad input
def small_rdd(spark, rows=None, parts=2):
    if rows is None:
        rows = [(np.full(3, i, np.float32), i % 2) for i in range(16)]
    return spark.sparkContext.parallelize(rows, parts)


def tiny_model():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 2), requires_grad=False)

    def forward(self, x):
        return x @ self.w


class Exploding(nn.Module):
    """Raises inside the task whenever a batch holds the row of value 5, so every retried attempt fails too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        if bool((x == 5).any()):
            raise RuntimeError("user model exploded on purpose")
        return self.lin(x)


def _bad_cases(spark):
    good = [(np.zeros(3, np.float32), 1)] * 8
    return [
        ("slots", dict(num_workers=3), small_rdd(spark), ValueError, r"3 workers need 3 free slots.*2 slots"),
        (
            "empty",
            {},
            small_rdd(spark, good, 1).union(spark.sparkContext.parallelize([], 1)),
            ValueError,
            "partition 1 is empty",
        ),
        (
            "shapes",
            {},
            small_rdd(spark, good[:7] + [(np.zeros(5, np.float32), 1)], 2),
            ValueError,
            r"partition 1 row 3: features of shape \(5,\)",
        ),
        (
            "label",
            {},
            small_rdd(spark, good[:5] + [(np.zeros(3, np.float32), "seven")] + good[:2], 2),
            TypeError,
            "partition 1 row 1: label 'seven'",
        ),
        ("frozen", dict(model=Frozen), small_rdd(spark), ValueError, "no trainable parameters"),
        (
            "user",
            dict(model=Exploding),
            small_rdd(spark),
            TrainingError,
            r"worker rank \d failed: RuntimeError: user model exploded on purpose",
        ),
        (
            "unreachable",
            dict(advertise_host="127.0.0.2", timeout=2.0),
            small_rdd(spark),
            TransportTimeout,
            r"worker rank \d failed: TransportTimeout: .*127\.0\.0\.2",
        ),
    ]


@pytest.mark.parametrize("case", ["slots", "empty", "shapes", "label", "frozen", "user", "unreachable"])
def test_bad_input_and_failures_are_clear_driver_errors(spark, case):
    name, kw, rdd, exc, pattern = next(c for c in _bad_cases(spark) if c[0] == case)
    kw = in_groups({**LOOPBACK, "batch_size": 2, **kw})  # grouped options named flat
    model = kw.pop("model", tiny_model)
    before = _threads()
    with pytest.raises(exc, match=pattern):
        SharedTrainer(model, **kw).fit(rdd)
    assert_nothing_left(spark, before)


def test_port_in_use_is_named_and_nothing_is_left(spark):
    busy = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    busy.bind(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    before = _threads()
    try:
        with pytest.raises(OSError, match=str(port)):
            SharedTrainer(tiny_model, port=port, verbose=0, network=Network(bind="127.0.0.1")).fit(small_rdd(spark))
    finally:
        busy.close()
    assert_nothing_left(spark, before)


class MutatesItself(nn.Module):
    """A user bug: rank 1 changes a weight in place outside the optimizer, so its replica leaves the log."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        from pyspark import TaskContext

        if TaskContext.get().partitionId() == 1:
            with torch.no_grad():
                self.lin.bias += 0.5
        return self.lin(x)


def test_replica_that_diverges_is_a_consistency_error(spark):
    before = _threads()
    with pytest.raises(ConsistencyError, match=r"replicas diverged from the relay .*rank 1 has"):
        SharedTrainer(MutatesItself, batch_size=4, **LOOPBACK).fit(small_rdd(spark))
    assert_nothing_left(spark, before)


# ------------------------------------------------------------------------------------ restart
def test_worker_killed_mid_training_resumes_from_the_relay(digits_rdd, tmp_path):
    rdd, (X_test, y_test) = digits_rdd
    marker = str(tmp_path / "died")
    result = SharedTrainer(lambda: DiesOnce(marker), epochs=3, batch_size=32, **LOOPBACK).fit(rdd)
    assert os.path.exists(marker)  # the first attempt really died
    per_epoch = max(result.worker_reports, key=lambda r: r["last_step"])["last_step"] // 3 + 1
    assert result.resumed_from >= 1  # the retried stage continued, it did not start over
    assert all(r["start_step"] == result.resumed_from for r in result.worker_reports)
    assert result.steps == 3 * per_epoch  # the step count continued to the planned end
    assert all(r["param_hash"] == result.param_hash for r in result.worker_reports)
    assert evaluate_accuracy(result.model, X_test, y_test) > 0.5
    # liveness: the history keeps the killed attempt's steps; every epoch is whole (30 of 44 before)
    spe = [-(-len(p) // 32) for p in rdd.glom().collect()]
    assert [h["epoch"] for h in result.history] == [0, 1, 2]
    assert [h["steps"] for h in result.history] == [sum(spe)] * 3
    assert result.skipped_steps == 0 == sum(h["skipped_steps"] for h in result.history)
    assert result.resumed_from // spe[1] == 1  # the retried stage resumed inside epoch 1, which says so
    assert [h["resumed"] for h in result.history] == [False, True, False]
    assert all(h["loss"] > 0 and h["lr"] == pytest.approx(1e-3) for h in result.history)


# ------------------------------------------------------------------------------------ local-cluster
LOCAL_CLUSTER = r"""
import json, sys
from gradshare.driver.session import get_or_create_session
from gradshare.demo import digits_experiment
spark, _ = get_or_create_session(master="local-cluster[2,1,1024]")
try:
    out = digits_experiment(spark, workers=2, epochs=2, port=0, bind="127.0.0.1", single=False)
    r = out["result"]
    print(json.dumps({"acc": out["gp_accuracy"], "packages": [w["package"] for w in r.worker_reports],
                      "pids": [w["pid"] for w in r.worker_reports], "steps": r.steps}))
finally:
    spark.stop()
"""


def test_local_cluster_separate_executor_jvms():
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [sys.executable, "-c", LOCAL_CLUSTER], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["packages"] == [os.path.join(ROOT, "gradshare")] * 2  # executors run this tree
    assert len(set(out["pids"])) == 2 and out["steps"] > 0
    assert out["acc"] > 0.5


# ----------------------------------------------------------------------------------------------- schedules
def _halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)


def test_schedule_and_warmup_keep_replicas_identical_and_runs_deterministic(digits_rdd):
    ramp = dict(warmup=1.0, warmup_density=0.5)  # the demo MLP's floor is 768 of 9,610 entries (8 %)
    a, acc = _fit_digits(digits_rdd, epochs=4, lr_scheduler=_halving, **ramp)
    b, _ = _fit_digits(digits_rdd, epochs=4, lr_scheduler=_halving, **ramp)
    assert a.param_hash == b.param_hash  # k = 0, same seed: the same run, schedule and ramp included
    assert all(rep["param_hash"] == a.param_hash for rep in a.worker_reports)  # (fit checks it too)
    lrs = [h["lr"] for h in a.history]
    assert lrs[0] == pytest.approx(1e-3) and all(x > y for x, y in zip(lrs, lrs[1:]))  # the schedule ran
    density = [h["sparsity"] for h in a.history]
    assert density[0] > 2 * density[-1]  # the warm-up's first epoch sends more
    assert sum(h["silent_steps"] for h in a.history) == 0
    assert acc > 0.7  # it learns (the lr is 1/16 of its start by the end: the accuracy tests are elsewhere)
    per_epoch, _ = _fit_digits(digits_rdd, epochs=4, lr_scheduler=_halving, scheduler_interval="epoch")
    assert [h["lr"] for h in per_epoch.history] == pytest.approx([1e-3] * 4)  # 4 epoch steps < step_size
    assert per_epoch.param_hash != a.param_hash


def test_lr_batch_size_reaches_every_worker_and_the_history_keeps_the_lr_given(digits_rdd):
    scaled, _ = _fit_digits(digits_rdd, epochs=2, lr_batch_size=128)  # × (32 ÷ 128) ** ½ = ½
    halved, _ = _fit_digits(digits_rdd, epochs=2, optimizer=lambda p: torch.optim.Adam(p, lr=5e-4, fused=True))
    plain, _ = _fit_digits(digits_rdd, epochs=2)
    assert scaled.param_hash == halved.param_hash != plain.param_hash  # every step at lr 1e-3 × ½, bit for bit
    assert all(rep["param_hash"] == scaled.param_hash for rep in scaled.worker_reports)
    assert [h["lr"] for h in scaled.history] == pytest.approx([1e-3, 1e-3])  # the optimizer's lr, as given


def test_mean_aggregation_keeps_replicas_and_relay_identical(digits_rdd):
    summed, _ = _fit_digits(digits_rdd, epochs=2)
    mean, acc = _fit_digits(digits_rdd, epochs=2, aggregate="mean")
    # every replica and the relay applied each message × 1/2 (fit raises ConsistencyError otherwise)
    assert all(rep["param_hash"] == mean.param_hash for rep in mean.worker_reports)
    assert mean.param_hash != summed.param_hash  # the option reached the apply, not a no-op
    assert acc > 0.5


class _NotAScheduler:
    def __init__(self, opt):
        self.opt = opt


@pytest.mark.parametrize(
    "kwargs, error, match",
    [  # groups as dicts: made inside the raises block
        ({"lr_scheduler": "cosine"}, TypeError, "lr_scheduler must be a factory"),
        ({"runtime": {"scheduler_interval": "batch"}}, ValueError, "scheduler_interval"),
        ({"threshold": "auto", "compression": {"threshold_algorithm": "fixed"}}, ValueError, "contradicts"),
        ({"threshold": 1e-3, "compression": {"density": 1e-2}}, ValueError, "density tune threshold='auto'"),
        ({"threshold": 1e-3, "compression": {"warmup": 1}}, ValueError, "warmup tune"),
        ({"threshold": "fast"}, ValueError, "'auto' or a positive"),
        ({"compression": {"density": 0.0}}, ValueError, "density"),
        ({"compression": {"warmup": -1}}, ValueError, "warmup"),
        ({"compression": {"aggregate": "avg"}}, ValueError, "aggregate must be 'sum' or 'mean'"),
    ],
)
def test_bad_convergence_options_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        SharedTrainer(mlp, **kwargs)


@pytest.mark.parametrize(
    "factory, error, match",
    [
        (_NotAScheduler, TypeError, "must return a torch.optim.lr_scheduler.LRScheduler"),
        (lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt), ValueError, "ReduceLROnPlateau"),
        (
            lambda opt: torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), 5),
            ValueError,
            "bound to another optimizer",
        ),
    ],
)
def test_a_bad_scheduler_fails_before_any_spark_job(digits_rdd, spark, factory, error, match):
    rdd, _ = digits_rdd
    tracker = spark.sparkContext.statusTracker()
    jobs = set(tracker.getJobIdsForGroup(None))
    with pytest.raises(error, match=match):
        SharedTrainer(mlp, lr_scheduler=factory, **LOOPBACK).fit(rdd)
    assert set(tracker.getJobIdsForGroup(None)) == jobs
