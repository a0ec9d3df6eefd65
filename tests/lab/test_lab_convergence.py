"""`benchmarks/convergence.py`: argument checks, the one LR schedule factory every system uses,
the summary and target checks on synthetic rows, the tabular workload, and one small real run of all three
systems on the shared local[2] Spark session."""

import argparse
import json
import math
import pickle

import numpy as np
import pytest

from gradshare.config.options import Network
from lab import convergence, convergence_runs


def _args(*argv):
    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    return parser.parse_args(list(argv))


# ------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--workloads", "mlp,resnet"), "--workloads"),
        (("--schedules", "cosine,linear"), "--schedules"),
        (("--systems", "gradshare,powersgd"), "--systems"),
        (("--seeds", "0,x"), "--seeds"),
        (("--seeds", "0,0"), "--seeds"),
        (("--seeds", "-1"), "--seeds"),
        (("--workers", "1,2"), "--workers"),
        (("--workers", ""), "--workers"),
        (("--epochs", "0"), "--epochs"),
        (("--batch-size", "0"), "--batch-size"),
        (("--rows", "0"), "--rows"),
        (("--budget", "0"), "--budget"),
        (("--threshold", "-0.01"), "--threshold"),
        (("--threshold", "automatic"), "--threshold"),
        (("--threshold", "nan"), "--threshold"),
    ],
)
def test_settings_reject_bad_arguments_naming_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        convergence.settings(_args(*argv))


def test_settings_defaults_and_quick():
    cfg = convergence.settings(_args())
    assert cfg["workloads"] == ["mlp", "cnn", "tabular"] and cfg["schedules"] == ["constant", "cosine", "step"]
    assert cfg["seeds"] == [0, 1, 2] and cfg["workers"] == [2, 4] and cfg["threshold"] == "auto"
    assert cfg["epochs"] == convergence.DEFAULT_EPOCHS and cfg["rows"] is None
    assert convergence.settings(_args("--threshold", "1e-2"))["threshold"] == 0.01
    assert convergence.settings(_args("--workers", "4,2"))["workers"] == [2, 4]
    quick = convergence.settings(_args("--quick"))
    assert quick["rows"] == convergence.QUICK["rows"] and quick["seeds"] == [0] and quick["workers"] == [2]
    assert quick["schedules"] == ["cosine"] and set(quick["epochs"].values()) == {convergence.QUICK["epochs"]}
    explicit = convergence.settings(_args("--quick", "--schedules", "step", "--epochs", "1", "--seeds", "3"))
    assert explicit["schedules"] == ["step"] and explicit["seeds"] == [3] and set(explicit["epochs"].values()) == {1}


# ------------------------------------------------------------------------------------------ schedules
def _lrs(schedule, total, steps, lr=1e-3):
    """lr of each optimizer step of a real Adam stepped with the factory's scheduler (pickled, as shipped)."""
    import torch

    from lab import systems

    factory = pickle.loads(pickle.dumps(systems.lr_scheduler_factory(schedule, total)))
    p = torch.nn.Parameter(torch.zeros(3))
    opt = systems.adam([p], lr=lr)
    scheduler = factory(opt)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        before = p.detach().clone()
        opt.step()
        if out[-1] == 0.0:
            assert torch.equal(p.detach(), before)  # lr exactly 0: Adam moves nothing, no error
        scheduler.step()
    return out


def test_schedule_factory_matches_the_formulas():
    T = 8
    assert _lrs("constant", T, T + 2) == [1e-3] * (T + 2)
    cosine = _lrs("cosine", T, T + 3)
    assert cosine[: T + 1] == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * t / T)) for t in range(T + 1)])
    assert cosine[T:] == [0.0, 0.0, 0.0]  # exactly 0 from step T on (a rank stepping past T stays there)
    assert cosine[T - 1] > 0  # the run's own last step still moves the model
    # ×0.1 once half the steps are done, again at three quarters
    assert _lrs("step", T, T + 1) == pytest.approx([1e-3] * 4 + [1e-4] * 2 + [1e-5] * 3)
    assert _lrs("step", 10, 10) == pytest.approx([1e-3] * 5 + [1e-4] * 2 + [1e-5] * 3)


