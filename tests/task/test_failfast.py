"""A deterministic worker error surfaces at once with its real cause (FAIL over the relay, user
objects unpickled inside the worker), and a worker holds the model's weights once (skeleton + snapshot).

Transport parts run on the in-memory harness; the end-to-end parts on the shared local Spark session."""

from __future__ import annotations

import pickle
import sys
import time
import uuid

import numpy as np
import pytest
import torch
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer, TrainingError
from gradshare.config.options import Network
from gradshare.driver.failures import driver_error as _driver_error
from gradshare.replica.flat import FlatParams
from gradshare.task.shipping import materialize, pack_user_objects, skeleton, unpack_user_objects
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.peer.core import PeerCore
from harness import Sim, drive

# Executors cannot import this test module: ship its model classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


# ------------------------------------------------------------------------------------ FAIL on the wire
def _unjoined_peer(sim: Sim, rank: int, attempt: int = 0) -> PeerCore:
    p = PeerCore(rank, sim.W, attempt, sim.key, 42, 1, now=sim.now, datagram_size=sim.datagram_size)
    sim.peers[rank], sim.params[rank], sim.delivered[rank] = p, sim.p0.copy(), []
    return p


def _relay_events(sim: Sim) -> list:
    out = []
    while (e := sim.relay.next_event()) is not None:
        out.append(e)
    return out


def test_fail_from_an_unjoined_rank_is_recorded_once_and_acknowledged_over_a_lossy_link():
    sim = Sim(world_size=2, seed=4, loss=0.4, dup=0.2, max_delay=0.005, datagram_size=256)
    sim.add_peer(0)
    p = _unjoined_peer(sim, 1, attempt=0)
    long = "No module named 'driver_only' " + "x" * 1000  # cut to fit one 256-byte datagram
    p.fail("ModuleNotFoundError", long, sim.now)
    drive(sim, lambda: p.fail_acked)
    for _ in range(50):  # retransmissions and duplicates still in flight change nothing
        sim.step_time()
    failed = [e for e in _relay_events(sim) if isinstance(e, ev.PeerFailed)]
    assert len(failed) == 1 and sim.relay.counts["failures"] == 1
    f = sim.relay.admission.failures[1]
    assert (f.rank, f.attempt, f.error_type) == (1, 0, "ModuleNotFoundError")
    assert f.message.startswith("No module named 'driver_only' xx") and len(f.message) < len(long)
    assert sim.relay.chan.drops["oversized"] == 0


def test_fail_with_a_body_naming_another_rank_or_a_wrong_key_is_dropped():
    sim = Sim(world_size=2, seed=1)
    p0 = _unjoined_peer(sim, 0)
    body = wire.encode_control(ev.Fail(1, 0, "ValueError", "forged"))[1]
    sim.relay.receive_datagram(p0.chan.seal(wire.Kind.FAIL, body), "a", 0.0)  # rank 0 speaking for rank 1
    assert sim.relay.chan.drops["bad_fail"] == 1
    stranger = PeerCore(1, 2, 0, b"z" * 32, 42, 1, now=0.0, datagram_size=sim.datagram_size)
    stranger.fail("ValueError", "not our job key", 0.0)
    for data in stranger.datagrams_to_send():
        sim.relay.receive_datagram(data, "b", 0.0)
    assert sim.relay.chan.drops["auth_failed"] == 1
    assert sim.relay.admission.failures == {} and sim.relay.datagrams_to_send() == []


def test_fail_names_are_bounded():
    with pytest.raises(ValueError, match="message must be a str of at most"):
        ev.Fail(0, 0, "ValueError", "x" * (ev.MAX_ERROR_TEXT + 1))
    with pytest.raises(ValueError, match="error_type"):
        ev.Fail(0, 0, "", "empty type")


