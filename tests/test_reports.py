"""The typed reports (gradshare/reports.py) and worker failures that arrive on the driver
as the class the worker raised, with rank, step and first cause.

Unit parts need no Spark; the end-to-end parts use the shared local Spark session."""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer
from gradshare.config.options import Network
from gradshare.driver.failures import driver_error as _driver_error
from gradshare.driver.result import FitExtras, FitResult
from gradshare.errors import ConsistencyError, DecodeError, TrainingError, TransportTimeout
from gradshare.reports import FAILURE_JSON, Counters, EpochStats, Progress, WorkerFailure, WorkerReport
from gradshare.transport import Peer, Relay, new_job_key
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.step_meta import StepMeta
from transport_util import TOY

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


class UserError(RuntimeError):
    """A user's exception class: only this test module (the driver) defines it."""


def _row(epoch=0, **kw):
    base = dict(
        epoch=epoch,
        steps=4,
        loss=0.5,
        sparsity=0.01,
        payload_bytes=100,
        bytes_sent=300,
        bytes_received=200,
        tau=1e-3,
        lr=1e-3,
        silent_steps=0,
        seconds=0.1,
    )
    return EpochStats(**{**base, **kw})


def _report(rank, counters, **kw):
    base = dict(
        rank=rank,
        start_step=0,
        last_step=3,
        stopped_epoch=None,
        stop_requested_epoch=None,
        history=(_row(),),
        applied=8,
        train_seconds=1.0,
        steps_run=4,
        update_path="direct",
        step_in_backward=False,
        device="cpu",
        tensor_state=False,
        silent_steps=0,
        int_buffers={},
        skipped_steps=0,
        checkpoint_seconds=0.0,
        counters=Counters.from_dict(counters),
    )
    return WorkerReport(**{**base, **kw})


# ------------------------------------------------------------------------------------ reports
def test_counters_type_the_common_fields_and_read_the_rest_like_the_dict_they_came_from():
    raw = {
        "datagrams_in": 5,
        "bytes_in": 1000,
        "bytes_out": 700,
        "snapshot_bytes_in": 400,
        "retransmits": 2,
        "updates_sent": 4,
        "unacked": 0,
        "drops": {"auth_failed": 1},
    }
    c = Counters.from_dict(raw)
    assert (c.bytes_in, c.bytes_out, c.retransmits, c.drops) == (1000, 700, 2, {"auth_failed": 1})
    assert c.bytes_sent == 700 and c.training_bytes_in == 600
    assert c["updates_sent"] == 4 and c["drops"]["auth_failed"] == 1 and c.get("gone", 0) == 0
    assert "unacked" in c and "other" not in c
    assert {k: c[k] for k in raw} == raw  # every key the core counted reads back the same
    with pytest.raises(KeyError):
        c["gone"]


def test_fit_result_traffic_comes_from_the_workers_counters():
    reports = [
        _report(0, {"bytes_out": 100, "bytes_in": 900, "snapshot_bytes_in": 800}),
        _report(1, {"bytes_out": 50, "bytes_in": 820, "snapshot_bytes_in": 800}),
    ]
    r = FitResult(
        model=None,
        history=[],
        counters=Counters(),
        worker_reports=reports,
        param_hash="",
        world_size=2,
        n_params=10,
        steps=4,
        resumed_from=0,
        seconds=1.0,
    )
    assert (r.bytes_sent, r.bytes_received, r.snapshot_bytes) == (150, 120, 1600)
    assert r.dense_bytes == 4 * 10 * (4 + 4) * 2 and r.traffic_ratio == r.dense_bytes / 270


