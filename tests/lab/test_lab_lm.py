"""`benchmarks/lm.py`: the text and model it trains, its schedule, arguments and checks, and one small
fit of each system (gradshare on the shared Spark session, DDP's arithmetic in process)."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from lab import lm, lm_models


def test_text_windows_are_next_token_pairs_of_stdlib_source():
    ids, labels, v_ids, v_labels = lm.lm_data(0, rows=100)
    assert ids.shape == labels.shape == (100, lm.SEQ) and ids.dtype == labels.dtype == np.int64
    assert np.array_equal(ids[:, 1:], labels[:, :-1])  # labels are the ids shifted by one
    assert 0 <= ids.min() and max(ids.max(), v_ids.max()) < lm.VOCAB
    assert v_ids.shape == (64, lm.SEQ)  # rows // 4, at least 64
    again = lm.lm_data(0, rows=100)
    assert np.array_equal(again[0], ids) and not np.array_equal(lm.lm_data(1, rows=100)[0], ids)
    text = bytes(lm_models.text_windows(("textwrap",))[0, :40].astype(np.uint8))
    assert text.startswith(b'"""Text wrapping')


def test_model_gives_class_last_logits_with_a_non_persistent_mask():
    torch.manual_seed(0)
    model = lm.causal_lm()
    out = model(torch.zeros(2, lm.SEQ, dtype=torch.int64))
    assert out.shape == (2, lm.SEQ, lm.VOCAB)
    assert "mask" not in model.state_dict() and torch.isneginf(model.mask[0, 1])


def test_warmup_then_cosine():
    total = 200
    factors = [lm_models.warmup_cosine(total, s) for s in range(total)]
    warm = round(lm_models.WARMUP_SHARE * total)
    assert factors[0] == pytest.approx(1 / warm) and factors[warm - 1] == pytest.approx(1.0)
    assert factors[warm] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * (total - 1 - warm) / (total - warm))))
    assert all(a >= b for a, b in zip(factors[warm:], factors[warm + 1 :]))


def _args(**kw):
    parser = argparse.ArgumentParser()
    lm.add_arguments(parser)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items() if v is not True] + [
        f"--{k}" for k, v in kw.items() if v is True
    ]
    return parser.parse_args(argv)


def test_settings_name_the_bad_flag():
    assert lm.settings(_args(quick=True))["rows"] == lm.QUICK["rows"]
    assert lm.settings(_args())["workers"] == [2, 4]
    tiny = lm.settings(_args())
    assert (tiny["model"], tiny["epochs"], tiny["rows"], tiny["batch_size"]) == ("tiny", 4, 4096, 32)
    with pytest.raises(ValueError, match="--workers must be integers >= 2"):
        lm.settings(_args(workers="1,2"))
    with pytest.raises(ValueError, match="--seeds takes a comma list"):
        lm.settings(_args(seeds="a"))
    with pytest.raises(ValueError, match="--epochs must be >= 1"):
        lm.settings(_args(epochs=-1))


def test_checks_compare_the_last_epoch_and_the_traffic():
    rows = [
        {"system": "gradshare", "workers": 2, "seed": s, "val_loss": [3.0, g], "traffic_ratio": t, "seconds": 1.0}
        for s, g, t in ((0, 2.40, 150.0), (1, 2.42, 170.0))
    ]
    rows += [
        {"system": "ddp", "workers": 2, "seed": s, "val_loss": [3.0, d], "traffic_ratio": 1.0, "seconds": 1.0}
        for s, d in ((0, 2.38), (1, 2.30))
    ]
    summary = lm.summarise(rows)
    found = {c["check"]: c for c in lm.checks(summary)}
    loss = found["val loss gradshare − DDP (nats)"]
    assert loss["value"] == pytest.approx(2.41 - 2.34) and loss["met"] is False
    assert found["dense ÷ gradshare traffic"]["value"] == pytest.approx(160.0)
    assert found["dense ÷ gradshare traffic"]["met"] is True


def test_ddp_arithmetic_learns():
    data = lm.lm_data(0, rows=128)
    out = lm.run_ddp(data, workers=2, epochs=2, batch=16, seed=0)
    assert len(out["val_loss"]) == 2 and out["val_loss"][1] < out["val_loss"][0] < math.log(lm.VOCAB) + 0.5


@pytest.mark.spark
def test_a_small_gradshare_fit_reports_validation_loss_and_traffic(spark):
    data = lm.lm_data(0, rows=128)
    out = lm.run_gradshare(spark, data, workers=2, epochs=2, batch=16, seed=0)
    assert len(out["val_loss"]) == 2 and all(np.isfinite(out["val_loss"]))
    assert out["val_loss"][1] < out["val_loss"][0]
    assert out["traffic_ratio"] > 1 and out["n_params"] == sum(p.numel() for p in lm.causal_lm().parameters())


def test_hugging_face_models_at_their_recipe_learn_in_ddp_arithmetic():
    pytest.importorskip("transformers")
    hf = lm.settings(_args(model="gpt2"))
    assert (hf["epochs"], hf["rows"], hf["batch_size"]) == (2, 6000, 16)  # the HF recipe's run
    data = lm.lm_data(0, rows=96)
    out = lm.run_ddp(data, workers=2, epochs=2, batch=16, seed=0, model="gpt2")
    assert out["val_loss"][1] < out["val_loss"][0] < math.log(lm.VOCAB) + 0.5


def test_lock_step_lm_runs_the_planners_rule_and_ends_with_one_model():
    pytest.importorskip("transformers")
    from gradshare.config import TrainConfig
    from gradshare.driver.plan import plan_steps
    from lab import lockstep_lm

    out = lockstep_lm.run("llama", world=2, rows=96, epochs=1, batch=16)
    plan = plan_steps(TrainConfig(epochs=1, batch_size=16), 2, 3)
    assert out["replicas"] == 1 and np.isfinite(out["val_loss"][0]) and out["ratio"] > 1
    assert (out["apply_scale"], out["momentum_ceiling"]) == (plan.apply_scale, plan.momentum_ceiling)
    ddp = lockstep_lm.run("llama", world=2, rows=96, epochs=1, batch=16, system="ddp")
    assert ddp["replicas"] is None and np.isfinite(ddp["val_loss"][0])
    with pytest.raises(ValueError, match="aggregate must be 'sum' or 'mean'"):
        lockstep_lm.run("tiny", world=2, rows=96, epochs=1, options={"aggregate": "median"})
