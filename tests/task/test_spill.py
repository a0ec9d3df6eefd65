"""Partitions larger than memory: the spill file's exact rows and dtypes, the seeded
block shuffle, bounded memory whatever the partition's size, and a 12x-spill_bytes partition training on
the real local Spark session with the worker's peak RSS measured."""

import os
import subprocess
import sys

import numpy as np
import pytest
from pyspark import cloudpickle

from gradshare.task.partition import PartitionData
from gradshare.task.spill import BlockShuffle, SpillError, block_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the repo
# Executors cannot import this test module: ship its row generator by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spilled(rows, tmp_path, spill_bytes=4_000, label_dtype="int64"):
    data = PartitionData.from_rows(
        iter(rows), label_dtype, spill_bytes=spill_bytes, spill_dir=str(tmp_path), chunk_rows=64
    )
    assert data.spilled and os.path.dirname(data.spill_path) == str(tmp_path)
    return data


def numbered(n, dim=6):
    """Row i's features start with i, its label is i: every row is recognisable in any batch."""
    return [(np.arange(dim, dtype=np.float64) + i, i) for i in range(n)]


# ------------------------------------------------------------------------------------ the file
def test_multi_input_rows_and_array_labels_come_back_exactly_with_their_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**40, size=(500, 5))
    rows = [
        ((ids[i], np.float64(i) / 3, np.array([i % 3 == 0, True])), np.array([i, -i, 2**33 + i])) for i in range(500)
    ]
    data = spilled(rows, tmp_path)
    try:
        assert len(data) == 500 and data.multi
        (ints, floats, flags), labels = data.read(0, 500)
        assert (ints.dtype, floats.dtype, flags.dtype, labels.dtype) == (np.int64, np.float32, np.bool_, np.int64)
        np.testing.assert_array_equal(ints, ids)
        np.testing.assert_array_equal(floats, (np.arange(500) / 3).astype(np.float32))
        np.testing.assert_array_equal(flags, np.stack([np.arange(500) % 3 == 0, np.ones(500, bool)], axis=1))
        np.testing.assert_array_equal(labels, np.stack([np.arange(500), -np.arange(500), 2**33 + np.arange(500)], 1))
        (ints, _, _), labels = data.read(123, 130)  # any slice, not only the whole file
        np.testing.assert_array_equal(ints, ids[123:130])
        np.testing.assert_array_equal(labels[:, 0], np.arange(123, 130))
        with pytest.raises(ValueError, match=r"rows 490\.\.501 are outside the partition's 0\.\.500"):
            data.read(490, 501)
        path = data.spill_path
    finally:
        data.close()
    assert not os.path.exists(path)


def test_float_labels_spill_as_float32_and_small_partitions_stay_in_memory(tmp_path):
    rows = [(np.ones(4), i * 0.25) for i in range(300)]
    data = spilled(rows, tmp_path, label_dtype="float32")
    try:
        _, labels = data.read(0, 300)
        assert labels.dtype == np.float32
        np.testing.assert_array_equal(labels, np.arange(300) * 0.25)
    finally:
        data.close()
    mem = PartitionData.from_rows(iter(rows), "float32", spill_bytes=1 << 20, spill_dir=str(tmp_path))
    assert not mem.spilled and mem.spill_path is None and os.listdir(tmp_path) == []


def test_a_truncated_spill_file_is_an_error_naming_it(tmp_path):
    data = spilled(numbered(400), tmp_path)
    try:
        with open(data.spill_path, "r+b") as f:
            f.truncate(1000)
        with pytest.raises(SpillError, match=r"spill file .*gradshare-part0-.* ended at byte 1000"):
            data.read(0, 400)
    finally:
        data.close()


def test_bad_spill_bytes_and_failed_materialisation_leave_no_file(tmp_path):
    for bad in (0, -1, 1.5, True, "1M"):
        with pytest.raises(ValueError, match="spill_bytes must be a positive number of bytes"):
            PartitionData.from_rows(iter(numbered(3)), "int64", spill_bytes=bad)
    ragged = numbered(300) + [(np.zeros(7), 0)]
    with pytest.raises(ValueError, match="partition 4 row 300"):
        PartitionData.from_rows(iter(ragged), "int64", spill_bytes=1_000, spill_dir=str(tmp_path), index=4)
    assert os.listdir(tmp_path) == []  # the half-written spill file went with the error


