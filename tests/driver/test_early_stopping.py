"""Early stopping and on_epoch_end: rank 0 decides, the log carries the decision,
every rank stops after the same epoch and the replicas stay bit-identical."""

import itertools
import sys

import pytest
from pyspark import cloudpickle

from gradshare import SharedTrainer
from gradshare.config.options import Network, Runtime
from gradshare.demo import digits_split, mlp
from gradshare.stopping import EarlyStopping, early_stopping_from, should_stop, stop_epoch
from lab.flat_options import in_groups

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)
SPE = (11, 5)  # steps per epoch of the two partitions below (673 and 300 rows, batch 64)


# ------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    "mode, values, stops_at",
    [
        ("min", [1.0, 0.9, 0.95, 0.96], 3),  # patience 1: the second epoch without improvement stops
        ("max", [0.5, 0.6, 0.59, 0.7, 0.7, 0.69], 5),
        ("min", [1.0, 0.999, 0.998, 0.997], 2),  # improvements smaller than min_delta=0.01 do not count
    ],
)
def test_rule_counts_epochs_without_improvement(mode, values, stops_at):
    rule = EarlyStopping(patience=1, min_delta=0.01 if stops_at == 2 else 0.0, mode=mode)
    decisions = [should_stop(rule, {"epoch": e, "val_metric": v}) for e, v in enumerate(values)]
    assert decisions.index(True) == stops_at and not any(decisions[:stops_at])


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(patience=-1), "patience"),
        (dict(patience=1.5), "patience"),
        (dict(min_delta=-0.1), "min_delta"),
        (dict(mode="up"), "mode"),
        (dict(monitor="acc"), "monitor"),
        (dict(patients=2), "patients"),
        ([1], "early_stopping must be"),
    ],
)
def test_bad_options_name_the_argument(option, match):
    with pytest.raises(ValueError, match=match):
        early_stopping_from(option)


def test_rule_without_the_monitored_value_is_an_error():
    with pytest.raises(ValueError, match="val_metric"):
        should_stop(EarlyStopping(), {"epoch": 0, "val_metric": None})


def test_trainer_checks_the_options_before_any_job():
    with pytest.raises(ValueError, match="validation_data"):
        SharedTrainer(mlp, early_stopping=dict(patience=1))
    with pytest.raises(ValueError, match=r"on_epoch_end\[1\]"):
        SharedTrainer(mlp, runtime=Runtime(on_epoch_end=[print, 3]))


@pytest.mark.parametrize("staleness", [0, 1, 3])
@pytest.mark.parametrize("spe", [(5,), (4, 4), (7, 3), (1, 9, 2)])
def test_stop_epoch_is_the_first_every_rank_can_still_end(staleness, spe):
    epochs = 12
    for decided in range(epochs * min(spe)):
        stop = stop_epoch(decided, staleness, spe, epochs)
        # every rank reads the decision before its step decided + 1 + k: its epoch E must not end earlier
        can = [e for e in range(epochs) if all((e + 1) * s - 1 >= decided + staleness for s in spe)]
        assert stop == (can[0] if can and can[0] < epochs - 1 else None), (decided, stop, can)


# ------------------------------------------------------------------------------------ on Spark
@pytest.fixture(scope="module")
def uneven(spark):
    """Digits in two partitions of 673 and 300 rows: SPE steps per epoch at batch 64 (a barrier stage
    takes no union, so partition 1 is cut instead)."""
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    rdd = (
        spark.sparkContext.parallelize(rows, 2)
        .mapPartitionsWithIndex(lambda i, it: it if i == 0 else itertools.islice(it, 300))
        .cache()
    )
    return rdd, (X_test, y_test)


def _decided_at(epoch: int, staleness: int) -> int:
    """The step whose message carries a decision about `epoch`: rank 0 scores the epoch before the
    first step whose apply bound (t - 1 - k) reaches the epoch's last step."""
    return (epoch + 1) * SPE[0] + staleness


