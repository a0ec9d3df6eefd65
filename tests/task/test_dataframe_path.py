"""The DataFrame path (mapInArrow; gradshare/task/arrow_rows.py, driver/job.py): Arrow record batches give
the rows the RDD path gives, and on the classic session a fit through it ends bit-identical to the RDD
path's over the same DataFrame. Connect itself: tests/driver/test_connect.py."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

import gradshare.driver.job as dataframe_job
from gradshare import SharedTrainer
from gradshare.config.options import Network
from gradshare.driver.session import dataframe_to_rdd
from gradshare.task.arrow_rows import RESULT_CHUNK, batch_rows, read_results, result_batches
from gradshare.task.partition import summarise_partition


def _vectors(rows):
    """A VectorUDT column as Arrow sees it: struct<type: int8, size: int32, indices, values>."""
    t = pa.struct(
        [
            ("type", pa.int8()),
            ("size", pa.int32()),
            ("indices", pa.list_(pa.int32())),
            ("values", pa.list_(pa.float64())),
        ]
    )
    return pa.array(rows, type=t)


def _select(batch, *names):
    """The batch's columns `names`, in that order: what df.select(*features, label) hands mapInArrow."""
    return pa.RecordBatch.from_arrays([batch.column(batch.schema.get_field_index(n)) for n in names], list(names))


def test_arrow_rows_are_the_rdd_rows():
    dense = {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]}
    sparse = {"type": 0, "size": 3, "indices": [2], "values": [5.0]}
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array([[1.5, 2.5], [3.5, 4.5]]),
            _vectors([dense, sparse]),
            pa.array([7, 8], pa.int32()),
            pa.array([0, 1], pa.int64()),
        ],
        ["arr", "vec", "num", "y"],
    )
    rows = list(batch_rows(iter([_select(batch, "arr", "y")]), ("arr", "y"), False))
    assert [r[0].dtype for r in rows] == [np.float32] * 2 and rows[1][0].tolist() == [3.5, 4.5]
    assert rows[1][1] == 1 and isinstance(rows[1][1], np.integer)
    vec = [r[0].tolist() for r in batch_rows(iter([_select(batch, "vec", "y")]), ("vec", "y"), False)]
    assert vec == [[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]]  # a sparse vector is scattered
    three = _select(batch, "arr", "num", "y")
    multi = list(batch_rows(iter([three]), ("arr", "num", "y"), True))
    x, _ = multi[0]
    assert isinstance(x, tuple) and x[1].shape == () and x[1].dtype == np.int64  # a 0-d array: an input
    s = summarise_partition(0, batch_rows(iter([three]), ("arr", "num", "y"), True))
    assert s.error is None and s.features.describe() == "(float32[2], int64[])" and s.label_kind == "int"


def test_bad_columns_are_named_with_the_row():
    batch = pa.RecordBatch.from_arrays([pa.array([[1.0], [2.0], [3.0]]), pa.array([0, None, 1])], ["x", "target"])
    s = summarise_partition(0, batch_rows(iter([batch]), ("x", "target"), False))
    assert "column 'target' is null at row 1" in s.error
    ragged = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0], [3.0]]), pa.array([0, 1])], ["x", "y"])
    s = summarise_partition(3, batch_rows(iter([ragged]), ("x", "y"), False), ("x",))
    assert s.error.startswith(
        "partition 3 row 1: column 'x' of shape (1,) differ from the first row's (2,): every "
        "row of an array column needs the same length"
    )
    s = summarise_partition(3, batch_rows(iter([ragged]), ("x", "y"), False))  # rows of an RDD: no column names
    assert s.error.startswith("partition 3 row 1: features of shape (1,) differ from the first row's (2,)")
    text = pa.RecordBatch.from_arrays([pa.array(["a"]), pa.array([0])], ["words", "y"])
    s = summarise_partition(0, batch_rows(iter([text]), ("words", "y"), False))
    assert s.error_type == "TypeError" and "column 'words' has type string" in s.error


def test_results_travel_in_chunks():
    big = np.arange(RESULT_CHUNK // 4, dtype=np.float64)  # 2 MiB pickled: 3 chunks
    batches = list(result_batches(1, [big])) + list(result_batches(0, "small"))
    rows = [dict(zip(b.schema.names, vals)) for b in batches for vals in zip(*[c.to_pylist() for c in b.columns])]
    assert len(rows) == 4
    out = read_results(rows[::-1])  # any order
    assert out[0] == "small" and np.array_equal(out[1][0], big)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 1), nn.Linear(1, 1)

    def forward(self, a, b):
        return self.a(a) + self.b(b.unsqueeze(1))


@pytest.mark.spark
def test_a_classic_dataframe_fit_is_bit_identical_through_both_paths(spark, monkeypatch):
    import sys

    from pyspark import cloudpickle
    from pyspark.ml.linalg import Vectors

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rng = np.random.default_rng(0)
    X = rng.normal(size=(96, 4)).astype(np.float32)
    rows = [(Vectors.dense(x.tolist()), x.tolist(), float(x[1]), int(x[0] > 0), float(x.sum())) for x in X]
    df = spark.createDataFrame(rows, ["vec", "arr", "num", "label", "target"]).repartition(2).cache()
    assert dataframe_to_rdd(df, "vec", "label").count() == 96
    fits = {
        "classes": dict(model=lambda: nn.Linear(4, 2), features_col="vec", label_col="label"),
        "inputs": dict(model=_TwoInputs, features_col=["arr", "num"], label_col="target"),
    }
    for name, fit in fits.items():
        hashes = []
        for frame in (False, True):
            monkeypatch.setattr(dataframe_job, "FRAME_PATH_CLASSIC", frame)
            torch.manual_seed(0)
            r = SharedTrainer(
                fit["model"], epochs=2, batch_size=8, port=0, verbose=0, network=Network(bind="127.0.0.1")
            ).fit(df, features_col=fit["features_col"], label_col=fit["label_col"])
            hashes.append(r.param_hash)
            assert {w["param_hash"] for w in r.worker_reports} == {r.param_hash} and r.world_size == 2
        assert hashes[0] == hashes[1], name
    df.unpersist()


def test_a_barrier_stage_no_worker_reaches_is_given_up_after_the_join_window():
    """Connect cannot count free slots beyond local[N]: no rank heard within the window is a clear error."""
    from gradshare import TransportTimeout
    from gradshare.driver.job import FrameJob

    class Relay:
        address = ("127.0.0.1", 40123)

        def __init__(self, attempt):
            self.attempt = attempt

        def progress(self):
            return {"attempt": self.attempt}

    job = FrameJob.__new__(FrameJob)
    job.world = 4
    job.check_started(Relay(-1), elapsed=10.0, window=30.0)  # still inside the window
    job.check_started(Relay(7), elapsed=99.0, window=30.0)  # a rank spoke: the stage runs
    with pytest.raises(TransportTimeout, match=r"within 30 s .* fewer than 4 free task slots.*127\.0\.0\.1"):
        job.check_started(Relay(-1), elapsed=31.0, window=30.0)