def test_schedule_factory_rejects_bad_arguments_before_any_executor():
    from lab import systems

    with pytest.raises(ValueError, match="lr schedule"):
        systems.lr_scheduler_factory("linear", 10)
    with pytest.raises(ValueError, match="total_steps"):
        systems.lr_scheduler_factory("cosine", 0)


def test_single_process_reaches_lr_zero_without_trouble():
    from lab import systems, workloads

    wl = workloads.load("tabular", 0, rows=128)
    m = systems.run_single(wl, epochs=2, batch_size=64, seed=0, budget=60, lr_schedule="cosine")
    assert len(m.walls) == 4 and len(m.curve) == 2 and all(0 <= a <= 1 for _, a in m.curve)


def test_a_configuration_out_of_budget_is_a_failed_row_with_its_curve():
    cfg = convergence.settings(
        _args(
            "--workloads",
            "tabular",
            "--systems",
            "single",
            "--rows",
            "256",
            "--epochs",
            "2",
            "--seeds",
            "0",
            "--schedules",
            "step",
            "--budget",
            "1e-9",
        )
    )
    rows, parts = convergence_runs.run_configs(cfg, spark=None)
    (row,) = rows
    assert row["status"] == "error" and "budget after 1 of 2 epochs" in row["error"]
    assert len(row["accuracy"]) == 1 and row["steps"] == 1 and parts[0]["failed"] == 1
    (entry,) = convergence.summarise(rows)
    assert entry["seeds"] == [] and entry["mean"] == [] and entry["failed"][0]["seed"] == 0
    assert "failed seeds [0]: stopped by the per-configuration budget" in convergence.table([entry])


# ------------------------------------------------------------------------------------------ summary and checks
def _row(system, workers, seed, accuracy, *, workload="mlp", schedule="cosine", ratio=None, status="ok"):
    from lab.report import final_accuracy

    return {
        "system": system,
        "workload": workload,
        "schedule": schedule,
        "seed": seed,
        "workers": workers,
        "status": status,
        "target": 0.9,
        "accuracy": accuracy,
        "final_accuracy": final_accuracy([(0, a) for a in accuracy]),
        "epochs_to_target": convergence_runs.epochs_to_target(accuracy, 0.9),
        "bytes_per_step": 1000.0 if system == "gradshare" else 4e7,
        "wall_seconds": 5.0,
        "elapsed": 7.0,
        "traffic_ratio": ratio if system == "gradshare" else (1.0 if system == "ddp" else None),
    }


def test_epochs_to_target_is_the_first_crossing():
    assert convergence_runs.epochs_to_target([0.5, 0.91, 0.89, 0.95], 0.9) == 2
    assert convergence_runs.epochs_to_target([0.5, 0.9], 0.9) == 2  # ≥, not >
    assert convergence_runs.epochs_to_target([0.5, 0.8], 0.9) is None
    assert convergence_runs.epochs_to_target([], 0.9) is None


