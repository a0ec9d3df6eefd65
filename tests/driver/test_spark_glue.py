"""gradshare.driver.session and gradshare.replica.flat: data validation, materialisation (memory and spill), slots,
buffer."""

import os

import numpy as np
import pytest
import torch
from torch import nn

from gradshare.driver.session import check_barrier_slots, check_summaries, total_slots
from gradshare.replica.flat import FlatParams
from gradshare.task.partition import PartitionData, epoch_order, summarise_partition


def rows(n, dim=3, label=lambda i: i % 4):
    return [(np.arange(dim, dtype=np.float64) + i, label(i)) for i in range(n)]


def test_summary_counts_rows_and_layout():
    s = summarise_partition(3, iter(rows(5)))
    assert (s.index, s.rows, s.feature_shape, s.label_kind, s.error) == (3, 5, (3,), "int", None)


@pytest.mark.parametrize(
    "bad, kind, needle",
    [
        ([], ValueError, "partition 1 is empty"),
        (rows(2) + [(np.zeros(4), 1)], ValueError, "partition 1 row 2: features of shape (4,)"),
        (rows(2) + [(np.zeros(3), "cat")], TypeError, "partition 1 row 2: label 'cat'"),
        (rows(1) + [(np.zeros(3), None)], TypeError, "partition 1 row 1: label None"),
        (rows(1) + [(np.zeros(3), True)], TypeError, "is a bool"),
        (rows(1) + [("abc", 1)], TypeError, "partition 1 row 1: features"),
        (rows(1) + [(np.zeros(3),)], TypeError, "(features, label) pair"),
    ],
)
def test_bad_partition_is_reported_with_partition_and_row(bad, kind, needle):
    s = summarise_partition(1, iter(bad))
    with pytest.raises(kind) as exc:
        check_summaries([summarise_partition(0, iter(rows(2))), s])
    assert needle in str(exc.value)


def test_partitions_must_agree_on_feature_shape():
    a = summarise_partition(0, iter(rows(3, dim=3)))
    b = summarise_partition(1, iter(rows(3, dim=5)))
    with pytest.raises(ValueError, match=r"partition 1 has features of shape \(5,\), partition 0 has \(3,\)"):
        check_summaries([b, a])


def test_int_and_float_labels_mix_to_float():
    a = summarise_partition(0, iter(rows(3)))
    b = summarise_partition(1, iter(rows(3, label=lambda i: i * 0.5)))
    assert check_summaries([a, b]).label_kind == "float"


def test_partition_data_in_memory_and_spilled_are_equal(tmp_path):
    data = rows(1000, dim=8)
    mem = PartitionData.from_rows(iter(data), "int64", chunk_rows=64)
    spilled = PartitionData.from_rows(iter(data), "int64", spill_bytes=10_000, spill_dir=str(tmp_path), chunk_rows=64)
    try:
        assert mem.spill_path is None and spilled.spill_path is not None
        assert not mem.spilled and spilled.spilled  # features and labels in the file, nothing mapped
        (features,), labels = spilled.read(0, len(spilled))
        np.testing.assert_array_equal(mem.features, features)
        np.testing.assert_array_equal(mem.labels, labels)
        assert mem.features.dtype == np.float32 and mem.labels.dtype == np.int64
        assert len(spilled) == 1000
        path = spilled.spill_path
    finally:
        spilled.close()
    assert not os.path.exists(path)


def test_partition_data_rejects_empty_and_ragged():
    with pytest.raises(ValueError, match="partition 2 is empty"):
        PartitionData.from_rows(iter([]), "int64", index=2)
    with pytest.raises(ValueError, match="partition 0 row 1"):
        PartitionData.from_rows(iter([(np.zeros(2), 1), (np.zeros(3), 1)]), "int64")


def test_epoch_order_is_seeded_per_rank_and_epoch():
    a = epoch_order(50, seed=7, rank=1, epoch=2)
    assert sorted(a) == list(range(50))
    np.testing.assert_array_equal(a, epoch_order(50, seed=7, rank=1, epoch=2))
    assert not np.array_equal(a, epoch_order(50, seed=7, rank=1, epoch=3))
    assert not np.array_equal(a, epoch_order(50, seed=7, rank=0, epoch=2))


def test_flat_params_are_views_into_one_buffer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    flat = FlatParams(model)
    assert flat.n_params == 4 * 3 + 3 + 3 * 2 + 2
    np.testing.assert_array_equal(flat.array, before.numpy())
    flat.array[:] += 1.0  # writing the array changes the module without copies
    np.testing.assert_array_equal(
        torch.cat([p.detach().flatten() for p in model.parameters()]).numpy(), before.numpy() + 1.0
    )
    out = model(torch.ones(1, 4)).sum()
    out.backward()  # autograd still works on the views
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    assert not np.array_equal(flat.array, before.numpy() + 1.0)
    with pytest.raises(ValueError, match=r"shape \(3,\), the model needs \(23,\)"):
        flat.load(np.zeros(3, np.float32))
    twin = flat.keep_twin()  # a separate copy that load() keeps equal
    assert flat.keep_twin() is twin and not np.shares_memory(twin, flat.array)
    np.testing.assert_array_equal(twin, flat.array)
    flat.load(np.arange(23, dtype=np.float32))
    assert twin.tolist() == flat.array.tolist() == list(range(23))
    versions = flat.versions()
    with torch.no_grad():
        model[2].bias += 100  # an in-place change through the Parameter moves its version counter
    changed = [i for i, (a, b) in enumerate(zip(versions, flat.versions())) if a != b]
    assert changed == [3] and flat.array[-1] == 122.0 and twin[-1] == 22.0


def test_flat_params_reject_frozen_and_float64_models():
    frozen = nn.Linear(3, 2)
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        FlatParams(frozen)
    with pytest.raises(ValueError, match="no trainable parameters"):
        FlatParams(nn.ReLU())
    with pytest.raises(TypeError, match="float64"):
        FlatParams(nn.Linear(2, 2).double())


@pytest.mark.spark
def test_slot_check_names_needed_and_free(spark):
    sc = spark.sparkContext
    assert total_slots(sc) == 2
    check_barrier_slots(sc, 2)
    with pytest.raises(ValueError, match=r"3 workers need 3 free slots.*has 2 slots \(0 busy, 2 free\)"):
        check_barrier_slots(sc, 3)


@pytest.mark.spark
def test_executors_import_this_tree(spark):
    import gradshare

    here = os.path.dirname(gradshare.__file__)
    seen = spark.sparkContext.parallelize(range(2), 2).map(lambda _: __import__("gradshare").__file__).collect()
    assert {os.path.dirname(p) for p in seen} == {here}