def test_fit_extras_read_by_attribute_and_by_key_like_the_dict_they_were():
    extra = FitExtras(
        loss="MSELoss",
        label_dtype="float32",
        inputs="float32[4]",
        probe="output (B, 1)",
        incidents=["rank 1 suspected"],
        stopped_epoch=2,
        forwarding="per-rank",
    )
    assert extra["loss"] == extra.loss == "MSELoss" and extra["stopped_epoch"] == 2 and "probe" in extra
    assert set(extra) == {
        "loss",
        "label_dtype",
        "inputs",
        "probe",
        "incidents",
        "stopped_epoch",
        "stop_requested_epoch",
        "resumed_from",
        "rolled_back",
        "checkpoint_service_errors",
        "forwarding",
        "relay",
        "restarts",
        "relay_statuses",
        "step_cap",
        "reforms",
    }  # SharedTrainer.fit's docstring lists these
    assert extra == dict(extra.items()) and extra.get("resumed_from") is None and extra["rolled_back"] == []
    with pytest.raises(KeyError):
        extra["nope"]
    assert pickle.loads(pickle.dumps(extra)) == extra
    assert (
        FitResult(
            model=None,
            history=[],
            counters=Counters(),
            worker_reports=[],
            param_hash="",
            world_size=1,
            n_params=1,
            steps=0,
            resumed_from=0,
            seconds=0.0,
        ).extra
        == FitExtras()
    )


def test_a_worker_row_reads_as_the_dict_it_was_and_the_driver_row_adds_its_fields():
    row = _row(val_metric=0.9)
    assert set(row) == {
        "epoch",
        "steps",
        "loss",
        "sparsity",
        "payload_bytes",
        "bytes_sent",
        "bytes_received",
        "tau",
        "lr",
        "silent_steps",
        "seconds",
        "val_metric",
    }  # what on_epoch_end's dict(row) holds
    assert dict(row)["val_metric"] == 0.9 and row.get("resumed") is None
    merged = _row(resumed=False, skipped_steps=0, loss_fn="CrossEntropyLoss").as_dict()
    assert merged["resumed"] is False and merged["loss_fn"] == "CrossEntropyLoss"
    assert json.loads(json.dumps(merged)) == merged  # FitResult.history stays plain, JSON-able dicts
    assert row.scored(0.5)["val_metric"] == 0.5 and row["val_metric"] == 0.9  # frozen: a new row


def test_a_worker_report_crosses_spark_and_reads_like_a_dict():
    rep = _report(1, {"bytes_in": 3}, int_buffers={"bn.num_batches_tracked": np.array(7)})
    back = cloudpickle.loads(cloudpickle.dumps(rep))
    assert back.rank == back["rank"] == 1 and back["counters"]["bytes_in"] == 3
    assert back["history"][0]["loss"] == 0.5 and int(back.int_buffers["bn.num_batches_tracked"]) == 7
    assert "profile" not in back and "validation_rows" not in back  # optional, absent while None
    timed = rep.with_(profile={"steps": {}}, validation_rows=5, validation_spilled=False)
    assert timed["profile"] == {"steps": {}} and timed["validation_rows"] == 5 and rep.profile is None


def test_progress_reads_a_steps_meta_or_the_floats_it_travels_as():
    p = Progress(loss=0.25, sparsity=0.002, bytes=512.0, epoch=1.0, tau=1e-3, lr=0.1)
    meta = StepMeta(loss=0.25, sparsity=0.002, bytes=512.0, epoch=1, tau=1e-3, lr=0.1)
    assert meta.to_wire() == {"loss": 0.25, "sparsity": 0.002, "bytes": 512.0, "epoch": 1.0, "tau": 1e-3, "lr": 0.1}
    assert Progress.from_meta(meta) == Progress.from_meta(meta.to_wire()) == p
    assert Progress.from_meta(meta.with_(StepMeta(es_waited=2))) == p  # rank 0's notes ride beside it
    skipped = StepMeta(loss=0.5, sparsity=0.0, bytes=8.0, epoch=0)  # an fp16 step the scaler skipped: no τ
    assert "tau" not in skipped.to_wire() and Progress.from_meta(skipped) == Progress(0.5, 0.0, 8.0, 0.0)
    assert Progress.from_meta(None) is None and Progress.from_meta(StepMeta(stop_epoch=3)) is None
    assert Progress.from_meta({"loss": "high"}) is None  # not a StepMeta's map: nothing to show


# ------------------------------------------------------------------------------------ failures
def _raised(exc, cause=None):
    try:
        if cause is None:
            raise exc
        try:
            raise cause
        except BaseException as inner:
            raise exc from inner
    except BaseException as e:  # noqa: BLE001 - the test hands it on
        return e


