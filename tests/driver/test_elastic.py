"""Elastic fits: a checkpoint resumed at another world size, a node lost for good (the fit shrinks), a node
added (it grows), and the options' checks. The cases that need more slots than the shared local[2] session
run in a subprocess (tests/elastic_cases.py); the cluster case starts a standalone master and workers."""

import json
import os
import subprocess
import sys

import pytest

from dying import DiesOnce, Slow
from gradshare import Elastic, SharedTrainer, TrainingError
from gradshare.config import TrainConfig
from gradshare.config.options import Compression, Network
from gradshare.demo import evaluate_accuracy, mlp
from gradshare.task.checkpoint import sources

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


@pytest.fixture(scope="module")
def on_a_cluster():
    """tests/elastic_cases.py's results: one standalone cluster of 3 Worker JVMs, in a subprocess."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "elastic_cases.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("saved, world", [(2, 3), (4, 2), (3, 3), (1, 4), (5, 2)])
def test_every_saved_ranks_residual_goes_to_exactly_one_new_rank(saved, world):
    taken = [r for rank in range(world) for r in sources(rank, saved, world)[1]]
    assert sorted(taken) == list(range(saved))
    owners = [sources(rank, saved, world)[0] for rank in range(world)]
    assert owners[: min(saved, world)] == list(range(min(saved, world)))  # a rank that was there keeps its state
    assert all(0 <= o < saved for o in owners)


def test_elastic_options_are_checked_naming_the_argument():
    with pytest.raises(ValueError, match=r"min_workers=3, max_workers=2\): min_workers is above max_workers"):
        Elastic(3, 2)
    with pytest.raises(ValueError, match=r"Elastic\(min_workers=...\) must be an int >= 1, got 0"):
        Elastic(0, 2)
    with pytest.raises(ValueError, match=r"slot_wait"):
        Elastic(1, 2, slot_wait=-1)
    with pytest.raises(TypeError, match="elastic must be gradshare.Elastic"):
        TrainConfig(elastic=(1, 2))
    with pytest.raises(ValueError, match=r"num_workers=5 is outside elastic's range \[1, 4\]"):
        TrainConfig(elastic=Elastic(1, 4), num_workers=5)
    with pytest.raises(ValueError, match="elastic= needs staleness=0"):
        SharedTrainer(mlp, elastic=Elastic(1, 2), verbose=0, compression=Compression(staleness=1)).fit(None)
    assert Elastic(2, 8, keep_global_batch=True).batch_size(64, 4, 2) == 128
    assert Elastic(2, 8).batch_size(64, 4, 2) == 64


def test_min_workers_above_the_slots_is_refused_before_training(digits_rdd):
    rdd, _ = digits_rdd
    trainer = SharedTrainer(mlp, elastic=Elastic(min_workers=3, max_workers=4), **LOOPBACK)
    with pytest.raises(ValueError, match=r"2 free task slot\(s\) after 0 s, below min_workers=3 .*has 2 slots"):
        trainer.fit(rdd)


def test_a_free_slot_grows_the_fit_at_an_epoch_end(digits_rdd):
    """local[2], a job of one worker: the other slot is free, so the fit grows to two at an epoch's end."""
    rdd, (X_test, y_test) = digits_rdd
    # 10 ms a step: 85 steps, about a second, an epoch at one worker; the grow comes about 3 s in
    result = SharedTrainer(
        lambda: Slow(0.01), epochs=8, batch_size=16, num_workers=1, elastic=Elastic(1, 2), **LOOPBACK
    ).fit(rdd)
    (grow,) = result.extra["reforms"]
    assert (grow["kind"], grow["from"], grow["to"], grow["rows_skipped"]) == ("grow", 1, 2, 0)
    assert 0 < grow["epoch"] < 8 and grow["seconds"] > 0 and grow["steps_redone"] >= 0
    workers = [h["workers"] for h in result.history]
    assert workers == [1] * grow["epoch"] + [2] * (8 - grow["epoch"])
    assert [h["epoch"] for h in result.history] == list(range(8))  # every epoch once
    rows = len(X_test) * 3  # about the training rows: each epoch saw all of them, at one worker or two
    assert all(abs(h["steps"] * 16 - rows) < 16 * 4 for h in result.history)
    grown = result.history[-1]["steps"] // 2  # a rank's steps per epoch at two workers
    assert result.steps == grow["at_step"] + 1 + (8 - grow["epoch"]) * grown
    assert result.world_size == 2 and len({r["param_hash"] for r in result.worker_reports} | {result.param_hash}) == 1
    assert evaluate_accuracy(result.model, X_test, y_test) > 0.8


