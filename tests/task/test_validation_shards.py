"""Validation data split across the workers: every rank scores its shard at the same
log point, the sums are reduced through Spark's barrier, every rank holds the same val_metric, and
early stopping decides on it; the Estimator's validationIndicatorCol; bad input named before any job."""

import functools
import itertools
import sys

import numpy as np
import pytest
import torch
from pyspark import cloudpickle
from pyspark.sql import functions as F

from gradshare import SharedTrainer
from gradshare.config.options import FaultTolerance, Network
from gradshare.demo import digits_split, mlp
from gradshare.replica.losses import LossStep, accuracy_sums
from gradshare.stopping import stop_epoch
from gradshare.task.partition import PartitionData
from gradshare.task.validation import pack, reduce_sums, shard_sums, split_rows

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)
SPE = (5, 4)  # steps per epoch of the two training partitions below (300 and 256 rows, batch 64)
# The pair is scored in one forward pass of all rows with accuracy's float32 mean; the shards in
# batches per rank, with exact counts summed in float64. The correct-row counts are the same (argmax
# of the same replica; only a tie broken differently by a last-bit difference of a batched matmul
# could change one), so the two differ by the float32 rounding of the pair's mean: < 1e-7.
ACCURACY_TOLERANCE = 1e-6


# ------------------------------------------------------------------------------------ without Spark
def test_pack_cuts_a_shard_into_as_many_lists_as_training_rows():
    for m, n in [(7, 3), (3, 7), (0, 4), (5, 5)]:
        lists = list(pack(0, iter(range(m)), have=[m], into=[n]))
        assert len(lists) == n and list(itertools.chain(*lists)) == list(range(m))
        assert max(map(len, lists)) <= -(-m // n)  # spread evenly: no list holds the whole shard
    for rows in (3, 1):  # a shard that changed since its pre-pass counted 2 rows
        with pytest.raises(ValueError, match="shard 0 does not have the 2 rows its pre-pass counted"):
            list(pack(0, iter(range(rows)), have=[2], into=[4]))


def test_split_rows_reads_both_sides_in_one_pass():
    pairs = [(("t", i), [("v", j) for j in range(i % 3)]) for i in range(500)]
    train, shard = split_rows(iter(pairs), _Listed, _Listed, timeout=10)
    assert train.rows == [row for row, _ in pairs]
    assert shard.rows == [v for _, chunk in pairs for v in chunk]
    _, empty = split_rows(iter([(1, []), (2, [])]), _Listed, _Listed, timeout=10)
    assert empty is None  # an empty shard: that rank scores nothing


def test_split_rows_raises_the_shard_readers_error():
    def bad(rows):
        next(rows)
        raise TypeError("validation row 0: bad features")

    pairs = ((i, [i] * 4) for i in range(10_000))  # more chunks than the queue holds: the training side waits
    with pytest.raises(TypeError, match="validation row 0"):
        split_rows(pairs, _Listed, bad, timeout=10)


class _Listed:
    def __init__(self, rows):
        self.rows = list(rows)

    def close(self):
        pass


def test_shard_sums_reduce_to_the_whole_sets_score():
    # a number is a mean over the batch's rows: shards of any size, in any batches, reduce to the mean
    # of the whole set (up to float summation order); a (sum, count) pair is summed as it is
    torch.manual_seed(0)
    model = mlp(16)
    X_train, _, y_train, _ = digits_split(0)
    X, y = X_train[:301], y_train[:301]
    step = LossStep(torch.nn.functional.cross_entropy, classes=True)
    with torch.no_grad():
        whole_loss = float(torch.nn.functional.cross_entropy(model(torch.from_numpy(X)), torch.from_numpy(y)))
        whole_acc = float((model(torch.from_numpy(X)).argmax(1) == torch.from_numpy(y)).sum()) / len(y)
    cuts = [(0, 100), (100, 101), (101, 301)]  # uneven shards, one of a single row
    for metric, whole in [(None, whole_loss), (accuracy_sums, whole_acc)]:
        import json

        sums = [shard_sums(model, step, PartitionData(X[a:b], y[a:b]), metric, "int64", 32, "cpu") for a, b in cuts]
        value = reduce_sums(json.dumps(s) for s in sums)
        assert value == pytest.approx(whole, rel=1e-6, abs=0 if metric else 1e-7)
    assert shard_sums(model, step, None, None, "int64", 32, "cpu") == (0.0, 0.0)


# ------------------------------------------------------------------------------------ on Spark
@pytest.fixture(scope="module")
def uneven(spark):
    """Digits in two training partitions of 300 and 256 rows (SPE steps per epoch at batch 64: rank 1
    scores at rank 0's epoch ends, not its own), and the test rows as a 3-partition validation RDD
    and as the in-memory pair."""
    X_train, X_test, y_train, y_test = digits_split(0)
    sc = spark.sparkContext
    rows = list(zip(X_train, (int(v) for v in y_train)))
    rdd = sc.parallelize(rows, 2).mapPartitionsWithIndex(lambda i, it: itertools.islice(it, 256 if i else 300))
    shards = sc.parallelize(list(zip(X_test, (int(v) for v in y_test))), 3)
    return rdd.cache(), shards.cache(), (X_test, y_test)


def _fit(rdd, validation, **kw):
    return SharedTrainer(
        mlp,
        batch_size=64,
        epochs=4,
        seed=5,
        validation_data=validation,
        **LOOPBACK,
        early_stopping=dict(patience=0, min_delta=1.0, mode="max"),
        **kw,
    ).fit(rdd)


def test_shards_score_what_the_pair_scores_and_stop_at_the_same_epoch(uneven):
    rdd, shards, pair = uneven
    in_memory = _fit(rdd, pair)
    first, again = _fit(rdd, shards), _fit(rdd, shards)
    # min_delta 1.0 on accuracy: epoch 1 cannot beat epoch 0, patience 0 asks at epoch 1; the shards'
    # score is known at the same log point as the pair's (the longest rank's epoch end), so the stop too
    stopped = stop_epoch(2 * SPE[0], 0, SPE, 4)
    for result in (in_memory, first, again):
        assert result.extra["stopped_epoch"] == stopped == 2
        assert result.extra["stop_requested_epoch"] == 1
        assert [h["epoch"] for h in result.history] == list(range(stopped + 1))
    # validation never changes what is trained: all three end bit-identical
    assert first.param_hash == again.param_hash == in_memory.param_hash
    shard_scores = [h["val_metric"] for h in first.history]
    assert [h["val_metric"] for h in again.history] == shard_scores  # a rerun reduces the same float
    pair_scores = [h["val_metric"] for h in in_memory.history]
    assert shard_scores == pytest.approx(pair_scores, abs=ACCURACY_TOLERANCE)
    assert 0 < shard_scores[0] < shard_scores[-1] <= 1  # it learns: a real score, not a constant
    for report in first.worker_reports:  # every rank holds the same reduced number
        assert [h["val_metric"] for h in report["history"]] == shard_scores


def test_a_sum_count_metric_is_reduced_exactly(spark, uneven):
    rdd, shards, (X_test, y_test) = uneven

    def errors(outputs, labels):  # (misclassified rows, rows): reducible as it is
        return float((outputs.argmax(1) != labels).sum()), float(len(labels))

    # spill_bytes of 16 kB: the shards (and the training partitions) stream from spill files
    result = SharedTrainer(
        mlp,
        batch_size=64,
        epochs=1,
        seed=5,
        validation_data=shards,
        metric=errors,
        port=0,
        verbose=0,
        network=Network(bind="127.0.0.1", spill_bytes=16 << 10),
    ).fit(rdd)
    assert [r["validation_spilled"] for r in result.worker_reports] == [True, True]
    assert sum(r["validation_rows"] for r in result.worker_reports) == len(y_test)
    with torch.no_grad():
        wrong = int((result.model(torch.from_numpy(X_test)).argmax(1) != torch.from_numpy(y_test)).sum())
    assert result.history[-1]["val_metric"] == wrong / len(y_test)  # the last epoch: the model fit returns


def jobs_started(spark, action):
    """Run `action` in its own job group: (the Spark jobs it started, its exception)."""
    sc = spark.sparkContext
    group = f"gradshare-validation-test-{id(action)}"
    sc.setJobGroup(group, "test")
    try:
        with pytest.raises((ValueError, TypeError)) as caught:  # bad arguments: the callers say which
            action()
        return list(sc.statusTracker().getJobIdsForGroup(group)), caught.value
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)


