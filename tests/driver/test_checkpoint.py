"""Checkpoints: a fit stopped and resumed from its checkpoint ends bit-identical to
an uninterrupted one; bad checkpoint_dir / resume_from / corrupt checkpoints fail before training."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
from pyspark import cloudpickle

from gradshare import SharedTrainer
from gradshare.config.options import Compression, FaultTolerance, Network
from gradshare.demo import digits_split, mlp
from gradshare.driver.checkpoint import rollback_point
from gradshare.errors import CheckpointError
from gradshare.task.checkpoint import MANIFEST
from gradshare.task.config import CheckpointPlan
from gradshare.task.stores import HadoopStore
from gradshare.transport import param_hash
from lab.flat_options import in_groups

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)
ROWS = 640  # two partitions of 320 rows: 5 steps per epoch at batch 64 on both ranks


def step_lr(optimizer):
    import torch

    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)


def doubled_mlp():
    import torch

    model = mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    return model


def trainer(epochs, **options):
    # threshold="auto" with a 2-epoch warm-up (given: the default's 24-step floor would cover the whole
    # 20-step fit) and a per-step schedule: τ's step count, the residual's lr and Adam's moments must
    # all carry over for the resumed run to match
    return SharedTrainer(
        mlp,
        epochs=epochs,
        batch_size=64,
        seed=3,
        lr_scheduler=step_lr,
        **in_groups({**LOOPBACK, "warmup": 2.0, **options}),
    )  # grouped options named flat


@pytest.fixture(scope="module")
def rdd(spark):
    X_train, _, y_train, _ = digits_split(0)
    rows = list(zip(X_train[:ROWS], (int(v) for v in y_train[:ROWS])))
    return spark.sparkContext.parallelize(rows, 2).cache()


@pytest.fixture(scope="module")
def checkpointed(rdd, tmp_path_factory):
    """(checkpoint_dir of a 2-epoch fit that wrote one after each epoch, that fit's result)."""
    root = str(tmp_path_factory.mktemp("ckpt") / "run")
    return root, trainer(2, checkpoint_dir=root).fit(rdd)


@pytest.fixture(scope="module")
def whole(rdd):
    """The uninterrupted 4-epoch fit every resumed one must equal."""
    return trainer(4).fit(rdd)


def test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run(rdd, checkpointed, whole):
    root, first = checkpointed
    assert sorted(os.listdir(root)) == ["epoch-00001", "epoch-00002"]
    resumed = trainer(4).fit(rdd, resume_from=root)  # the dir: its latest checkpoint, after epoch 1
    assert resumed.param_hash == whole.param_hash
    assert [h["epoch"] for h in resumed.history] == [2, 3]
    assert resumed.extra["resumed_from"] == os.path.join(root, "epoch-00002")
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history[2:]]
    # a checkpoint written in the middle of a fit (after epoch 0 of 2) resumes as exactly
    middle = trainer(4).fit(rdd, resume_from=os.path.join(root, "epoch-00001"))
    assert middle.param_hash == whole.param_hash
    # the 2-epoch fit's own result is the state its last checkpoint holds
    assert param_hash(np.load(os.path.join(root, "epoch-00002", "params.npy"))) == first.param_hash


def test_a_capped_fit_resumes_bit_identically_with_its_first_bounds(rdd, whole, tmp_path):
    # step_cap=0.01 binds on this model at N = 2 (lock step: 2 epochs of the MLP end 20 pp lower)
    capped = trainer(4, step_cap=0.01).fit(rdd)
    assert capped.param_hash != whole.param_hash
    assert capped.extra["step_cap"] == 0.01 and whole.extra["step_cap"] == 0.06  # "auto" at N = 2: 0.06
    assert {r["param_hash"] for r in capped.worker_reports} == {capped.param_hash}
    root = str(tmp_path / "capped")
    trainer(2, step_cap=0.01, checkpoint_dir=root).fit(rdd)
    with open(os.path.join(root, "epoch-00002", MANIFEST)) as f:
        job = json.load(f)["job"]
    assert job["step_cap"] == 0.01 and len(job["step_shares"]) == len(list(mlp().parameters()))
    resumed = trainer(4, step_cap=0.01).fit(rdd, resume_from=root)
    assert resumed.param_hash == capped.param_hash
    # the cap reads the checkpoint's parameters, and which tensors it caps from the checkpoint's job, not
    # from the model given to the resumed fit (here twice as large)
    other = SharedTrainer(
        doubled_mlp,
        epochs=4,
        batch_size=64,
        seed=3,
        lr_scheduler=step_lr,
        **LOOPBACK,
        compression=Compression(warmup=2.0, step_cap=0.01),
    ).fit(rdd, resume_from=os.path.join(root, "epoch-00001"))
    assert other.param_hash == capped.param_hash
    with pytest.raises(ValueError, match="its step_cap is 0.01, this fit's is None"):
        trainer(4, step_cap=None).fit(rdd, resume_from=root)
    # "auto" goes on with the checkpoint's cap, whatever "auto" means now
    assert trainer(4).fit(rdd, resume_from=root).param_hash == capped.param_hash