def test_a_failed_task_re_forms_the_job_from_the_relay_and_flapping_is_bounded(digits_rdd, tmp_path):
    """A worker process dies (os._exit): the stage fails, the driver re-forms the job (the slot is back at once,
    so at the same size) from the relay's parameters, the interrupted epoch again. With max_reforms=0 the same
    death stops the fit, naming the count."""
    rdd, (X_test, y_test) = digits_rdd
    marker = str(tmp_path / "died")
    result = SharedTrainer(
        lambda: DiesOnce(marker, at=30), epochs=3, batch_size=32, elastic=Elastic(1, 2, slot_wait=0.0), **LOOPBACK
    ).fit(rdd)
    assert os.path.exists(marker)
    (shrink,) = result.extra["reforms"]
    spe = result.history[0]["steps"] // 2  # a rank's steps per epoch
    assert (shrink["kind"], shrink["from"], shrink["to"], shrink["epoch"]) == ("shrink", 2, 2, 29 // spe)
    assert shrink["steps_redone"] == shrink["at_step"] + 1 - spe >= 0 and shrink["rows_skipped"] == 0
    assert [h["epoch"] for h in result.history] == [0, 1, 2] and [h["workers"] for h in result.history] == [2] * 3
    assert all(h["steps"] == 2 * spe for h in result.history)
    # the whole training's steps: the first job's complete log, then the second's from the re-run epoch on
    assert result.steps == shrink["at_step"] + 1 + (3 - shrink["epoch"]) * spe
    assert len({r["param_hash"] for r in result.worker_reports} | {result.param_hash}) == 1
    assert evaluate_accuracy(result.model, X_test, y_test) > 0.8
    again = str(tmp_path / "died-again")
    with pytest.raises(TrainingError, match=r"1 re-forms, more than max_reforms=0"):
        SharedTrainer(
            lambda: DiesOnce(again, at=30),
            epochs=3,
            batch_size=32,
            elastic=Elastic(1, 2, slot_wait=0.0, max_reforms=0),
            **LOOPBACK,
        ).fit(rdd)


def test_a_checkpoint_resumes_at_another_world_size(on_a_cluster):
    cases = on_a_cluster["resume"]
    for name, (saved, world) in (("2->3", (2, 3)), ("3->2", (3, 2))):
        case = cases[name]
        assert case["world"] == world
        assert case["reforms"] == [
            {
                "kind": "resume",
                "reason": case["reforms"][0]["reason"],
                "epoch": 1,
                "from": saved,
                "to": world,
                "at_step": None,
                "steps_redone": 0,
                "rows_skipped": 0,
                "seconds": None,
            }
        ]
        # no gradient: P + every rank's unsent update mass is what it was (none lost or doubled by the mapping);
        # some of it moved into P (so a start from other parameters or a lost residual would show)
        assert case["residual_sum_before"] > 0 and case["moved"] > 1e-4
        assert case["mass_diff"] < 1e-5
        assert case["model_equal_relay"]  # the result is the relay's state, which rank 0's checkpoint holds
        assert len(case["hashes"]) == 1  # every new replica and the relay
        assert case["history_epochs"] == [1] and case["steps"] == [960 // 40]  # every row, at either size


def test_a_fit_grows_onto_a_free_node_and_shrinks_when_a_node_is_lost_for_good(on_a_cluster):
    """A standalone cluster of 3 workers, a fit started at 2: it grows to 3 at an epoch's end, then rank 2's
    node (its Worker daemon and executor JVM) is killed inside an epoch, and the fit finishes at 2."""
    out = on_a_cluster["cluster"]
    assert len(out["reforms"]) == 2, out["reforms"]
    grow, shrink = out["reforms"]
    assert (grow["kind"], grow["from"], grow["to"], grow["rows_skipped"]) == ("grow", 2, 3, 0), out["reforms"]
    assert (shrink["kind"], shrink["from"], shrink["to"], shrink["rows_skipped"]) == ("shrink", 3, 2, 0)
    assert grow["seconds"] > 0 and shrink["seconds"] > 0
    # the kill came at rank 2's 50th step, inside the grown job's third epoch (20 steps an epoch): that
    # epoch runs again from its start at 2 workers, the 9 steps done of it counted as redone
    assert shrink["epoch"] == grow["epoch"] + 2 and shrink["steps_redone"] == 9
    workers = out["workers"]
    assert workers == [2] * grow["epoch"] + [3] * (shrink["epoch"] - grow["epoch"]) + [2] * (20 - shrink["epoch"])
    assert out["epochs"] == list(range(20)) and out["world"] == 2
    assert all(s == 60 for s in out["steps"])  # 960 rows of batch 16: every row once an epoch, at 2 or 3 workers
    assert len(out["hashes"]) == 1  # every replica of the last job and the relay (fit checks it too)
    assert out["accuracy"] > 0.85
