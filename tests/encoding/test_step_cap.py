"""The step cap (encoding/step_cap.py) against a naive dense oracle on hypothesis-drawn steps: the same
factors and the same float32 bits, NumPy and torch alike; no cap (or one that does not bind) is the
plain apply message by message; a zero-norm tensor is never capped; the bounds are read from the
parameters as the step starts, their norms summed the same wherever they lie; the shares survive JSON.
``GRADSHARE_TEST_DEVICE=cuda`` puts the torch path's state on a GPU (as in test_torch_codec.py)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradshare.encoding import Message, StepUpdate, apply_update
from gradshare.encoding.norms import tensor_norms2
from gradshare.encoding.step_cap import DEFAULT_STEP_CAP, StepCap, apply_step, step_cap_for

DEVICE = torch.device(os.environ.get("GRADSHARE_TEST_DEVICE", "cpu"))
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_capped(
    state: np.ndarray,
    codes: list[np.ndarray],
    taus: list[float],
    scale: float,
    starts: list[int],
    shares: list[float],
    n: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(the state after the step, the factors): each tensor's bound its share of its norm in ``state``
    (inf if not capped or 0), a dense float64 sum of the messages, a loop per tensor, a loop per entry,
    one float32 addition each, in rank order."""
    ends = [*starts[1:], n]
    bounds = []
    for share, lo, hi in zip(shares, starts, ends):
        norm = math.sqrt(math.fsum(float(x) ** 2 for x in state[lo:hi]))
        bounds.append(share * norm if math.isfinite(share) and norm > 0 else math.inf)
    total = np.zeros(n)
    for c, tau in zip(codes, taus):
        step = float(np.float32(tau * scale))
        for code in c:
            total[code >> 1] += -step if code & 1 else step
    factors = np.ones(len(starts))
    for t, (lo, hi) in enumerate(zip(starts, ends)):
        norm = math.sqrt(float(np.sum(total[lo:hi] ** 2)))
        if norm > bounds[t]:
            factors[t] = bounds[t] / norm
    out = state.copy()
    for c, tau in zip(codes, taus):
        step = float(np.float32(tau * scale))
        for code in c:
            i = int(code >> 1)
            t = max(k for k, lo in enumerate(starts) if lo <= i)
            value = np.float32(step * factors[t])
            out[i] = np.float32(out[i] + (-value if code & 1 else value))
    return out, factors