def test_a_fit_with_the_workers_momentum_off_resumes_bit_identically(rdd, whole, tmp_path):
    off = trainer(4, optimizer_momentum="off").fit(rdd)
    assert off.param_hash != whole.param_hash  # "auto" at N = 2 steps with β1 0.5: these differ
    root = str(tmp_path / "off")
    trainer(2, optimizer_momentum="off", checkpoint_dir=root).fit(rdd)
    assert trainer(4, optimizer_momentum="off").fit(rdd, resume_from=root).param_hash == off.param_hash


def test_a_checkpoint_holds_each_workers_state_with_checksums(checkpointed):
    root, _ = checkpointed
    manifest = json.load(open(os.path.join(root, "epoch-00002", MANIFEST)))
    assert manifest["epochs_done"] == 2 and manifest["job"]["steps_per_epoch"] == [5, 5]
    assert set(manifest["files"]) == {"params.npy"} | {
        f"rank-{r}/{n}" for r in (0, 1) for n in ("residual.npy", "point.npy", "local.pt", "state.json")
    }  # point: the folded view's q
    state = json.load(open(os.path.join(root, "epoch-00002", "rank-1", "state.json")))
    assert state["rule"]["warmup_steps"] == 10 and state["lr"] is not None


def _copy(root, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(os.path.join(root, "epoch-00002"), target)
    return target


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: open(d / "rank-1" / "residual.npy", "r+b").write(b"\x00" * 200), "residual.npy is corrupt"),
        (lambda d: os.truncate(d / "rank-0" / "local.pt", 100), "local.pt is corrupt or truncated"),
        (lambda d: os.remove(d / "params.npy"), "params.npy is missing"),
        (lambda d: os.remove(d / MANIFEST), "no complete checkpoint"),
        (lambda d: open(d / MANIFEST, "w").write("{"), "unreadable manifest"),
    ],
)
def test_a_damaged_checkpoint_is_refused_before_any_job(rdd, checkpointed, tmp_path, damage, match):
    target = _copy(checkpointed[0], tmp_path, "damaged")
    damage(target)
    with pytest.raises(CheckpointError, match=match):
        trainer(4).fit(rdd, resume_from=str(target))


def test_a_checkpoint_of_another_model_or_job_is_refused_naming_both(rdd, checkpointed):
    root, _ = checkpointed
    wider = SharedTrainer(lambda: mlp(64), epochs=4, batch_size=64, seed=3, lr_scheduler=step_lr, **LOOPBACK)
    with pytest.raises(ValueError, match=r"0\.weight has shape \(128, 64\) there and \(64, 64\) in this model"):
        wider.fit(rdd, resume_from=root)
    with pytest.raises(ValueError, match="its seed is 3, this fit's is 4"):
        SharedTrainer(mlp, epochs=4, batch_size=64, seed=4, **LOOPBACK).fit(rdd, resume_from=root)
    with pytest.raises(ValueError, match="2 epoch"):
        trainer(2).fit(rdd, resume_from=root)
    with pytest.raises(ValueError, match="already holds epoch-00001, epoch-00002"):
        trainer(1, checkpoint_dir=root).fit(rdd)  # never mixes its files with another fit's


def test_bad_checkpoint_options(rdd, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="checkpoint_dir=.* is not writable"):
        trainer(1, checkpoint_dir=str(blocker / "ckpt")).fit(rdd)
    with pytest.raises(ValueError, match='checkpoint_dir=.* is not writable: .*No FileSystem for scheme "nosuchfs"'):
        trainer(1, checkpoint_dir="nosuchfs://somewhere/ckpt").fit(rdd)
    with pytest.raises(ValueError, match="staleness=0"):
        trainer(1, checkpoint_dir=str(tmp_path), staleness=1)
    with pytest.raises(ValueError, match="checkpoint_every"):
        trainer(1, checkpoint_dir=str(tmp_path), checkpoint_every=0)


