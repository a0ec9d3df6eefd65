"""The relay inside the Spark job (relay="in-job") on a classic session: the same parameters as the relay in
the driver for the same seed, its status reaching the driver; rank 0's task, which hosts the relay, killed
mid-fit: the stage runs again from the last checkpoint (or from scratch without one) and ends bit-identical
to an uninterrupted fit; a user's error is raised at once, never run again; what the in-job relay cannot
do is refused before any job."""

import os
import sys
import warnings

import pytest
from pyspark import cloudpickle
from torch import nn

from dying import DiesOnce
from gradshare import SharedTrainer
from gradshare.config.options import Compression, FaultTolerance, Network
from gradshare.demo import digits_split, mlp
from gradshare.errors import TrainingError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

pytestmark = pytest.mark.spark
ROWS = 640  # 320 rows a partition: 5 steps an epoch at batch 64


@pytest.fixture(scope="module")
def even(spark):
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train[:ROWS], (int(v) for v in y_train[:ROWS])))
    return spark.sparkContext.parallelize(rows, 2).cache(), (X_test, y_test)


FIT = dict(epochs=4, batch_size=64, seed=3, compression=Compression(warmup=2.0), port=0, verbose=0)


def at(relay, **options):
    """The relay's place, on loopback."""
    return Network(bind="127.0.0.1", relay=relay, **options)


@pytest.fixture(scope="module")
def uninterrupted(even):
    rdd, validation = even
    return SharedTrainer(mlp, validation_data=validation, **FIT, network=at("in-job")).fit(rdd)


def test_the_in_job_relay_gives_the_client_relays_parameters_and_its_status_reaches_the_driver(even, uninterrupted):
    rdd, validation = even
    client = SharedTrainer(mlp, validation_data=validation, **FIT, network=at("client")).fit(rdd)
    job = uninterrupted
    assert job.extra.relay == "in-job" and client.extra.relay == "client" and job.extra.restarts == []
    assert job.param_hash == client.param_hash  # the same log, applied by a relay elsewhere
    assert {r["param_hash"] for r in job.worker_reports} == {job.param_hash}
    assert [h["loss"] for h in job.history] == [h["loss"] for h in client.history]
    assert [h["val_metric"] for h in job.history] == [h["val_metric"] for h in client.history]
    assert job.counters["complete_through"] == client.counters["complete_through"] == 19
    assert job.extra.relay_statuses > 0 and client.extra.relay_statuses is None
    assert all(r.relay is None for r in job.worker_reports)  # the end state does not stay in the reports


@pytest.mark.parametrize(
    "network, compression",
    [
        (dict(forwarding="aggregate"), dict(warmup=2.0)),
        ({}, dict(warmup=2.0, staleness=2)),
        (dict(forwarding="aggregate"), dict(warmup=2.0, step_cap=0.01)),
    ],
)
def test_aggregated_forwarding_and_staleness_run_with_the_relay_in_the_job_as_in_the_driver(even, network, compression):
    rdd, _ = even
    fit = {**FIT, "epochs": 2, "compression": Compression(**compression)}
    job, client = (SharedTrainer(mlp, **fit, network=at(where, **network)).fit(rdd) for where in ("in-job", "client"))
    assert job.param_hash == client.param_hash and job.extra.forwarding == client.extra.forwarding
    assert {r["param_hash"] for r in job.worker_reports} == {job.param_hash}


def test_a_killed_relay_host_runs_the_stage_again_from_the_last_checkpoint_bit_identically(
    even, uninterrupted, tmp_path
):
    rdd, validation = even
    marker, ckpt = str(tmp_path / "died"), str(tmp_path / "ckpt")
    # rank 0 (the relay's host) dies on its 13th step (inside epoch 2), after the checkpoint of epochs 0-1
    with pytest.warns(RuntimeWarning, match="running it again .* from " + ckpt):
        killed = SharedTrainer(
            lambda: DiesOnce(marker, 0, 13),
            validation_data=validation,
            **FIT,
            network=at("in-job"),
            fault_tolerance=FaultTolerance(checkpoint_dir=ckpt),
        ).fit(rdd)
    assert os.path.exists(marker)  # the first run really died
    [restart] = killed.extra.restarts
    assert restart["from"] == ckpt and restart["error"]
    assert killed.extra.resumed_from.endswith("epoch-00002")
    assert killed.param_hash == uninterrupted.param_hash  # nothing applied twice, nothing lost
    assert {r["param_hash"] for r in killed.worker_reports} == {killed.param_hash}
    # the run that finished resumed after epoch 1: its rows are epochs 2-3, equal to the uninterrupted fit's
    assert [h["epoch"] for h in killed.history] == [2, 3]
    assert [h["val_metric"] for h in killed.history] == [h["val_metric"] for h in uninterrupted.history[2:]]


def test_without_checkpoints_a_killed_relay_host_runs_the_stage_again_from_scratch(even, uninterrupted, tmp_path):
    rdd, validation = even
    marker = str(tmp_path / "died")
    with pytest.warns(RuntimeWarning, match="from scratch"):
        killed = SharedTrainer(
            lambda: DiesOnce(marker, 0, 7), validation_data=validation, **FIT, network=at("in-job")
        ).fit(rdd)
    assert os.path.exists(marker)
    assert [r["from"] for r in killed.extra.restarts] == [None]
    assert killed.param_hash == uninterrupted.param_hash and len(killed.history) == 4


def test_a_first_state_above_the_inline_size_goes_to_the_relay_host_as_a_session_file(even, uninterrupted, monkeypatch):
    from gradshare.driver import in_job

    rdd, validation = even
    shipped = []
    real = in_job.ship_state
    monkeypatch.setattr(in_job, "INLINE_STATE_BYTES", 0)  # every state is "large"
    monkeypatch.setattr(in_job, "ship_state", lambda *a, **k: shipped.append(real(*a, **k)) or shipped[-1])
    result = SharedTrainer(mlp, validation_data=validation, **FIT, network=at("in-job")).fit(rdd)
    [(inline, (name, digest))] = shipped
    assert inline is None and name.startswith("gradshare-initial-") and len(digest) == 64
    assert result.param_hash == uninterrupted.param_hash


class Explodes(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        from pyspark import TaskContext

        if TaskContext.get().partitionId() == 1:
            raise RuntimeError("user model exploded on purpose")
        return self.net(x)


def test_a_users_error_is_raised_at_once_and_never_run_again(even):
    rdd, _ = even
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a restart would warn
        with pytest.raises(TrainingError, match="rank 1.*RuntimeError: user model exploded on purpose"):
            SharedTrainer(Explodes, **FIT, network=at("in-job")).fit(rdd)


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(network={"relay": "nowhere"}), ["relay must be one of", "'nowhere'"]),
        (
            dict(network={"relay": "in-job"}, fault_tolerance={"checkpoint_dir": "hdfs://namenode/ckpt"}),
            ["checkpoint_dir='hdfs://namenode/ckpt'", "relay='in-job'", "relay='client'"],
        ),
    ],
)
def test_what_the_in_job_relay_cannot_do_is_refused_naming_the_option(even, options, words):
    rdd, _ = even
    with pytest.raises(ValueError) as info:
        SharedTrainer(mlp, **{**FIT, **options}).fit(rdd)
    for w in words:
        assert w in str(info.value)
