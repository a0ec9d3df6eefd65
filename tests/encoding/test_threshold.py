"""Threshold rules, residual clipping, encode_step and residual_stats."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import naive
from gradshare.encoding import (
    AdaptiveThreshold,
    CalibratedThreshold,
    FixedThreshold,
    ResidualClipping,
    TargetSparsityThreshold,
    encode,
    encode_step,
    residual_stats,
)
from gradshare.encoding import threshold as T


def test_dl4j_defaults():
    a = AdaptiveThreshold()
    assert (a.threshold, a.min_sparsity, a.max_sparsity) == (float(np.float32(1e-3)), 1e-4, 1e-2)
    assert math.isclose(a.decay**20, 0.5)
    c = ResidualClipping()
    assert (c.clip, c.every) == (5.0, 5)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(1e-6, 1e3),
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50),
)
def test_adaptive_moves_toward_its_band(initial, sparsities):
    n = 1_000_000
    rule = AdaptiveThreshold(initial=initial)
    for s in sparsities:
        before = rule.threshold
        after = rule.update(int(s * n), n)
        ratio = int(s * n) / n
        if ratio < rule.min_sparsity:
            assert math.isclose(after, before * rule.decay)  # fewer entries than wanted: lower τ
        elif ratio > rule.max_sparsity:
            assert math.isclose(after, before / rule.decay)  # too many: raise τ
        else:
            assert after == before
        assert after == rule.threshold


def test_adaptive_reaches_band_on_real_updates_and_stays():
    # τ far too high: nothing crosses, so τ falls by 2 every 20 steps until the sparsity is in band.
    rng = np.random.default_rng(0)
    n = 100_000
    rule = AdaptiveThreshold(initial=100.0)
    r = np.zeros(n, np.float32)
    seen = []
    for _ in range(400):
        u = (rng.standard_normal(n) * 0.01).astype(np.float32)
        m = encode_step(r, u, rule)
        seen.append(m.density)
    assert all(d < 1e-4 for d in seen[:100])
    tail = seen[-50:]
    assert all(1e-5 <= d <= 1e-1 for d in tail)
    assert 1e-4 <= float(np.median(tail)) <= 1e-2


def test_target_sparsity_converges_near_target():
    rng = np.random.default_rng(1)
    n = 200_000
    rule = TargetSparsityThreshold(target=1e-3, initial=1e-4)
    r = np.zeros(n, np.float32)
    dens = []
    for _ in range(300):
        u = (rng.standard_normal(n) * 0.01).astype(np.float32)
        dens.append(encode_step(r, u, rule).density)
    assert dens[0] > 1e-2  # started far too low a τ: dense
    assert 3e-4 <= float(np.mean(dens[-100:])) <= 3e-3


def test_target_sparsity_step_direction():
    rule = TargetSparsityThreshold(target=0.01, initial=1.0, decay=0.5)
    assert rule.update(0, 100) == 0.5
    assert rule.update(50, 100) == 1.0
    assert rule.update(1, 100) == 1.0


def test_thresholds_are_deterministic_and_bounded():
    a, b = AdaptiveThreshold(), AdaptiveThreshold()
    seq = [(0, 10), (5, 10), (0, 10), (3, 1000)] * 10
    assert [a.update(*x) for x in seq] == [b.update(*x) for x in seq]
    low = AdaptiveThreshold(initial=1e-29, decay=0.5)
    for _ in range(100):
        low.update(0, 10)
    assert low.threshold == T.MIN_THRESHOLD
    high = TargetSparsityThreshold(initial=1e29, decay=0.5)
    for _ in range(100):
        high.update(10, 10)
    assert high.threshold == T.MAX_THRESHOLD


def test_fixed_threshold():
    f = FixedThreshold(0.25)
    assert f.threshold == 0.25 and f.update(10, 10) == 0.25 and f.update(0, 10) == 0.25
    assert AdaptiveThreshold().update(0, 0) == AdaptiveThreshold().threshold  # no parameters: unchanged


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FixedThreshold(0.0), "tau"),
        (lambda: FixedThreshold(float("nan")), "tau"),
        (lambda: AdaptiveThreshold(initial=-1), "initial"),
        (lambda: AdaptiveThreshold(min_sparsity=0), "min_sparsity"),
        (lambda: AdaptiveThreshold(min_sparsity=0.1, max_sparsity=0.01), "min_sparsity <= max_sparsity"),
        (lambda: AdaptiveThreshold(decay=1.0), "decay"),
        (lambda: AdaptiveThreshold(decay=0.4), "decay"),
        (lambda: TargetSparsityThreshold(target=2.0), "target"),
        (lambda: TargetSparsityThreshold(target=0.0), "target"),
        (lambda: CalibratedThreshold(lr_exponent=-0.5), "lr_exponent"),
        (lambda: CalibratedThreshold(lr_exponent=math.inf), "lr_exponent"),
        (lambda: CalibratedThreshold(max_lr_boost=0.5), "max_lr_boost"),
        (lambda: CalibratedThreshold().follow_lr(math.nan), "learning rate"),
        (lambda: ResidualClipping(clip=0), "clip"),
        (lambda: ResidualClipping(every=0), "every"),
        (lambda: AdaptiveThreshold().update(11, 10), "cannot exceed"),
        (lambda: AdaptiveThreshold().update(-1, 10), "n_entries"),
        (lambda: ResidualClipping().apply(np.zeros(3, np.float32), 1.0, -1), "step"),
        (lambda: encode_step(np.zeros(3, np.float32), None, FixedThreshold(1.0), clipping=ResidualClipping()), "step"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_residual_clipping_every_f_steps():
    c = ResidualClipping(clip=2.0, every=3)
    r = np.array([-10, -2.5, -1, 0, 1, 2.5, 10, np.nan], np.float32)
    for step in (0, 1):
        assert not c.apply(r, 0.5, step)
    assert np.array_equal(r[:7], np.array([-10, -2.5, -1, 0, 1, 2.5, 10], np.float32))
    assert c.apply(r, 0.5, 2)
    assert np.array_equal(r[:7], np.array([-1, -1, -1, 0, 1, 1, 1], np.float32))
    assert np.isnan(r[7])
    assert [c.due(s) for s in range(7)] == [False, False, True, False, False, True, False]


def test_encode_step_uses_rule_then_advances_it_then_clips():
    rule = FixedThreshold(1.0)
    r = np.zeros(4, np.float32)
    u = np.array([30.0, 0.5, -1.5, 0], np.float32)
    m = encode_step(r, u, rule, step=4, clipping=ResidualClipping())
    assert m.n_entries == 2 and m.threshold == 1.0
    assert r.tolist() == [5.0, 0.5, -0.5, 0.0]  # 29 clipped to 5τ on the 5th step


def _stats_oracle(r, tau):
    a = np.abs(r.astype(np.float64))
    fin = np.isfinite(a)
    t = float(np.float32(tau))
    return {
        "abs_mean": a[fin].mean() / t if fin.any() else float("nan"),
        "abs_max": a[fin].max() / t if fin.any() else float("nan"),
        "sparsity": float(np.count_nonzero(a[fin] >= t) / r.size) if r.size else 0.0,
        "nonfinite": float(np.count_nonzero(~fin)),
    }


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 0.5, 2.0]), st.booleans())
def test_residual_stats_matches_oracle(n, seed, tau, poison):
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(n).astype(np.float32)
    if poison and n:
        r[rng.integers(0, n, 3)] = np.array([np.nan, np.inf, -np.inf], np.float32)
    got = residual_stats(r, tau)
    want = _stats_oracle(r, tau)
    for key, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[key])
        else:
            assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=0), key
    fin = np.abs(r[np.isfinite(r)].astype(np.float64)) / float(np.float32(tau))
    if fin.size:
        assert math.isclose(got["p99"], float(np.percentile(fin, 99)), rel_tol=1e-12)
    assert got["tau"] == float(np.float32(tau)) and got["n_params"] == n


def test_residual_stats_after_encode_has_nothing_above_tau_for_small_updates():
    r = np.zeros(10_000, np.float32)
    u = np.random.default_rng(2).uniform(-1.9, 1.9, 10_000).astype(np.float32)
    encode(r, u, 1.0)
    s = residual_stats(r, 1.0)
    assert s["sparsity"] == 0 and s["abs_max"] < 1


def test_residual_stats_kernel_matches_naive_sparsity_on_large_sampled_input():
    r = np.random.default_rng(4).standard_normal(3_000_000).astype(np.float32)
    s = residual_stats(r, 2.0)
    new, codes = naive.accumulate_encode(r, None, 2.0)
    assert s["sparsity"] == codes.size / r.size
    assert 0.6 < s["p50"] * 2.0 < 0.75  # median |N(0,1)| = 0.674, from the strided sample