@st.composite
def steps(draw):
    """(sizes, initial params, messages' codes, τs, scale, cap): 1-6 tensors (one of them possibly all
    zero), 1-8 messages that overlap, caps from never binding to always binding."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    n = sum(sizes)
    params = rng.standard_normal(n).astype(np.float32)
    if draw(st.booleans()):
        lo = sum(sizes[: draw(st.integers(0, len(sizes) - 1))])
        params[lo : lo + 1] = 0  # at least a value; a whole tensor below
        k = rng.integers(0, len(sizes))
        a = sum(sizes[:k])
        params[a : a + sizes[k]] = 0
    codes, taus = [], []
    for _ in range(draw(st.integers(1, 8))):
        idx = np.unique(rng.integers(0, n, size=draw(st.integers(0, min(n, 200)))))
        neg = rng.random(idx.size) < 0.5
        codes.append((idx.astype(np.int64) << 1) | neg)
        taus.append(float(np.float32(draw(st.sampled_from([1e-3, 0.05, 0.3, 2.0])))))
    scale = draw(st.sampled_from([1.0, 0.25]))
    cap = draw(st.sampled_from([1e-4, 1e-2, 0.1, 1.0, 1e6]))
    return sizes, params, codes, taus, scale, cap


def updates_of(codes: list[np.ndarray], taus: list[float], n: int) -> list[StepUpdate]:
    return [StepUpdate(Message.from_codes(c, tau, n)) for c, tau in zip(codes, taus)]


@SETTINGS
@given(steps())
def test_capped_step_matches_the_naive_oracle_bit_for_bit(case):
    sizes, params, codes, taus, scale, cap = case
    n = params.size
    step_cap = StepCap.of(sizes, params, cap)
    state = (params + np.float32(0.5)).astype(np.float32)
    want, factors = naive_capped(state, codes, taus, scale, list(step_cap.starts), list(step_cap.shares), n)
    got_factors = step_cap.factors(updates_of(codes, taus, n), scale, state)
    np.testing.assert_allclose(got_factors, factors, rtol=1e-12)
    got = state.copy()
    follower = state.copy()
    apply_step(updates_of(codes, taus, n), got, scale, step_cap, followers=[follower])
    assert got.tobytes() == want.tobytes()
    assert follower.tobytes() == want.tobytes()  # a follower moves by the same bits
    # the torch path: the same bits
    tensor = torch.from_numpy(state.copy()).to(DEVICE)
    apply_step(updates_of(codes, taus, n), tensor, scale, step_cap)
    assert tensor.cpu().numpy().tobytes() == want.tobytes()


@SETTINGS
@given(steps())
def test_each_tensors_step_stays_within_its_bound(case):
    sizes, params, codes, taus, scale, cap = case
    step_cap = StepCap.of(sizes, params, cap)
    state = params.astype(np.float64)
    after = params.copy()
    apply_step(updates_of(codes, taus, params.size), after, scale, step_cap)
    moved = after.astype(np.float64) - state
    bounds = step_cap.bounds(params, np.ones(len(sizes), bool))  # of the norms as the step starts
    for lo, bound, size in zip(step_cap.starts, bounds, sizes):
        # float32 rounding of each addition: an ulp of the values moved, per entry
        slack = 4 * float(np.sqrt(size)) * float(np.abs(after[lo : lo + size]).max(initial=1.0)) * 2.0**-23
        assert np.linalg.norm(moved[lo : lo + size]) <= bound + slack


@SETTINGS
@given(steps())
def test_no_cap_or_a_cap_that_does_not_bind_is_the_plain_apply(case):
    sizes, params, codes, taus, scale, _ = case
    n = params.size
    plain = params.copy()
    for u in updates_of(codes, taus, n):
        apply_update(u, plain, scale)
    for cap in (None, StepCap.of(sizes, params, 1e9)):
        got = params.copy()
        apply_step(updates_of(codes, taus, n), got, scale, cap)
        assert got.tobytes() == plain.tobytes()


def test_a_zero_norm_tensor_is_not_capped_and_a_binding_cap_scales_the_rest():
    params = np.array([3.0, 4.0, 0.0, 0.0], np.float32)  # tensor 0: norm 5; tensor 1 (a zero bias): 0
    cap = StepCap.of([2, 2], params, 0.1)
    assert cap.shares == (0.1, math.inf) and cap.bounds(params, np.ones(2, bool)).tolist() == [0.5, math.inf]
    codes = np.array([0 << 1, 1 << 1, 2 << 1, (3 << 1) | 1], np.int64)
    state = params.copy()
    apply_step([StepUpdate(Message.from_codes(codes, 1.0, 4))], state, 1.0, cap)
    # tensor 0 moved by (1, 1), norm √2 > 0.5: scaled to 0.5 ÷ √2 each; tensor 1 by ±1 whole
    step = np.float32(1.0 * (0.5 / math.sqrt(2.0)))
    assert state.tolist() == [np.float32(3.0 + step), np.float32(4.0 + step), 1.0, -1.0]


def test_the_bound_is_the_share_of_the_norm_the_tensor_has_as_the_step_starts():
    """A tensor that grew is held less than at its start: the cap reads the parameters it is applied to."""
    start = np.array([3.0, 4.0], np.float32)  # norm 5
    cap = StepCap.of([2], start, 0.1)
    grown = np.array([6.0, 8.0], np.float32)  # norm 10: bound 1.0, not 0.5
    codes = np.array([0 << 1, 1 << 1], np.int64)  # a step of (0.6, 0.6): norm 0.85 < 1.0
    state = grown.copy()
    apply_step([StepUpdate(Message.from_codes(codes, 0.6, 2))], state, 1.0, cap)
    assert state.tolist() == [np.float32(6.6), np.float32(8.6)]  # whole
    state = start.copy()
    apply_step([StepUpdate(Message.from_codes(codes, 0.6, 2))], state, 1.0, replace(cap))  # another replica's
    step = np.float32(0.6 * (0.5 / (0.6 * math.sqrt(2.0))))  # scaled to norm 0.5
    assert state.tolist() == [np.float32(3.0 + step), np.float32(4.0 + step)]


@SETTINGS
@given(steps(), st.integers(2, 12))
def test_the_norms_a_replica_remembers_never_change_what_it_adds(case, rounds):
    """A replica's cap settles most steps from the norms it read before (`StepCap.bounds`); over a run of
    steps it adds the same bits as a cap that reads every norm afresh each step (a replica that joined
    just then)."""
    sizes, params, codes, taus, scale, cap = case
    remembering = StepCap.of(sizes, params, cap)
    kept, fresh = params.copy(), params.copy()
    for r in range(rounds):
        step = [c[(np.arange(c.size) + r) % 3 != 0] for c in codes]  # each round a different part of each
        apply_step(updates_of(step, taus, params.size), kept, scale, remembering)
        apply_step(updates_of(step, taus, params.size), fresh, scale, replace(remembering))
        assert kept.tobytes() == fresh.tobytes()


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, 70), min_size=1, max_size=6), st.integers(0, 9))
def test_tensor_norms_match_a_naive_sum_and_do_not_depend_on_where_they_lie(seed, sizes, offset):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(sum(sizes)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
    starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    which = rng.random(len(sizes)) < 0.7
    got = tensor_norms2(values, starts, which)
    for k, (lo, size) in enumerate(zip(starts.tolist(), sizes)):
        want = math.fsum(float(x) ** 2 for x in values[lo : lo + size]) if which[k] else 0.0
        assert got[k] == pytest.approx(want, rel=1e-12, abs=0)
    # the same values at another offset in memory (the relay's array, a worker's state): the same bits
    shifted = np.zeros(values.size + offset, np.float32)
    shifted[offset:] = values
    assert tensor_norms2(shifted[offset:], starts, which).tobytes() == got.tobytes()


def test_tensor_norms_refuse_bad_layouts():
    with pytest.raises(ValueError, match="float32"):
        tensor_norms2(np.ones(4), np.array([0]), np.array([True]))
    with pytest.raises(ValueError, match="starts"):
        tensor_norms2(np.ones(4, np.float32), np.array([1]), np.array([True]))


def test_a_share_of_the_initial_norm_reads_no_norm_and_survives_json():
    """The row from 32 workers: the bound stays the share of the tensor's norm at the start of training."""
    start = np.array([3.0, 4.0, 0.0], np.float32)
    cap = StepCap.of([2, 1], start, 0.1, norm="initial")
    grown = np.array([6.0, 8.0, 0.0], np.float32)
    assert cap.bounds(grown, np.ones(2)).tolist() == [0.5, math.inf]
    back = StepCap.from_json(json.loads(json.dumps(cap.to_json())), 3)
    assert back == cap and back.initial == (5.0, 0.0)
    with pytest.raises(ValueError, match="norm"):
        StepCap.of([2, 1], start, 0.1, norm="final")


def test_the_bounds_survive_a_json_manifest_exactly():
    params = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    params[40:] = 0
    cap = StepCap.of([10, 30, 10], params, 0.1)
    back = StepCap.from_json(json.loads(json.dumps(cap.to_json())), 50)
    assert back == cap and back.shares[2] == math.inf


@pytest.mark.parametrize("bad", [0, -0.1, math.nan, math.inf, True, "0.1"])
def test_a_bad_cap_is_refused_naming_step_cap(bad):
    with pytest.raises(ValueError, match="step_cap"):
        StepCap.of([3], np.ones(3, np.float32), bad)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="starts"):
        StepCap((1,), (1.0,), 4)
    with pytest.raises(ValueError, match="increase"):
        StepCap((0, 4), (1.0, 1.0), 4)
    with pytest.raises(ValueError, match="> 0"):
        StepCap((0,), (0.0,), 4)


def test_a_given_cap_is_taken_as_given():
    assert step_cap_for(None) is None and step_cap_for(0.3) == 0.3 and step_cap_for(DEFAULT_STEP_CAP) == 0.1
    with pytest.raises(ValueError, match="the planner resolves it"):  # by worker count: tests/driver/test_policy.py
        step_cap_for("auto")
