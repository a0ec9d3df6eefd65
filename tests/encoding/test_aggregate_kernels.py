"""The relay's aggregation kernels with a per-block bound (encoding/blockmax.py) against the naive
oracles (tests/naive.py) and the plain codec, on hypothesis-drawn residuals: the same float32 adds, the
same message and residual bits, and a bound that always covers the residual."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import naive
from gradshare.encoding import BITMAP, RICE, SPARSE, blockmax, decode_entries, encode
from gradshare.encoding import aggregate as agg

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WIDTH = 1 << blockmax.SHIFT


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


@st.composite
def residuals(draw, nonfinite=False):
    """(residual, a valid bound of it, τ): sizes over a few blocks (a partial last one), mostly zero as
    the relay's residual is, values around τ with ±τ edges, huge values and (optionally) NaN/±inf; the
    bound is the exact block maximum, loosened at random (any upper bound is valid)."""
    tau = np.float32(draw(st.sampled_from([1e-3, 0.5, 1.0, 3.0, 2.0**-126])))
    n = draw(st.integers(1, 20_000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = tau * np.float32(draw(st.sampled_from([0.3, 1.0, 3.0])))
    r = (rng.standard_normal(n) * scale).astype(np.float32)
    r[rng.random(n) < draw(st.sampled_from([0.0, 0.5, 0.99]))] = 0
    special = [tau, -tau, np.nextafter(tau, np.float32(0)), 2 * tau, -2 * tau, 1e37, -1e37, -0.0, 1e-45]
    if nonfinite:
        special += [np.nan, np.inf, -np.inf]
    k = draw(st.integers(0, min(n, 32)))
    r[rng.integers(0, n, size=k)] = np.array(special, np.float32)[rng.integers(0, len(special), size=k)]
    with np.errstate(over="ignore"):
        bound = naive.block_max_abs(r, WIDTH) * np.float32(draw(st.sampled_from([1.0, 1.5, 4.0])))
    loose = rng.random(bound.size) < 0.1
    bound[loose] = np.inf
    return r, bound, tau


def state_with(r: np.ndarray, bound: np.ndarray) -> agg.AggregateState:
    state = agg.AggregateState(r.size)
    state.residual[:] = r
    state.bound[:] = bound
    return state


@SETTINGS
@given(
    residuals(nonfinite=True),
    st.sampled_from([SPARSE, RICE, BITMAP]),
    st.integers(0, 2**32 - 1),
    st.sampled_from([1e-3, 0.7, 1e30]),
)
def test_add_matches_the_codec_and_raises_the_bound(data, form, seed, msg_tau):
    r, bound, _ = data
    rng = np.random.default_rng(seed)
    n = r.size
    dense = np.zeros(n, np.float32)
    where = rng.random(n) < rng.choice([0.001, 0.05, 0.6])
    dense[where] = np.float32(1.5 * msg_tau) * rng.choice(np.float32([-1, 1]), size=int(where.sum()))
    message = encode(dense, None, msg_tau, form=form if where.any() else None)
    codes = np.flatnonzero(where) * 2 + (dense[where] < 0)
    state = state_with(r, bound)
    with np.errstate(over="ignore", invalid="ignore"):
        agg.add_message(state, message)
        want = naive.apply(codes, message.threshold, r)
    assert same_bits(state.residual, want)
    # the oracle bound: each add raises its block's bound to |r_i| (a NaN sticks)
    want_bound = bound.copy()
    for c in codes.tolist():
        i = c >> 1
        b, a = i // WIDTH, np.float32(abs(want[i]))
        if np.isnan(a) or a > want_bound[b]:
            want_bound[b] = a
    assert same_bits(np.nan_to_num(state.bound, nan=-1.0), np.nan_to_num(want_bound, nan=-1.0))


@SETTINGS
@given(residuals())
def test_encode_matches_the_plain_encoder_and_tightens_the_bound(data):
    r, bound, tau = data
    state = state_with(r, bound)
    got = agg.encode_residual(state, float(tau))
    want_r, want_codes = naive.accumulate_encode(r, None, tau)
    assert same_bits(state.residual, want_r)
    plain = r.copy()
    assert got == encode(plain, None, tau) and same_bits(plain, want_r)  # the same message, form included
    gi, gs = decode_entries(got)
    np.testing.assert_array_equal((gi << 1) | (gs < 0), want_codes)
    # a block read (bound not below τ) gets its exact maximum; one skipped keeps its bound; all still cover
    exact = naive.block_max_abs(want_r, WIDTH)
    read = ~(bound < tau)
    assert same_bits(state.bound[read], exact[read])
    assert same_bits(state.bound[~read], bound[~read])
    assert (state.bound >= exact).all()


@SETTINGS
@given(residuals(nonfinite=True))
def test_encode_names_the_first_non_finite_value_as_the_plain_encoder(data):
    r, bound, tau = data
    bad = np.flatnonzero(~np.isfinite(r))
    if not bad.size:
        r[r.size // 2] = np.nan
        bound = naive.block_max_abs(r, WIDTH)
        bad = np.array([r.size // 2])
    state = state_with(r, bound)
    with pytest.raises(ValueError, match=rf"^residual is not finite at index {bad[0]} "):
        agg.encode_residual(state, float(tau))
    with pytest.raises(ValueError, match=rf"^residual is not finite at index {bad[0]} "):
        encode(r.copy(), None, tau)


def test_encode_regrows_its_entry_buffer_without_emitting_a_block_twice():
    # every value crosses τ: the pass stops FULL several times and resumes at the block that did not fit
    n = 100_003
    r = np.random.default_rng(3).choice(np.float32([-2.5, 2.5]), n)
    state = state_with(r, naive.block_max_abs(r, WIDTH))
    got = agg.encode_residual(state, 1.0)
    assert got.n_entries == n and got == encode(r.copy(), None, 1.0)
    assert (state.residual == r - np.sign(r)).all() and (state.bound == np.float32(1.5)).all()