def _fit(uneven, epochs=8, **kw):
    rdd, validation = uneven
    return SharedTrainer(
        mlp, batch_size=64, epochs=epochs, seed=5, validation_data=validation, **in_groups({**LOOPBACK, **kw})
    ).fit(rdd)  # grouped options named flat


def _assert_stopped_consistently(result, stopped):
    assert result.extra["stopped_epoch"] == stopped
    assert [h["epoch"] for h in result.history] == list(range(stopped + 1))  # epochs not run are absent
    for rep in result.worker_reports:
        spe = SPE[rep["rank"]]
        assert rep["stopped_epoch"] == stopped and rep["last_step"] == (stopped + 1) * spe - 1
        assert rep["param_hash"] == result.param_hash  # fit also raises ConsistencyError otherwise
    assert result.steps == (stopped + 1) * SPE[0]


def test_early_stopping_stops_at_the_same_epoch_across_two_runs(uneven):
    # min_delta 1.0 on accuracy: epoch 0 sets the best, epoch 1 cannot beat it, so patience 0 decides
    # at epoch 1; the decision rides rank 0's step 22 message, which rank 1 applies in its epoch 4
    first = _fit(uneven, early_stopping=dict(patience=0, min_delta=1.0, mode="max"))
    stopped = stop_epoch(_decided_at(1, 0), 0, SPE, 8)
    assert stopped == 4
    _assert_stopped_consistently(first, stopped)
    assert first.extra["stop_requested_epoch"] == 1
    again = _fit(uneven, early_stopping=dict(patience=0, min_delta=1.0, mode="max"))
    assert again.param_hash == first.param_hash
    assert [h["val_metric"] for h in again.history] == [h["val_metric"] for h in first.history]
    assert all(h["val_metric"] is not None for h in first.history)


def test_a_callback_stops_every_rank_at_staleness_one(uneven, tmp_path):
    seen = str(tmp_path / "rows")

    def note_and_stop(row):  # runs on rank 0, in the Spark task (local mode: same filesystem)
        with open(seen, "a") as f:
            f.write(f"{row['epoch']} {row['val_metric'] is not None}\n")
        return row["epoch"] == 0

    result = _fit(uneven, staleness=1, on_epoch_end=note_and_stop)
    # epoch 0 ends at step 10; scored before step 12 (k = 1), whose message carries the stop
    stopped = stop_epoch(_decided_at(0, 1), 1, SPE, 8)
    assert stopped == 2
    _assert_stopped_consistently(result, stopped)
    assert open(seen).read().split("\n")[:-1] == [f"{e} True" for e in range(stopped + 1)]
    assert result.extra["stop_requested_epoch"] == 0


def test_a_stop_too_late_for_a_common_epoch_is_reported_not_carried_out(uneven):
    # asked at the end of epoch 1 of 3: rank 1 (5 steps an epoch) reads it in its epoch 4, past the last
    result = _fit(uneven, epochs=3, on_epoch_end=lambda row: row["epoch"] == 1)
    assert stop_epoch(_decided_at(1, 0), 0, SPE, 3) is None
    assert result.extra["stopped_epoch"] is None and result.extra["stop_requested_epoch"] == 1
    assert [h["epoch"] for h in result.history] == [0, 1, 2]
    assert [r["last_step"] for r in result.worker_reports] == [3 * SPE[0] - 1, 3 * SPE[1] - 1]


def test_a_nan_score_counts_as_no_improvement():
    # a diverged epoch (NaN loss or metric) does not kill the fit: patience decides, as in Keras
    rule = EarlyStopping(patience=1, mode="min", monitor="loss")
    assert not should_stop(rule, {"epoch": 0, "loss": 1.0})
    assert not should_stop(rule, {"epoch": 1, "loss": float("nan")})
    assert should_stop(rule, {"epoch": 2, "loss": float("nan")})
    assert rule.best == 1.0