# ------------------------------------------------------------------------------------ the order
def test_block_layout_stays_within_the_budget():
    assert block_layout(10_000, 40, 4_000) == (6, 16)  # 100 rows a window: 16 blocks of 6
    assert block_layout(10_000, 40, 100) == (1, 2)  # a tiny budget: single rows from anywhere
    assert block_layout(10_000, 40, 10) == (1, 1)  # less than a row: still one row at a time
    assert block_layout(10**9, 100, 256 << 20) == (10_485, 256)  # ~1 MiB blocks under 256 MiB
    for rows, size, budget in [(10_000, 40, 4_000), (777, 264, 1 << 20), (10**9, 100, 256 << 20)]:
        block_rows, blocks = block_layout(rows, size, budget)
        assert block_rows * blocks * size <= max(budget, size)


@pytest.mark.parametrize("rows,block_rows,window_blocks", [(1000, 7, 5), (1000, 1000, 1), (13, 1, 4), (64, 8, 8)])
def test_block_shuffle_is_a_seeded_permutation_of_each_epoch(rows, block_rows, window_blocks):
    def order(seed, rank, epoch):
        s = BlockShuffle(rows, block_rows, window_blocks, seed, rank, epoch)
        return np.concatenate([s.window_rows(w) for w in range(len(s))]), s

    a, s = order(3, 1, 2)
    assert sorted(a) == list(range(rows))
    assert s.starts[-1] == rows and all(
        s.window_of(p) == w for w in range(len(s)) for p in range(s.starts[w], s.starts[w + 1])
    )
    np.testing.assert_array_equal(a, order(3, 1, 2)[0])  # (seed, rank, epoch) decide it
    if rows > 13:
        for other in [(4, 1, 2), (3, 0, 2), (3, 1, 3)]:
            assert not np.array_equal(a, order(*other)[0])