def test_snapshot_in_large_datagrams_lands_in_the_callers_buffer_over_a_lossy_link():
    from gradshare.transport.protocol.relay.core import RelayCore
    from gradshare.transport.protocol.tuning import RelayTuning
    from transport_util import TOY

    sim = Sim(world_size=1, n_params=20_000, seed=6, loss=0.1, dup=0.1, max_delay=0.003, datagram_size=400)
    sim.relay = RelayCore(
        sim.p0,
        1,
        sim.key,
        42,
        now=0.0,
        datagram_size=400,
        tuning=RelayTuning(snapshot_datagram_size=4000, snapshot_burst=16_000),
        **TOY,
    )
    p = sim.add_peer(0)
    drive(sim, lambda: p.state == "joined")
    into = np.zeros(sim.N, np.float32)
    p.snaps.into = into
    p.request_snapshot(sim.now)
    drive(sim, lambda: p.snaps.result is not None, max_iters=200_000)
    step, params = p.snaps.result
    assert step == -1 and params is into and np.array_equal(into, sim.p0)
    chunk = sim.relay.snaps.chunk_bytes
    assert 3900 < chunk <= 4000 - 42 and chunk % 4 == 0  # ten times the update chunks' payload
    assert sim.relay.counts["snapshot_chunks"] >= -(-4 * sim.N // chunk)


# ------------------------------------------------------------------------------------ driver's message
def test_driver_error_names_the_last_python_error_of_a_spark_failure():
    spark_text = (
        "An error occurred while calling o123.collectAndServe.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a "
        "failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task "
        "ResultTask(4, 1) finished unsuccessfully.\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "/x/pyspark/worker.py", line 1900, in main\n'
        "    func, profiler, deserializer, serializer = read_command(pickleSer, infile)\n"
        "pyspark.serializers.SerializationError: Caused by Traceback (most recent call last):\n"
        '  File "/x/pyspark/serializers.py", line 193, in _read_with_length\n'
        "    return self.loads(obj)\n"
        "ModuleNotFoundError: No module named 'driver_only_models'\n"
        "\n\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException\n"
    )
    err = _driver_error(RuntimeError(spark_text), relay=None)
    assert isinstance(err, TrainingError)
    assert "ModuleNotFoundError: No module named 'driver_only_models'" in str(err)


# ------------------------------------------------------------------------------------ shipping
class WithIntBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.tied = self.lin  # a shared module: its parameters must stay shared
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))

    def forward(self, x):
        return self.tied(x)


def test_skeleton_ships_no_weights_and_materializes_into_the_same_layout():
    model = WithIntBuffer()
    flat = FlatParams(model)
    before = flat.array.copy()
    skel = skeleton(model, flat.params)
    assert all(p.is_meta for p in skel.parameters())
    assert skel.count.item() == 7 and not skel.count.is_meta  # a non-float buffer keeps its value
    assert np.array_equal(flat.array, before)  # the original is untouched
    data = cloudpickle.dumps(skel)
    big = nn.Linear(1000, 1000)
    assert len(cloudpickle.dumps(skeleton(big, list(big.parameters())))) < 10_000  # 1 M params: a few kB
    worker_model = materialize(pickle.loads(data))
    assert worker_model.tied.weight is worker_model.lin.weight
    worker_flat = FlatParams(worker_model)
    assert worker_flat.n_params == flat.n_params and worker_flat.names == flat.names
    worker_flat.load(before)
    out = worker_model(torch.ones(2, 4))
    assert torch.equal(out, model(torch.ones(2, 4)))


def test_user_objects_travel_as_bytes_and_unpack_in_the_worker():
    from worker_configs import worker_config

    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=b"k" * 32,
        job_id=1,
        world_size=1,
        model=WithIntBuffer(),
        loss=nn.MSELoss(),
        optimizer=lambda p: torch.optim.SGD(p, 0.1),
        threshold_rule=None,
        residual_clip=None,
        steps_per_epoch=(1,),
        epochs=1,
        batch_size=1,
        staleness=0,
        seed=0,
        label_dtype="float32",
        metric=lambda o, y: 1.0,
    )
    packed = pack_user_objects(cfg)
    assert packed.user is None and isinstance(packed.user_objects, bytes)
    with pytest.raises(ValueError, match="still packed"):
        packed.code
    back = unpack_user_objects(packed)
    assert isinstance(back.code.model, WithIntBuffer) and back.code.metric(None, None) == 1.0
    assert back.user_objects is None


# ------------------------------------------------------------------------------------ end to end
def small_rdd(spark, rows=64, parts=2):
    data = [(np.full(3, i % 7, np.float32), i % 2) for i in range(rows)]
    return spark.sparkContext.parallelize(data, parts)


class BoomAtStep3(nn.Module):
    """Rank 1's forward raises at its step 3, on every attempt (a deterministic user error), after
    writing the wall-clock time it raised at to `marker`."""

    def __init__(self, marker):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.marker, self.calls = marker, 0

    def forward(self, x):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == 1 and self.calls == 3:
            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
            raise ValueError("boom at step 3")
        self.calls += 1
        return self.lin(x)


