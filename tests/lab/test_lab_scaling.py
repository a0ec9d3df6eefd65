"""`benchmarks/scaling.py`: its workloads and recipes, arguments, the runs it plans, the tuned-DDP
summary and gaps, and one small lock-step run of each kind of system."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from lab import scaling
from lab.workloads import RECIPES, SCALING_WORKLOADS, load, model_factory


def _args(*argv):
    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "name, rows, features, params",
    [
        ("tabular64k", 64000, 100, 633354),
        pytest.param("mnist1d-mlp", 40000, 40, 551434, marks=pytest.mark.slow),
        ("mnist1d-cnn", 4000, 40, 5210),
    ],
)
def test_workloads_are_generated_at_their_size(name, rows, features, params):
    wl = load(name, 0)
    assert wl.X_train.shape == (rows, features) and wl.X_train.dtype == np.float32 and wl.y_train.dtype == np.int64
    assert set(np.unique(wl.y_train)) == set(range(10))
    model = model_factory(name)()
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.from_numpy(wl.X_test[:3])).shape == (3, 10)


def test_the_cnn_recipe_splits_a_global_batch_of_100():
    cnn = RECIPES["mnist1d-cnn"]
    assert [cnn.batch_for(n) for n in (1, 2, 4, 64)] == [100, 50, 25, 2]
    assert RECIPES["tabular64k"].batch_for(64) == 64  # the MLPs keep 64 rows per worker
    assert np.array_equal(load("mnist1d-cnn", 0).X_train, load("mnist1d-cnn", 1).X_train)  # the paper's data


def test_settings_and_planned_runs():
    cfg = scaling.settings(_args("--workers", "1,4", "--seeds", "0,1", "--systems", "gradshare,ddp"))
    assert cfg["workloads"] == list(SCALING_WORKLOADS) and cfg["epochs"] is None
    planned = scaling.runs(cfg)
    assert ("tabular64k", 1, "ddp", 0) in planned and ("tabular64k", 1, "gradshare", 0) not in planned
    assert len(planned) == len(SCALING_WORKLOADS) * (2 + 2 * 2)  # N=1: ddp × 2 seeds; N=4: 2 systems × 2 seeds
    assert scaling.settings(_args("--quick"))["workers"] == [1, 4]
    with pytest.raises(ValueError, match="--workers takes a comma list of integers >= 1"):
        scaling.settings(_args("--workers", "0,2"))
    with pytest.raises(ValueError, match="--epochs must be >= 1"):
        scaling.settings(_args("--epochs", "0"))


def _row(system, n, seed, acc, lr=1e-3, ratio=1.0):
    return {
        "workload": "w",
        "workers": n,
        "system": system,
        "seed": seed,
        "lr": lr,
        "accuracy": acc,
        "last3": float(np.mean(acc[-3:])),
        "best": max(acc),
        "traffic_ratio": ratio,
        "seconds": 1.0,
        "target": 0.8,
    }


def test_summary_picks_the_best_ddp_lr_and_measures_gaps():
    rows = [_row("ddp", 8, s, [0.5, 0.7, 0.80, 0.80]) for s in (0, 1)]
    rows += [_row("ddp-linear", 8, s, [0.6, 0.8, 0.86, 0.86], lr=8e-3) for s in (0, 1)]
    rows += [_row("gradshare", 8, s, [0.7, 0.82, 0.85, 0.85 + 0.01 * s], ratio=500) for s in (0, 1)]
    summary = scaling.summarise(rows)
    tuned = next(s for s in summary if s["system"] == "ddp-tuned")
    assert tuned["lr"] == 8e-3 and tuned["last3_mean"] == pytest.approx(np.mean([0.8, 0.86, 0.86]))
    gs = next(s for s in summary if s["system"] == "gradshare")
    assert gs["epochs_to_target"] == 2 and gs["traffic_ratio"] == 500 and gs["last3_std"] > 0
    (gap,) = scaling.gaps(summary)
    assert gap["gap_pp"] == pytest.approx(100 * (gs["last3_mean"] - tuned["last3_mean"]))
    assert gap["met"] is (gap["gap_pp"] >= -scaling.GAP_SLACK_PP)


@pytest.mark.parametrize("system", ["gradshare", "local", "ddp-sqrt"])
def test_one_small_lock_step_run(system):
    data = load("tabular64k", 0, None, rows=512)
    cfg = {"epochs": 2}
    row = scaling.run_one("tabular64k", 4, system, 0, cfg, data)
    assert len(row["accuracy"]) == 2 and 0.0 <= row["last3"] <= 1.0
    assert row["lr"] == pytest.approx(1e-3 * (2.0 if system == "ddp-sqrt" else 1.0))
    assert (row["traffic_ratio"] > 50) if system == "gradshare" else row["traffic_ratio"] == 1.0
    assert row["lr_batch"] is None  # the MLP recipes are stated per worker


def test_below_32_workers_the_default_steps_with_momentum_half_and_the_step_capped():
    from lab import lockstep

    data = load("tabular64k", 0, None, rows=512)
    rows = {
        system: scaling.run_one("tabular64k", 4, system, 0, {"epochs": 2}, data)
        for system in ("gradshare", "gradshare-keep", "gradshare-nomomentum")
    }
    explicit = lockstep.run("tabular64k", world=4, epochs=2, data=data, momentum=0.5, step_cap=0.06)
    assert rows["gradshare"]["accuracy"] == [a / 100 for a in explicit["acc"]]  # the planner's row for N = 4
    assert rows["gradshare"]["accuracy"] != rows["gradshare-keep"]["accuracy"]
    assert rows["gradshare"]["accuracy"] != rows["gradshare-nomomentum"]["accuracy"]


@pytest.mark.parametrize("system, lr_batch", [("gradshare", 100), ("local", 100), ("ddp", None)])
def test_a_recipe_at_a_global_batch_gives_the_designs_workers_its_lr_at_that_batch(system, lr_batch):
    data = load("mnist1d-cnn", 0)
    row = scaling.run_one("mnist1d-cnn", 4, system, 0, {"epochs": 1}, data)
    assert (row["lr_batch"], row["batch"], row["lr"]) == (lr_batch, 25, 1e-2)


def test_the_step_cap_experiment_changes_nothing_when_it_never_binds():
    from lab import lockstep

    data = load("tabular64k", 0, None, rows=512)
    plain = lockstep.run("tabular64k", world=4, epochs=2, data=data, step_cap=None)
    loose = lockstep.run("tabular64k", world=4, epochs=2, data=data, step_cap=1e9)
    tight = lockstep.run("tabular64k", world=4, epochs=2, data=data, step_cap=1e-3)
    assert loose["acc"] == plain["acc"] and loose["taus"] == plain["taus"]
    assert tight["acc"] != plain["acc"]  # every step capped at 0.1 % of each tensor's norm


def test_lock_step_ends_with_one_model_on_the_numba_and_the_torch_path_under_a_binding_cap():
    from lab import lockstep

    data = load("tabular64k", 0, None, rows=512)
    numba = lockstep.run("tabular64k", world=4, epochs=2, data=data, step_cap=1e-2)
    tensors = lockstep.run("tabular64k", world=4, epochs=2, data=data, step_cap=1e-2, tensor_state=True)
    assert numba["replicas"] == tensors["replicas"] == 1  # every rank's parameters hash alike
    assert tensors["acc"] == numba["acc"] and tensors["device"] == "cpu"


@pytest.mark.parametrize("system", ["gradshare", "local"])
def test_lr_batch_in_lock_step_is_the_lr_scaled_by_the_square_root_rule(system):
    from lab import lockstep

    data = load("tabular64k", 0, None, rows=512)
    common = {"world": 4, "epochs": 2, "data": data, "system": system, "batch": 16}
    scaled = lockstep.run("tabular64k", lr=1e-3, lr_batch=64, **common)  # × (16 ÷ 64) ** ½ = ½
    assert scaled["acc"] == lockstep.run("tabular64k", lr=5e-4, **common)["acc"]
    assert scaled["acc"] != lockstep.run("tabular64k", lr=1e-3, **common)["acc"]