def test_batches_cover_the_epoch_read_each_window_once_and_a_resume_reads_the_same(tmp_path):
    data = spilled(numbered(1000), tmp_path)  # 119 rows a window: batches of 64 straddle windows
    try:
        assert data.dtype.itemsize == 32 and (data.window_rows, data.block_rows) == (119, 7)  # 17 blocks, 3 808 B
        windows = -(-len(data) // data.window_rows)
        for epoch in (0, 1):
            before, held, batches = data.windows_read, [], []
            for b in range(16):
                batches.append(data.batch(epoch, b, 64, seed=5, rank=1))
                held.append(data.window)
            seen = np.concatenate([x[:, 0] for x, _ in batches]).astype(int)
            assert sorted(seen) == list(range(1000)) and len(batches[-1][1]) == 1000 - 15 * 64
            for x, y in batches:  # features and labels of the same rows, dtypes kept
                assert x.dtype == np.float32 and y.dtype == np.int64
                np.testing.assert_array_equal(x[:, 0].astype(int), y)
            # in order, every window read once: as many reads as windows, and the one held never goes back
            assert data.windows_read - before == windows and held == sorted(held) and held[-1] == windows - 1
            if epoch == 0:
                first = seen
        assert not np.array_equal(first, seen)  # a new order every epoch
        resumed = spilled(numbered(1000), tmp_path)  # a retried stage: a fresh file, then batch 9 first
        try:
            x, _ = resumed.batch(0, 9, 64, seed=5, rank=1)
            np.testing.assert_array_equal(x[:, 0].astype(int), first[9 * 64 : 10 * 64])
        finally:
            resumed.close()
        x, _ = data.batch(0, 0, 2000, seed=5, rank=1)  # a batch larger than a window reads several
        np.testing.assert_array_equal(x[:, 0].astype(int), first)
        with pytest.raises(ValueError, match="batch 16 of 64 rows is outside the partition's 1000 rows"):
            data.batch(0, 16, 64, seed=5, rank=1)
    finally:
        data.close()


# ------------------------------------------------------------------------------------ memory
MEMORY_CHILD = """
import sys, numpy as np
from gradshare.task.partition import PartitionData
from gradshare.task.memory import reset_peak_rss, proc_status_bytes
import gradshare.task.train  # the task body's modules, loaded before the baseline as in a Spark task

spill_bytes, rows, width, spill_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def stream():  # generated on the fly, as Spark hands a task its rows: nothing of it is held here
    for i in range(rows):
        yield np.full(width, i, dtype=np.float32), i % 10
start = reset_peak_rss()
data = PartitionData.from_rows(stream(), "int64", spill_bytes=spill_bytes, spill_dir=spill_dir)
total = 0
for epoch in range(2):
    for b in range(-(-rows // 64)):
        x, y = data.batch(epoch, b, 64, seed=0, rank=0) if data.spilled else (None, data.labels)
        total += len(y)
print(data.spilled, total, proc_status_bytes("VmHWM") - start)
data.close()
"""


def test_peak_memory_of_a_spilled_partition_is_bounded_by_spill_bytes_not_its_size(tmp_path):
    """Materialise and read two epochs of a 16 MiB partition with spill_bytes = 1 MiB, in a fresh process
    (VmHWM is per process): the peak grows by about 2 budgets (chunks held before the spill, then one
    window), not by the partition's 16 MiB (held in memory, it costs twice that while concatenating)."""
    mib, width, rows = 1 << 20, 1024, 4096  # 4 KiB rows: 16 MiB
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(mib), str(rows), str(width), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    was_spilled, total, growth = out.stdout.split()
    assert was_spilled == "True" and int(total) == 2 * rows
    assert int(growth) < 4 * mib, f"peak RSS grew by {int(growth) / mib:.1f} MiB"
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ on Spark
WIDTH = 1024  # 4 KiB rows: few Python objects per MiB, so the test is quick


def generated_rows(index, rows_per_partition):
    """A partition's rows, generated on the executor (nothing of them passes through the driver):
    the label is the arg-max of the first 4 features, so a linear model can learn it."""
    rng = np.random.default_rng(index)
    for _ in range(rows_per_partition):
        x = rng.standard_normal(WIDTH, dtype=np.float32)
        yield x, int(np.argmax(x[:4]))


@pytest.mark.spark
def test_a_partition_of_12x_spill_bytes_trains_with_the_worker_peak_rss_bounded(spark):
    """Rank 1 streams a 12 MiB partition with spill_bytes = 1 MiB; rank 0, in the same job, has 64 rows.
    Every task runs in a fresh Python worker, so a task's peak RSS over its start (VmHWM, reset when the
    task begins) holds gradshare's imports and kernels (numba: ~150 MiB), the model and the transport
    alike on both ranks: rank 1's exceeds rank 0's by less than 4 MiB, the data budget (chunks, then
    one window; benchmarks/spill_memory.py), not by the partition's 12 MiB, which held in memory adds its
    size to the peak (the rows are held while the worker's imports load)."""
    from torch import nn

    from gradshare import SharedTrainer
    from gradshare.config.options import Network

    mib, rows = 1 << 20, 3 * 1024  # 3 072 rows of 4 KiB = 12 MiB
    rdd = spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(
        lambda index, _: generated_rows(index, rows if index == 1 else 64)
    )
    result = SharedTrainer(
        lambda: nn.Linear(WIDTH, 4),
        batch_size=64,
        epochs=2,
        seed=0,
        optimizer=lambda p: __import__("torch").optim.SGD(p, lr=0.05),
        port=0,
        verbose=0,
        network=Network(spill_bytes=mib, bind="127.0.0.1"),
    ).fit(rdd)
    small, large = sorted(result.worker_reports, key=lambda r: r["rank"])
    assert [h["epoch"] for h in result.history] == [0, 1] and large["steps_run"] == 2 * rows // 64
    assert result.history[1]["loss"] < result.history[0]["loss"]
    assert large["spilled"] and not small["spilled"] and small["start_rss_bytes"] > 0
    growth = [r["peak_rss_bytes"] - r["start_rss_bytes"] for r in (small, large)]
    assert growth[1] - growth[0] < 4 * mib, f"peak RSS grew by {growth[0] / mib:.1f} / {growth[1] / mib:.1f} MiB"