def test_summary_and_target_checks_met_and_missed():
    rows = [
        # N=2: gradshare crosses 0.9 (mean) at epoch 2 like DDP, final 0.17 pp under, 400x traffic: all met
        _row("gradshare", 2, 0, [0.80, 0.91, 0.95, 0.96, 0.97], ratio=390.0),
        _row("gradshare", 2, 1, [0.70, 0.90, 0.94, 0.96, 0.96], ratio=410.0),
        _row("ddp", 2, 0, [0.85, 0.92, 0.95, 0.96, 0.96]),
        _row("ddp", 2, 1, [0.80, 0.90, 0.95, 0.96, 0.97]),
        # N=4: gradshare later (epoch 3 vs 2), 2.3 pp lower, 250x traffic: all missed
        _row("gradshare", 4, 0, [0.60, 0.85, 0.92, 0.94, 0.95], ratio=250.0),
        _row("gradshare", 4, 1, [0.60, 0.80, 0.90, 0.94, 0.95], ratio=250.0),
        _row("gradshare", 4, 2, [], status="error"),
        _row("ddp", 4, 0, [0.80, 0.91, 0.95, 0.96, 0.96]),
        _row("ddp", 4, 1, [0.80, 0.91, 0.95, 0.96, 0.96]),
        _row("single", 1, 0, [0.9, 0.95, 0.96, 0.97, 0.97]),
    ]
    rows[6]["error"] = "TimeoutError: cancelled"
    summary = convergence.summarise(rows)
    assert [(s["workers"], s["system"]) for s in summary] == [
        (1, "single"),
        (2, "gradshare"),
        (2, "ddp"),
        (4, "gradshare"),
        (4, "ddp"),
    ]
    gs2 = summary[1]
    assert gs2["mean"] == pytest.approx([0.75, 0.905, 0.945, 0.96, 0.965])
    assert gs2["std"][0] == pytest.approx(np.std([0.8, 0.7], ddof=1))
    assert gs2["epochs_to_target"] == 2 and gs2["epochs_to_target_per_seed"] == [2, 2]
    assert gs2["final_mean"] == pytest.approx(np.mean([(0.95 + 0.96 + 0.97) / 3, (0.94 + 0.96 + 0.96) / 3]))
    assert gs2["traffic_ratio"] == pytest.approx(400.0) and gs2["seeds"] == [0, 1]
    gs4 = summary[3]
    assert gs4["seeds"] == [0, 1] and gs4["failed"] == [{"seed": 2, "error": "TimeoutError: cancelled"}]
    assert gs4["epochs_to_target"] == 3 and summary[0]["std"] == [None] * 5  # one seed: no std

    found = {(c["workers"], c["check"]): c for c in convergence.checks(summary)}
    assert len(found) == 6  # 3 checks × N ∈ {2, 4}; single is not checked
    final2 = found[(2, "final acc. gradshare − DDP (pp)")]
    assert final2["value"] == pytest.approx(-1 / 6) and final2["met"]  # 95.67 vs 95.83 %
    assert found[(2, "epochs to target: gradshare ≤ DDP")]["met"] is True
    assert found[(2, "dense ÷ gradshare traffic")]["met"] is True
    assert found[(4, "final acc. gradshare − DDP (pp)")]["value"] == pytest.approx(-7 / 3)
    assert found[(4, "final acc. gradshare − DDP (pp)")]["met"] is False
    ett4 = found[(4, "epochs to target: gradshare ≤ DDP")]
    assert (ett4["value"], ett4["limit"], ett4["met"]) == (3, 2, False)
    assert found[(4, "dense ÷ gradshare traffic")]["met"] is False
    text = convergence.checks_table(convergence.checks(summary))
    assert text.count("MISSED") == 3 and text.count(" met") == 3
    assert "failed seeds [2]" in convergence.table(summary)


def test_checks_when_a_side_is_missing_or_never_reaches_the_target():
    rows = [
        _row("gradshare", 2, 0, [0.5, 0.6], workload="tabular"),
        _row("ddp", 2, 0, [0.5, 0.55], workload="tabular"),
        _row("gradshare", 2, 0, [0.5, 0.95], workload="cnn", ratio=150.0),
    ]
    found = {(c["workload"], c["check"]): c for c in convergence.checks(convergence.summarise(rows))}
    assert found[("tabular", "epochs to target: gradshare ≤ DDP")]["met"] is False  # neither reached it
    assert ("tabular", "dense ÷ gradshare traffic") not in found  # no traffic target on tabular
    assert found[("cnn", "final acc. gradshare − DDP (pp)")]["met"] is None  # no DDP rows: not measured
    assert found[("cnn", "dense ÷ gradshare traffic")]["met"] is True  # ≥ 100x on the CNN


# ------------------------------------------------------------------------------------------ tabular workload
def test_tabular_workload_shapes_parameters_and_split():
    from lab import workloads

    wl = workloads.load("tabular", 0)
    assert wl.X_train.shape == (6000, 100) and wl.X_test.shape == (2000, 100)
    assert wl.X_train.dtype == np.float32 and wl.y_train.dtype == np.int64
    assert sorted(set(wl.y_train.tolist())) == [0, 1, 2, 3, 4] and wl.target == workloads.TARGETS["tabular"]
    assert np.allclose(wl.X_train.mean(axis=0), 0, atol=1e-5) and np.allclose(wl.X_train.std(axis=0), 1, atol=1e-4)
    train_share = np.bincount(wl.y_train) / len(wl.y_train)
    assert np.allclose(train_share, np.bincount(wl.y_test) / len(wl.y_test), atol=1e-3)  # stratified
    model = workloads.model_factory("tabular")()
    assert sum(p.numel() for p in model.parameters()) == 630_789  # 100→1024→512→5
    assert np.array_equal(workloads.load("tabular", 0).X_train, wl.X_train)  # the seed decides the data
    assert not np.array_equal(workloads.load("tabular", 1).X_train, wl.X_train)
    assert workloads.load("tabular", 0, rows=100).X_train.shape == (100, 100)