# ------------------------------------------------------------------------------------ through Hadoop's FileSystem
@pytest.fixture(scope="module")
def viewfs(spark, tmp_path_factory):
    """A Hadoop-FS URI that is no local path: viewfs://gradshare-test/ckpt, a Hadoop mount of a local
    directory (Hadoop's ViewFileSystem). Executors cannot open it with file I/O: workers must reach it
    through the driver's checkpoint service, and the driver through Spark's FileSystem API."""
    local = tmp_path_factory.mktemp("hadoop")
    spark.sparkContext._jsc.hadoopConfiguration().set(
        "fs.viewfs.mounttable.gradshare-test.link./ckpt", f"file://{local}"
    )
    return "viewfs://gradshare-test/ckpt", str(local)


def test_a_hadoop_fs_checkpoint_dir_stops_and_resumes_bit_identically(spark, rdd, viewfs, whole):
    uri, local = viewfs
    first = trainer(2, checkpoint_dir=f"{uri}/run").fit(rdd)
    # the files are there, written through Hadoop (its local filesystem leaves .crc checksum files)
    assert sorted(n for n in os.listdir(os.path.join(local, "run")) if n.startswith("epoch-")) == [
        "epoch-00001",
        "epoch-00002",
    ]
    assert os.path.exists(os.path.join(local, "run", "epoch-00002", ".manifest.json.crc"))
    assert param_hash(np.load(os.path.join(local, "run", "epoch-00002", "params.npy"))) == first.param_hash
    # resumed through the same API: the driver reads the manifest and parameters, the workers their state
    resumed = trainer(4, checkpoint_dir=f"{uri}/more").fit(rdd, resume_from=f"{uri}/run")
    assert resumed.param_hash == whole.param_hash
    assert resumed.extra["resumed_from"] == f"{uri}/run/epoch-00002"
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history[2:]]
    assert sorted(n for n in os.listdir(os.path.join(local, "more")) if n.startswith("epoch-")) == [
        "epoch-00003",
        "epoch-00004",
    ]
    # a retried stage's rollback point, read through Hadoop by the relay: the latest checkpoint the log
    # has reached (5 steps an epoch: epoch-00002 holds the log through step 9)
    job = json.load(open(os.path.join(local, "run", "epoch-00002", MANIFEST)))["job"]
    plan, stores = CheckpointPlan(f"{uri}/run", 1, job), {"checkpoint": HadoopStore(spark.sparkContext, f"{uri}/run")}
    assert rollback_point(plan, None, stores, 0, 5, 3) is None  # before the first checkpoint: none
    through, params, done, _ = rollback_point(plan, None, stores, 0, 5, 12)
    assert (through, done) == (9, 2) and param_hash(params) == first.param_hash
    # a damaged file is refused before any job, as on the local path; a rollback passes over it
    with open(os.path.join(local, "run", "epoch-00002", "rank-1", "state.json"), "r+b") as f:
        f.write(b"#")
    with pytest.raises(CheckpointError, match="state.json is corrupt"):
        trainer(4).fit(rdd, resume_from=f"{uri}/run")
    assert rollback_point(plan, None, stores, 0, 5, 12)[:1] == (4,)  # epoch-00001's step


def test_a_resume_inside_the_warm_up_is_bit_identical_whatever_the_rounding(spark, tmp_path):
    """Partitions of 673 and 674 rows, resumed after epoch 0 of a 2-epoch warm-up: the folded local view's
    point q = P + s·r does not survive r = (q − P)/s and back bit for bit there; the checkpoint keeps q."""
    X_train, _, y_train, _ = digits_split(0)
    rows = spark.sparkContext.parallelize(list(zip(X_train, (int(v) for v in y_train))), 2).cache()
    assert rows.glom().map(len).collect() == [673, 674]
    options = dict(epochs=3, batch_size=64, seed=4, **LOOPBACK, compression=Compression(warmup=2.0))
    root = str(tmp_path / "ckpt")
    whole = SharedTrainer(mlp, **options, fault_tolerance=FaultTolerance(checkpoint_dir=root)).fit(rows)
    assert all(os.path.exists(os.path.join(root, "epoch-00001", f"rank-{r}", "point.npy")) for r in (0, 1))
    resumed = SharedTrainer(mlp, **options).fit(rows, resume_from=os.path.join(root, "epoch-00001"))
    assert resumed.param_hash == whole.param_hash