@pytest.mark.parametrize(
    "exc, cls",
    [
        (DecodeError("bad index 99"), "DecodeError"),
        (ConsistencyError("hash differs"), "ConsistencyError"),
        (TransportTimeout("relay silent"), "TransportTimeout"),
        (ValueError("boom"), "ValueError"),
        (UserError("exploded"), "TrainingError"),
    ],
)
def test_a_failure_names_the_class_the_driver_raises_and_unpickles_without_the_users_code(exc, cls):
    f = WorkerFailure.from_exception(_raised(exc), rank=1, step=3, attempt=7)
    assert (f.error_class, f.error_type, f.message, f.cause) == (cls, type(exc).__name__, str(exc), None)
    data = pickle.dumps(f)
    assert __name__.encode() not in data  # strings only: no reference to a class of the user's module
    err = pickle.loads(data).error()
    assert type(err).__name__ == cls and (err.rank, err.step) == (1, 3)
    assert str(err) == f"worker rank 1 failed: {type(exc).__name__}: {exc}"


def test_the_first_cause_of_a_chain_is_kept_and_named():
    f = WorkerFailure.from_exception(_raised(UserError("loss is nan"), KeyError("lr")), rank=0, step=None)
    assert f.cause == "KeyError: 'lr'" and f.step is None
    err = f.error()
    assert isinstance(err, TrainingError) and err.cause == "KeyError: 'lr'" and err.worker_failure == f
    assert str(err) == "worker rank 0 failed: UserError: loss is nan (first cause: KeyError: 'lr')"


def test_the_text_form_rebuilds_the_failure_from_sparks_job_error():
    f = WorkerFailure(2, 11, "DecodeError", "index 4097 out of bounds\nsecond line", "DecodeError", "OSError: x", 3)
    spark = (
        "py4j.protocol.Py4JJavaError: An error occurred while calling o1.collectAndServe.\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        f"gradshare.errors.TrainingError: {f.to_text()}\n\tat org.apache.spark.api.python.BasePythonRunner\n"
    )
    assert WorkerFailure.from_text(spark) == f
    # the JSON record mangled: the tag line alone (no cause), the class still exact
    tag_only = WorkerFailure.from_text(spark.replace('"rank":2', '"rank":'))
    assert tag_only == WorkerFailure(2, 11, "DecodeError", "index 4097 out of bounds second line", "DecodeError")
    # a tag from before the typed reports: the class by the type's name
    old = WorkerFailure.from_text("Job aborted: [gradshare rank 0] ConsistencyError: replicas differ\n")
    assert (old.rank, old.step, old.error_class) == (0, None, "ConsistencyError")
    assert WorkerFailure.from_text("[gradshare rank 0] SomeUserError: x").error_class == "TrainingError"
    assert WorkerFailure.from_text("no tag here") is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "[gradshare rank 3, step -7, DecodeError] ",
                "[gradshare rank 0] ",
                "X: y",
                FAILURE_JSON,
                '{"rank":1}',
                '{"rank":-1,"step":2}',
                "\n",
                "Error: ",
                '{"rank":1,"step":null,"error_type":"E","message":"m","error_class":"NoSuch","cause":null,"attempt":0}',
            ]
        ),
        max_size=6,
    ),
    st.text(max_size=40),
)
def test_any_spark_text_gives_a_failure_or_none_never_an_error(parts, noise):
    found = WorkerFailure.from_text("".join(parts) + noise)
    if found is not None:
        assert found.rank >= 0 and (found.step is None or found.step >= 0)
        assert type(found.error()).__name__ == found.error_class  # a class the driver can raise


def test_the_driver_raises_the_reported_class_before_reading_text_and_an_incident_first():
    fail = ev.Fail(1, 0, "DecodeError", "bad chunk", 5, False, "DecodeError", "")
    spark_error = RuntimeError("Job aborted: [gradshare rank 0] TransportTimeout: a symptom\n")

    class NoIncident:
        def first_cause(self):
            return None

    err = _driver_error(spark_error, NoIncident(), fail)  # the relay's report wins over Spark's text
    assert isinstance(err, DecodeError) and (err.rank, err.step) == (1, 5)
    assert str(err) == "worker rank 1 failed: DecodeError: bad chunk"
    err = _driver_error(spark_error, NoIncident())  # nothing reported: the text form
    assert isinstance(err, TransportTimeout) and err.rank == 0

    class Cut(NoIncident):
        def first_cause(self):
            return ev.Incident("gone", 1, 0, 4, 2.0, 9.0, "silent")

    err = _driver_error(spark_error, Cut(), fail)
    assert type(err) is TrainingError and str(err).startswith("first cause: rank 1")
    assert err.worker_failure.error_class == "DecodeError"