# ------------------------------------------------------------------------------------------ real runs
@pytest.mark.spark
def test_gradshare_steps_at_lr_zero_do_not_crash(spark):
    # A cosine factory over 2 steps on a 4-step run: the workers take their last 2 steps at lr exactly 0.
    from gradshare.driver.trainer import SharedTrainer
    from lab import systems, workloads

    wl = workloads.load("tabular", 0, rows=256)
    trainer = SharedTrainer(
        workloads.tabular,
        optimizer=systems.adam,
        lr_scheduler=systems.lr_scheduler_factory("cosine", 2),
        num_workers=2,
        port=0,
        batch_size=64,
        epochs=2,
        verbose=0,
        validation_data=(wl.X_test, wl.y_test),
        network=Network(bind="127.0.0.1", advertise_host="127.0.0.1"),
    )
    result = trainer.fit(systems.sharded_rdd(spark.sparkContext, wl, 2))
    last = result.history[-1]
    assert last["lr"] == 0.0 and last["silent_steps"] == last["steps"] == 4 and last["sparsity"] == 0.0
    assert 0 <= last["val_metric"] <= 1


# ------------------------------------------------------------------------------------------ real run
@pytest.mark.spark
def test_sharded_rdd_partitions_are_the_ddp_shards(spark):
    from lab import systems, workloads

    wl = workloads.load("tabular", 0, rows=3000)  # parallelize(rows, 2) would give 2048 / 952 rows
    parts = systems.sharded_rdd(spark.sparkContext, wl, 2).glom().collect()
    for rank, part in enumerate(parts):
        X, y = wl.shard(rank, 2)
        assert len(part) == len(y) == 1500
        assert np.array_equal(np.stack([x for x, _ in part]), X) and [lab for _, lab in part] == y.tolist()


@pytest.mark.spark
def test_small_real_run_has_per_epoch_curves_for_every_system(spark, tmp_path):
    cfg = convergence.settings(
        _args(
            "--workloads",
            "tabular",
            "--rows",
            "256",
            "--epochs",
            "2",
            "--seeds",
            "0,1",
            "--workers",
            "2",
            "--schedules",
            "cosine",
        )
    )
    rows, parts = convergence_runs.run_configs(cfg, spark)
    assert [(p["system"], p["workers"], p["configs"]) for p in parts] == [
        ("single", 1, 2),
        ("gradshare", 2, 2),
        ("ddp", 2, 2),
    ]
    doc = convergence.write_json(str(tmp_path / "c.json"), rows, parts, command="test", config=cfg)
    back = json.loads((tmp_path / "c.json").read_text())
    assert back["summary"] == json.loads(json.dumps(doc["summary"], default=float))
    for r in back["rows"]:
        assert r["status"] == "ok", r
        assert len(r["accuracy"]) == 2 and len(r["train_seconds"]) == 2 and r["elapsed"] > 0
    by_system = {(r["system"], r["seed"]): r for r in back["rows"]}
    assert set(by_system) == {(s, seed) for s in ("single", "gradshare", "ddp") for seed in (0, 1)}
    assert by_system[("single", 0)]["steps"] == 2 * 4  # 256 rows, batch 64, 2 epochs
    assert by_system[("ddp", 0)]["steps"] == by_system[("gradshare", 0)]["steps"] == 2 * 2  # 128 rows a worker
    gs = by_system[("gradshare", 0)]
    assert len(gs["tau"]) == len(gs["sparsity"]) == len(gs["silent_share"]) == len(gs["lr"]) == 2
    assert gs["lr"][0] == pytest.approx(1e-3) and 0 < gs["lr"][1] < 1e-3  # annealing reached the workers
    assert gs["traffic_ratio"] > 1 and gs["bytes_per_step"] > 0
    assert by_system[("ddp", 1)]["launch_share"] >= 0
    assert len(back["summary"]) == 3 and all(len(s["mean"]) == 2 and s["seeds"] == [0, 1] for s in back["summary"])
    assert {c["check"] for c in back["checks"]} == {
        "final acc. gradshare − DDP (pp)",
        "epochs to target: gradshare ≤ DDP",
    }
    convergence.plot(str(tmp_path / "c.png"), doc["summary"])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