def test_bad_validation_columns_are_named_before_any_spark_job(spark, uneven):
    rdd, shards, _ = uneven
    train = spark.createDataFrame([([0.5, 1.0], 1), ([1.5, 0.0], 0)] * 8, ["x", "y"])

    def with_validation(validation, data=train):
        return lambda: SharedTrainer(torch.nn.Linear(2, 2), validation_data=validation, **LOOPBACK).fit(
            data, **({"features_col": "x", "label_col": "y"} if data is train else {})
        )

    jobs, error = jobs_started(spark, with_validation(train.drop("y")))
    assert isinstance(error, ValueError) and "no column 'y'" in str(error) and jobs == []
    jobs, error = jobs_started(spark, with_validation(train.withColumn("x", F.lit("a"))))
    assert isinstance(error, TypeError) and "column 'x' has type string" in str(error) and jobs == []
    jobs, error = jobs_started(spark, with_validation(train.withColumn("y", F.col("y").cast("double") + 0.5)))
    assert isinstance(error, TypeError) and "column 'y' has type double" in str(error) and jobs == []
    jobs, error = jobs_started(spark, with_validation(train, data=rdd))
    assert isinstance(error, ValueError) and "training data is an RDD" in str(error) and jobs == []
    with pytest.raises(ValueError, match="on_rank_loss='continue'"):
        SharedTrainer(mlp, validation_data=shards, fault_tolerance=FaultTolerance(on_rank_loss="continue"))


