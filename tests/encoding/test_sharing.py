"""The worker's sharing state (encoding/sharing.py) and the calibrated threshold (threshold="auto"):
calibration density on drawn update vectors, the warm-up ramp, the learning-rate correction invariant
against a float64 NumPy oracle, and a learning rate of 0."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.encoding import (
    AdaptiveThreshold,
    CalibratedThreshold,
    FixedThreshold,
    ResidualClipping,
    SharingState,
    decode,
    share_step,
)
from gradshare.encoding.threshold import quantile_threshold, sample_stride
from naive import naive_kth_largest_abs


def _vector(kind, n, seed, zero_share):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        v = rng.standard_normal(n)
    elif kind == "heavy":  # Student t with 1.5 degrees of freedom: infinite variance
        v = rng.standard_t(1.5, n)
    else:  # mostly zero
        v = rng.standard_normal(n) * (rng.random(n) >= zero_share)
    return (v * 10.0 ** rng.uniform(-6, 0)).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["normal", "heavy", "mostly_zero"]),
    n=st.integers(2_000, 300_000),
    seed=st.integers(0, 2**32 - 1),
    density=st.floats(1e-3, 0.2),
    zero_share=st.floats(0.5, 0.999),
)
def test_calibration_sends_about_the_target_density(kind, n, seed, density, zero_share):
    u = _vector(kind, n, seed, zero_share)
    state = SharingState(n, CalibratedThreshold(density=density, min_entries=0))
    state.residual += u  # what the direct path's optimizer step does
    message = share_step(state, step=0)
    want = density * n
    # With fewer non-zero values than the target share, all of them are what can leave (the sample's
    # smallest non-zero value becomes τ).
    reachable = min(want, np.count_nonzero(u))
    assert reachable / 2 <= message.n_entries <= 2 * want, (message.n_entries, want, message.threshold)


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=300), density=st.floats(1e-4, 1.0))
def test_quantile_threshold_matches_the_sorting_oracle(values, density):
    got = quantile_threshold(np.array(values, np.float32), density)
    want = naive_kth_largest_abs(values, density)
    if want is None:
        assert got is None
    else:
        assert got == pytest.approx(max(want, 1e-30), rel=0, abs=0)


def test_sample_stride_keeps_enough_values_for_the_density():
    assert sample_stride(10_000, 1e-3) == 1  # small models: the whole residual
    stride = sample_stride(10_000_000, 1e-3)
    assert 10_000_000 // stride >= 64 / 1e-3  # >= 64 expected entries above τ in the sample
    assert sample_stride(10_000_000, 1e-1) > stride  # a denser target needs fewer values


def test_warmup_ramp_falls_geometrically_to_the_density():
    rule = CalibratedThreshold(density=1e-3, warmup_steps=20, warmup_density=1e-1)
    targets = [rule.target(t, 10**7) for t in range(25)]
    assert targets[0] == pytest.approx(1e-1)
    assert targets[10] == pytest.approx(1e-2)  # halfway, geometrically
    assert all(a > b for a, b in zip(targets[:20], targets[1:21]))
    assert targets[20:] == [1e-3] * 5
    assert CalibratedThreshold(density=1e-3).target(0, 10**7) == 1e-3  # no warm-up by default in the rule


def test_run_long_decay_is_a_floor_under_the_warm_up_and_ends_at_the_density():
    rule = CalibratedThreshold(density=2e-3, warmup_steps=48, warmup_density=3e-3, decay_from=0.02, decay_steps=128)
    targets = [rule.target(t, 10**7) for t in range(140)]
    assert targets[0] == pytest.approx(0.02)
    assert targets[64] == pytest.approx(2e-3 * 10**0.5)  # halfway, geometrically
    assert all(a > b for a, b in zip(targets[:128], targets[1:129]))
    assert targets[128:] == [2e-3] * 12
    high = CalibratedThreshold(density=2e-3, warmup_steps=10, warmup_density=0.5, decay_from=0.02, decay_steps=128)
    assert high.target(0, 10**7) == pytest.approx(0.5)  # a warm-up above the decay keeps its ramp
    unplanned = CalibratedThreshold(decay_from=0.02)  # decay_steps 0: the run's, filled in by for_run
    with pytest.raises(ValueError, match="decay_from needs decay_steps"):
        unplanned.target(0, 10**7)
    planned = unplanned.for_run(128)
    assert (planned.decay_steps, unplanned.decay_steps) == (128, 0)  # a copy; the rule given stays as it was
    assert planned.target(0, 10**7) == pytest.approx(0.02)
    assert rule.for_run(7).decay_steps == 128  # steps a user gave are kept
    with pytest.raises(ValueError, match="steps"):
        unplanned.for_run(0)
    with pytest.raises(ValueError, match="decay_from must be 0"):
        CalibratedThreshold(decay_from=2.0, decay_steps=10)


def test_lr_factor_shrinks_the_step_while_the_decay_holds_the_density_up():
    rule = CalibratedThreshold(density=2e-3, decay_from=0.02, decay_steps=100, decay_lr_power=0.5)
    assert rule.lr_factor(0, 10**7) == pytest.approx(0.1**0.5)
    assert rule.lr_factor(50, 10**7) == pytest.approx((2e-3 / rule.target(50, 10**7)) ** 0.5)
    assert rule.lr_factor(100, 10**7) == 1.0
    assert CalibratedThreshold(density=2e-3, decay_from=0.02, decay_steps=100).lr_factor(0, 10**7) == 1.0
    with pytest.raises(ValueError, match="decay_lr_power"):
        CalibratedThreshold(decay_lr_power=-1.0)


def test_small_models_send_at_least_min_entries():
    rule = CalibratedThreshold(density=1e-3, min_entries=512)
    assert rule.target(0, 10**7) == 1e-3
    assert rule.target(0, 70_000) == pytest.approx(512 / 70_000)
    assert rule.target(0, 100) == 0.05  # the floor stops at 5 % of a tiny model
    assert CalibratedThreshold(density=0.5).target(0, 100) == 0.5  # an explicit density above it holds
    ramp = CalibratedThreshold(density=1e-3, min_entries=512, warmup_steps=4, warmup_density=1e-3)
    assert ramp.target(0, 70_000) == pytest.approx(512 / 70_000)  # the warm-up never goes below the floor


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"density": 0}, "density"),
        ({"density": 1.5}, "density"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"warmup_density": 2.0}, "warmup_density"),
        ({"min_entries": -1}, "min_entries"),
    ],
)
def test_calibrated_threshold_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CalibratedThreshold(**kwargs)


def test_warmup_sends_more_in_the_first_steps():
    rng = np.random.default_rng(0)
    state = SharingState(50_000, CalibratedThreshold(density=1e-3, warmup_steps=10, warmup_density=5e-2, min_entries=0))
    counts = []
    for t in range(15):
        state.residual += rng.standard_normal(50_000).astype(np.float32) * 1e-3
        counts.append(share_step(state, t).n_entries)
    assert counts[0] > 10 * counts[-1]
    assert all(c > 0 for c in counts) and state.silent_steps == 0


def _lr_sequence(rng, steps):
    """A schedule with warm-up, plateaus, decay and a jump back up: every kind of change."""
    lr = np.concatenate(
        [
            np.linspace(1e-4, 1e-2, steps // 4),
            np.full(steps // 4, 1e-2),
            1e-2 * 0.5 ** np.arange(steps // 4),
            np.full(steps - 3 * (steps // 4), 3e-3),
        ]
    )
    return lr * rng.uniform(0.9, 1.1, steps)


@pytest.mark.parametrize(
    "make_rule",
    [
        lambda: CalibratedThreshold(density=1e-2),
        lambda: FixedThreshold(5e-3),
        lambda: AdaptiveThreshold(initial=5e-3),
    ],
    ids=["calibrated", "fixed", "adaptive"],
)
@pytest.mark.parametrize("follow_lr", [True, False])
def test_lr_correction_keeps_error_feedback_exact_in_lr_units(make_rule, follow_lr):
    # The oracle, in float64: with follow_lr, Σ sent_t/η_t + r_T/η_T = Σ u_t/η_t; without it the plain
    # error-feedback identity Σ sent_t + r_T = Σ u_t. u_t = η_t · g_t, as an optimizer's step is.
    rng = np.random.default_rng(1)
    n, steps = 4_000, 60
    lrs = _lr_sequence(rng, steps)
    state = SharingState(n, make_rule(), None, follow_lr=follow_lr)
    sent = np.zeros(n)
    target = np.zeros(n)
    for t, lr in enumerate(lrs):
        state.set_lr(lr)
        u = (lr * rng.standard_normal(n)).astype(np.float32)
        state.residual += u
        m = share_step(state, t)
        scale = lr if follow_lr else 1.0
        sent += decode(m).astype(np.float64) / scale
        target += u.astype(np.float64) / scale
    last = lrs[-1] if follow_lr else 1.0
    np.testing.assert_allclose(
        sent + state.residual.astype(np.float64) / last, target, rtol=0, atol=1e-4 * np.abs(target).max()
    )
    if follow_lr:  # the same run without the correction breaks the lr-unit identity
        assert state.lr == lrs[-1] and state.lr_ref == lrs[0]


def test_a_numeric_threshold_follows_the_learning_rate():
    state = SharingState(1_000, FixedThreshold(1e-2), follow_lr=True)
    state.set_lr(1e-3)
    state.residual[:] = 1.0
    assert share_step(state, 0).threshold == pytest.approx(1e-2)
    state.set_lr(2.5e-4)
    assert share_step(state, 1).threshold == pytest.approx(2.5e-3)
    frozen = SharingState(1_000, FixedThreshold(1e-2), follow_lr=False)
    frozen.set_lr(1e-3)
    frozen.set_lr(2.5e-4)
    frozen.residual[:] = 1.0
    assert share_step(frozen, 0).threshold == pytest.approx(1e-2)


@pytest.mark.parametrize("make_rule", [lambda: CalibratedThreshold(), lambda: FixedThreshold(1e-3)])
def test_learning_rate_zero_sends_nothing_and_divides_by_nothing(make_rule):
    state = SharingState(2_000, make_rule(), ResidualClipping(clip=5.0, every=1))
    state.residual[:] = np.linspace(-1, 1, 2_000, dtype=np.float32)
    before = state.residual.copy()
    with np.errstate(all="raise"):  # a division by zero anywhere raises here
        state.set_lr(1e-3)
        state.set_lr(0.0)
        m = share_step(state, 0)
        assert m.n_entries == 0 and state.silent_steps == 1
        np.testing.assert_array_equal(state.residual, before)  # not rescaled by 0, not clipped at 5·1e30
        state.set_lr(1e-3)  # back from 0: nothing to rescale from
        np.testing.assert_array_equal(state.residual, before)
        assert share_step(state, 1).n_entries > 0
    with pytest.raises(ValueError, match="learning rate"):
        state.set_lr(-1.0)
    with pytest.raises(ValueError, match="learning rate"):
        state.set_lr(math.nan)


def test_a_calibrated_density_rises_as_the_learning_rate_anneals_and_only_then():
    # density × min(max_lr_boost, (peak rate / rate) ** lr_exponent): a rising rate (an lr warm-up) keeps
    # the factor at 1, a falling one raises it, up to the cap; follow_lr=False or lr_exponent=0 never
    rng = np.random.default_rng(5)
    n, density = 200_000, 1e-3
    values = rng.standard_normal(n).astype(np.float32)
    follows = SharingState(n, CalibratedThreshold(density=density, min_entries=0))
    frozen = SharingState(n, CalibratedThreshold(density=density, min_entries=0), follow_lr=False)
    flat = SharingState(n, CalibratedThreshold(density=density, min_entries=0, lr_exponent=0.0))
    rates = [(1e-4, 1e-4, 1.0), (1e-3, 1e-3, 1.0), (2.5e-4, 1e-3, 2.0), (1e-3, 1e-3, 1.0), (1e-5, 1e-3, 4.0)]
    for step, (lr, peak, factor) in enumerate(rates):
        for state in (follows, frozen, flat):
            state.set_lr(lr)
            state.residual[:] = values
        assert follows.rule.lr_boost == pytest.approx(factor) and follows.rule.lr_peak == peak
        assert frozen.rule.lr_boost == 1.0 and flat.rule.lr_boost == 1.0
        assert follows.rule.target(step, n) == pytest.approx(density * factor)
        sent = share_step(follows, step).n_entries
        assert 0.5 * density * factor * n <= sent <= 2 * density * factor * n
        assert share_step(frozen, step).n_entries == share_step(flat, step).n_entries
    with pytest.raises(ValueError, match="learning rate"):
        follows.rule.follow_lr(0.0)  # SharingState never passes a zero rate (nothing is sent there)


def test_general_path_calibrates_on_residual_plus_update():
    # share_step(update=, base=) adds u = update - base inside the encode; the calibration must see it.
    rng = np.random.default_rng(3)
    n = 100_000
    direct = SharingState(n, CalibratedThreshold(density=1e-2))
    general = SharingState(n, CalibratedThreshold(density=1e-2))
    base = rng.standard_normal(n).astype(np.float32)
    u = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    after = base + u
    direct.residual += after - base  # the same float32 rounding the fused kernel uses
    a = share_step(direct, 0)
    b = share_step(general, 0, update=after.copy(), base=base, rewind=False)
    assert a.threshold == b.threshold and a.to_bytes() == b.to_bytes()


def test_pending_keeps_own_messages_until_applied():
    state = SharingState(1_000, FixedThreshold(0.6), keep_pending=True)  # 1.0 leaves once, 0.4 stays
    for t in range(3):
        state.residual[t] = 1.0
        share_step(state, t)
    assert [s for s, _, _ in state.pending] == [0, 1, 2]
    assert [list(i) for _, _, i in state.pending] == [[0], [1], [2]]
    state.forget_applied(1)
    assert [s for s, _, _ in state.pending] == [2]
