"""A retried stage and checkpoints: the relay rolls the fit back to the last checkpoint
so that a fit whose worker was killed ends bit-identical to an uninterrupted one; the killed attempt's
history rows stay; rank 0's early-stopping state and a stop decided before the kill survive the retry."""

import itertools
import os
import sys

import numpy as np
import pytest
from pyspark import cloudpickle

from dying import DiesOnce
from gradshare import SharedTrainer
from gradshare.config.options import FaultTolerance, Network
from gradshare.demo import digits_split
from gradshare.hashing import param_hash
from gradshare.stopping import stop_epoch
from gradshare.transport.protocol.step_meta import StepMeta
from harness import Sim, drive
from transport_util import random_update

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


# ------------------------------------------------------------------------------------ the relay, in memory
def _send_steps(sim, steps, meta_of):
    rng = np.random.default_rng(5)
    for t in steps:
        for r, p in sim.peers.items():
            payload = random_update(rng, sim.N, 20)
            sim.sent[(t, r)] = payload
            p.send_update(t, payload, meta_of(t, r), sim.now)
        drive(sim, lambda: sim.relay.complete_through >= t)


def test_the_relay_hands_a_new_attempt_rank_0s_state_and_rolls_back_to_a_checkpoint():
    """Epochs of 2 steps; rank 0's message after each epoch's end carries its rule state and score."""
    saved = np.arange(500, dtype=np.float32)
    asked = []

    def rollback(complete_through):  # the checkpoint after epoch 1 (2 epochs done): the log through step 3
        asked.append(complete_through)
        return None if complete_through < 3 else (3, saved, 2, 7.0)

    sim = Sim(world_size=2, seed=4, loss=0.05, staleness=0, rollback=rollback)
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    assert asked == [-1] and sim.relay.att.notes == ()  # the first attempt: nothing to inherit

    def meta(t, r):
        out = StepMeta(epoch=t // 2, loss=1.0)
        if r == 0 and t in (2, 4):  # rank 0 scored epoch t//2 - 1 before step t
            out = out.with_(StepMeta(es_best=0.5, es_waited=t // 2 - 1, val_epoch=t // 2 - 1, val_metric=0.25 * t))
        if r == 0 and t == 4:
            out = out.with_(StepMeta(stop_requested=1, stop_epoch=3))
        return out

    _send_steps(sim, range(6), meta)
    tallies = {k: t.as_dict() for k, t in sim.training.epochs.items()}
    assert tallies[(0, 0)]["val_metric"] == 0.5 and tallies[(0, 1)]["val_metric"] == 1.0
    assert sim.training.notes.at(3) == (("es_best", 0.5), ("es_waited", 0.0))
    assert sim.training.notes.at(5) == (
        ("es_best", 0.5),
        ("es_waited", 1.0),
        ("stop_epoch", 3.0),
        ("stop_requested", 1.0),
    )
    # a retried stage: the relay goes back to the checkpoint's step 3, whatever it held after it
    for r in range(2):
        sim.add_peer(r, attempt=1)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    assert asked == [-1, 5]
    for p in sim.peers.values():
        assert p.welcome.start_step == 4
        # what steps 4 and 5 said is gone with them; the checkpoint's epochs count is handed over
        assert p.welcome.notes == (("es_best", 0.5), ("es_waited", 0.0), ("checkpoint", 7.0))
    assert param_hash(sim.relay.params) == param_hash(saved)
    assert sim.relay.admission.rolled_back == [{"attempt": 1, "from": 5, "to": 3}]
    # epoch 2 runs again, whole: its tallies are dropped; epochs 0 and 1 keep the killed attempt's rows
    assert sorted(sim.training.epochs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sim.training.epochs[(0, 1)].val_metric == 1.0


def test_without_a_rollback_a_new_attempt_inherits_the_state_at_the_cut():
    sim = Sim(world_size=2, seed=6, staleness=0)
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    _send_steps(sim, range(4), lambda t, r: StepMeta(es_waited=t) if (r, t) in ((0, 1), (0, 3)) else None)
    for r in range(2):
        sim.add_peer(r, attempt=1)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    assert all(p.welcome.start_step == 4 and p.welcome.notes == (("es_waited", 3.0),) for p in sim.peers.values())


# ------------------------------------------------------------------------------------ on Spark
ROWS = 640  # two partitions of 320 rows: 5 steps per epoch at batch 64 on both ranks


@pytest.fixture(scope="module")
def even(spark):
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train[:ROWS], (int(v) for v in y_train[:ROWS])))
    return spark.sparkContext.parallelize(rows, 2).cache(), (X_test, y_test)


def test_a_killed_worker_rolls_the_fit_back_to_the_last_checkpoint_bit_identically(even, tmp_path):
    rdd, validation = even
    marker = str(tmp_path / "died")
    # rank 1 dies on its 13th step (step 12, inside epoch 2), after the checkpoint of epochs 0-1 (step 9)
    fit = dict(epochs=4, batch_size=64, seed=3, validation_data=validation, **LOOPBACK)
    killed = SharedTrainer(
        lambda: DiesOnce(marker, 1, 13), **fit, fault_tolerance=FaultTolerance(checkpoint_dir=str(tmp_path / "ckpt"))
    ).fit(rdd)
    assert os.path.exists(marker)  # the first attempt really died
    whole = SharedTrainer(lambda: DiesOnce(marker, 1, 13), **fit).fit(rdd)  # the marker is there: no death
    assert killed.param_hash == whole.param_hash
    [back] = killed.extra["rolled_back"]
    assert back["to"] == 9 and back["from"] >= 10  # the relay had gone past the checkpoint, and went back
    assert killed.resumed_from == 10 and all(r["start_step"] == 10 for r in killed.worker_reports)
    # every epoch is whole; epochs 0-1 are the killed attempt's rows (the relay's tallies, scores
    # included), epochs 2-3 the rerun's, and all equal the uninterrupted fit's
    assert [h["steps"] for h in killed.history] == [10] * 4
    assert [h["val_metric"] for h in killed.history] == [h["val_metric"] for h in whole.history]
    assert [h["loss"] for h in killed.history] == pytest.approx([h["loss"] for h in whole.history], rel=1e-12)
    assert all(h["val_metric"] is not None for h in killed.history)


@pytest.fixture(scope="module")
def uneven(spark):
    """673 and 300 rows: 11 and 5 steps per epoch at batch 64."""
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    rdd = (
        spark.sparkContext.parallelize(rows, 2)
        .mapPartitionsWithIndex(lambda i, it: it if i == 0 else itertools.islice(it, 300))
        .cache()
    )
    return rdd, (X_test, y_test)


def test_a_stop_decided_before_a_killed_worker_survives_the_retried_stage(uneven, tmp_path):
    rdd, validation = uneven
    marker = str(tmp_path / "died")
    # patience 0 with min_delta 1.0 on accuracy: epoch 1 asks for the stop; rank 0's step 22 carries it
    # (stop after epoch 4). Rank 0 dies at its step 40 (epoch 3), long after every rank applied it.
    result = SharedTrainer(
        lambda: DiesOnce(marker, 0, 41),
        epochs=8,
        batch_size=64,
        seed=5,
        validation_data=validation,
        early_stopping=dict(patience=0, min_delta=1.0, mode="max"),
        **LOOPBACK,
    ).fit(rdd)
    assert os.path.exists(marker)
    stopped = stop_epoch(22, 0, (11, 5), 8)
    assert stopped == 4 and result.resumed_from > 22
    assert result.extra["stopped_epoch"] == stopped and result.extra["stop_requested_epoch"] == 1
    assert [h["epoch"] for h in result.history] == list(range(stopped + 1))
    assert [r["last_step"] for r in result.worker_reports] == [(stopped + 1) * 11 - 1, (stopped + 1) * 5 - 1]
    assert all(r["param_hash"] == result.param_hash for r in result.worker_reports)
    # epochs 0-2 are the killed attempt's rows (the relay's tallies): their scores came with them
    assert all(h["val_metric"] is not None for h in result.history)