def test_validation_rows_of_another_shape_or_type_name_the_shard(spark, uneven):
    rdd, _, _ = uneven
    narrow = spark.sparkContext.parallelize([(np.zeros(63, np.float32), 1)] * 10, 2)
    with pytest.raises(ValueError, match=r"bad validation_data: shard 0 has features of shape \(63,\).*\(64,\)"):
        SharedTrainer(mlp, validation_data=narrow, **LOOPBACK).fit(rdd)
    texts = spark.sparkContext.parallelize([(np.zeros(64, np.float32), "one")] * 4, 2)
    with pytest.raises(TypeError, match="bad validation_data: shard 0 row 0: label 'one'"):
        SharedTrainer(mlp, validation_data=texts, **LOOPBACK).fit(rdd)


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(3, 2)

    def forward(self, a, b):
        return self.a(a) + self.b(b)


def test_a_multi_input_shard_names_the_column(spark):
    rows = [([0.5, 1.0], [1.0, 0.0, 2.0], i % 2) for i in range(16)]
    train = spark.createDataFrame(rows, ["a", "b", "y"])
    short = spark.createDataFrame([(a, b[:2], y) for a, b, y in rows], ["a", "b", "y"])
    with pytest.raises(ValueError, match=r"shard \d has column 'b' of shape \(2,\), the training data \(3,\)"):
        SharedTrainer(TwoInputs, validation_data=short, **LOOPBACK).fit(train, features_col=["a", "b"], label_col="y")
    result = SharedTrainer(TwoInputs, validation_data=train, epochs=1, batch_size=4, **LOOPBACK).fit(
        train, features_col=["a", "b"], label_col="y"
    )
    assert result.history[0]["val_metric"] is not None


# ------------------------------------------------------------------------------------ gradshare.ml
def test_estimator_validation_indicator_column(spark):
    from gradshare.ml import GradshareEstimator

    X_train, _, y_train, _ = digits_split(0)
    rows = [([float(v) for v in x], int(t), i % 4 == 0) for i, (x, t) in enumerate(zip(X_train[:600], y_train))]
    df = spark.createDataFrame(rows, ["features", "label", "is_val"]).repartition(2)
    estimator = GradshareEstimator(
        functools.partial(mlp, 32),
        epochs=3,
        batchSize=64,
        learningRate=1e-2,
        numWorkers=2,
        validationIndicatorCol="is_val",
        on_epoch_end=lambda row: row["epoch"] == 0,
        trainerOptions={**LOOPBACK, "early_stopping": {"patience": 5, "mode": "max"}},
    )
    model = estimator.fit(df)
    scores = [h["val_metric"] for h in model.history]  # the callback's stop: epochs 0 and 1 of 3
    assert len(scores) == 2
    X_val = torch.tensor([r[0] for r in rows if r[2]])
    y_val = torch.tensor([r[1] for r in rows if r[2]])
    with torch.no_grad():  # the last epoch is scored on the model fit returns, on exactly the flagged rows
        correct = int((model.torchModel(X_val).argmax(1) == y_val).sum())
    assert scores[-1] == correct / len(y_val)
    assert model.history[0]["steps"] == sum(-(-n // 64) for n in _partition_rows(df.filter(~F.col("is_val"))))

    jobs, error = jobs_started(spark, lambda: estimator.copy({estimator.validationIndicatorCol: "nope"}).fit(df))
    assert isinstance(error, ValueError) and "'nope'" in str(error) and jobs == []
    jobs, error = jobs_started(spark, lambda: estimator.copy({estimator.validationIndicatorCol: "label"}).fit(df))
    assert isinstance(error, TypeError) and "'label' has type bigint" in str(error) and jobs == []
    no_val = GradshareEstimator(mlp, trainerOptions={**LOOPBACK, "early_stopping": {"mode": "max"}})
    jobs, error = jobs_started(spark, lambda: no_val.fit(df))
    assert isinstance(error, ValueError) and "validationIndicatorCol" in str(error) and jobs == []


def _partition_rows(df):
    return df.rdd.mapPartitions(lambda it: [sum(1 for _ in it)]).collect()