def test_fail_carries_the_failure_fields_on_the_wire():
    fail = ev.Fail(3, 9, "DecodeError", "bad", 12, False, "DecodeError", "KeyError: 'x'")
    kind, body = wire.encode_control(fail)
    assert wire.decode_control(kind, body) == fail
    with pytest.raises(ValueError, match="error_class"):
        ev.Fail(0, 0, "X", "m", -1, True, "", "")
    with pytest.raises(ValueError, match="cause"):
        ev.Fail(0, 0, "X", "m", -1, True, "TrainingError", "c" * (ev.MAX_ERROR_TEXT + 1))


@pytest.mark.sockets
def test_a_retryable_report_reaches_the_relay_without_stopping_the_job():
    key, n = new_job_key(), 16
    with Relay(np.zeros(n, np.float32), world_size=2, key=key, job_id=5, port=0, bind="127.0.0.1", **TOY) as relay:
        peer = Peer(relay.address, rank=1, world_size=2, attempt=0, key=key, job_id=5, n_params=1, timeout=5)
        try:
            assert peer.report_failure(
                "DecodeError", "bad chunk", 5.0, fatal=False, step=4, error_class="DecodeError", cause=""
            )
        finally:
            peer.close(linger=0.0, leave=False)
        assert relay.failure() is None  # not fatal: Spark's stage retry goes on
        got = relay.reported_failure()
        assert (got.rank, got.step, got.fatal, got.error_class) == (1, 4, False, "DecodeError")


# ------------------------------------------------------------------------------------ end to end
def small_rdd(spark, rows=32, parts=2):
    data = [(np.full(3, i % 5, np.float32), i % 2) for i in range(rows)]
    return spark.sparkContext.parallelize(data, parts)


class RaisesOnRank1(nn.Module):
    """Rank 1's forward raises `make()` at its step `at` on every attempt."""

    def __init__(self, make, at):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.make, self.at, self.calls = make, at, 0

    def forward(self, x):
        from pyspark import TaskContext

        ctx = TaskContext.get()  # None: the driver's probe of the loss (losses.py)
        if ctx is not None:
            if ctx.partitionId() == 1 and self.calls == self.at:
                raise self.make()
            self.calls += 1
        return self.lin(x)


def _fit(spark, make, at=1, **kw):
    SharedTrainer(lambda: RaisesOnRank1(make, at), batch_size=4, epochs=1, **LOOPBACK, **kw).fit(small_rdd(spark))


@pytest.mark.spark
def test_a_gradshare_error_in_a_worker_arrives_as_its_class(spark):
    # not deterministic by gradshare's rule (is_deterministic): Spark retries the stage (~30 s here, most
    # of it Spark's; ConsistencyError and the other classes take the same path: the unit tests above),
    # and the class comes from the last attempt's report to the relay
    with pytest.raises(DecodeError, match=r"^worker rank 1 failed: DecodeError: injected$") as info:
        _fit(spark, lambda: DecodeError("injected"))
    # step 1 of the first attempt, or of the retry, which resumes at step 0 or 1 (rank 1's step 0 acknowledged
    # or not when it failed) and raises at its second step
    assert info.value.rank == 1 and info.value.step in (1, 2) and info.value.cause is None


@pytest.mark.spark
def test_a_user_value_error_keeps_its_class_and_names_its_first_cause(spark):
    # deterministic: reported as fatal, the driver cancels the job at once (one fit: each fit after a
    # failed one starts cold Python workers). A user error of any other type arrives as TrainingError
    # naming it (test_trainer's "user" case; the unit tests above)
    def chained():
        try:
            {}["lr"]
        except KeyError as e:
            return _raised(ValueError("bad batch"), e)

    with pytest.raises(
        ValueError,
        match=r"^worker rank 1 failed: ValueError: bad batch "
        r"\(first cause: KeyError: 'lr'\)$",
    ) as info:
        _fit(spark, chained, at=2)
    assert (info.value.rank, info.value.step, info.value.cause) == (1, 2, "KeyError: 'lr'")