@pytest.mark.spark
def test_a_user_error_at_step_3_surfaces_at_once_with_its_message(spark, tmp_path):
    marker = str(tmp_path / "raised_at")
    with pytest.raises(ValueError, match=r"^worker rank 1 failed: ValueError: boom at step 3$"):
        SharedTrainer(lambda: BoomAtStep3(marker), batch_size=4, epochs=3, **LOOPBACK).fit(small_rdd(spark))
    # From the raise to the driver's error, not from fit(): a cold Python worker spends seconds importing
    # torch and loading kernels before step 0 whatever happens after. Spark's stage retries took 35-55 s.
    with open(marker) as f:
        latency = time.time() - float(f.read())
    assert latency < 10, f"the error surfaced {latency:.1f} s after it was raised"
    _assert_slots_free(spark)


def _assert_slots_free(spark):
    """The cancelled job's tasks are gone when fit raises: the next fit finds its slots."""
    from gradshare.driver.session import busy_slots

    sc = spark.sparkContext
    assert not sc.statusTracker().getActiveJobsIds() and busy_slots(sc) == 0


DRIVER_ONLY = """
from torch import nn


class DriverOnlyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)
"""


@pytest.mark.spark
def test_a_model_class_the_executors_cannot_import_is_named(spark, tmp_path):
    # the executors' PYTHONPATH is fixed when the session starts (spark.executorEnv.PYTHONPATH,
    # gradshare/driver/session.py); this directory is only on the driver's sys.path
    name = f"driver_only_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(DRIVER_ONLY)
    sys.path.insert(0, str(tmp_path))
    try:
        module = __import__(name)
        rdd = small_rdd(spark)
        rdd.count()
        t0 = time.monotonic()
        with pytest.raises(
            TrainingError, match=rf"worker rank \d failed: ModuleNotFoundError: No module named '{name}'"
        ):
            SharedTrainer(module.DriverOnlyNet, batch_size=4, **LOOPBACK).fit(rdd)
        assert time.monotonic() - t0 < 10
        _assert_slots_free(spark)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def wide_mlp():
    return nn.Sequential(nn.Linear(64, 2500), nn.ReLU(), nn.Linear(2500, 2500), nn.ReLU(), nn.Linear(2500, 10))


# parameters, gradients and the residual folded into the local view's point (P + r, local_view.py)
# are 3x; the rest is slack for the allocator
SGD_MULTIPLE = 5.0


def _growth(report) -> int:
    assert report["start_rss_bytes"] > 0, "no /proc/self/clear_refs here: peak RSS cannot be measured"
    return report["peak_rss_bytes"] - report["start_rss_bytes"]


@pytest.mark.spark
def test_worker_peak_memory_stays_near_the_training_state(spark):
    """6.4 M parameters with SGD: a worker's peak RSS over its process's baseline stays under
    SGD_MULTIPLE x the parameter bytes. When the model's weights rode in it, the job's closure (pickled model
    bytes and the unpickled model, about 2x; benchmarks/worker_memory.py) came on top of the 3x of training state."""
    from gradshare.demo import digits_split

    X, _, y, _ = digits_split(0)
    rdd = spark.sparkContext.parallelize(list(zip(X[:256], (int(v) for v in y[:256]))), 2).cache()
    rdd.count()
    # A tiny fit first: it pays a fresh Python worker's imports and kernel loading (~150 MB, which would
    # dwarf the model); its peak is the process's RSS before the wide job's closure arrives.
    warm = SharedTrainer(lambda: nn.Linear(64, 10), batch_size=64, **LOOPBACK).fit(rdd)
    process_rss = {r["pid"]: r["peak_rss_bytes"] for r in warm.worker_reports}
    imports = max(_growth(r) for r in warm.worker_reports)
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    result = SharedTrainer(wide_mlp, optimizer=sgd, batch_size=64, **LOOPBACK).fit(rdd)
    param_bytes = 4 * result.n_params
    for r in result.worker_reports:
        if r["pid"] in process_rss:  # the same Python worker as the warm-up task
            used = r["peak_rss_bytes"] - process_rss[r["pid"]]
        else:  # a fresh one: the task's own start (closure included), less the imports
            used = _growth(r) - imports
        assert used / param_bytes < SGD_MULTIPLE, f"rank {r['rank']} used {used / param_bytes:.2f} x parameter bytes"
