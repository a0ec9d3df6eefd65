"""The folded residual's passes (gradshare/encoding/folded.py: q = P + s·r stored, r read as (q − P)/s)
against loop-level oracles (tests/naive.py) on hypothesis-drawn vectors, on NumPy (Numba kernels) and on
torch tensors (the device code path on the CPU), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import naive
from gradshare.encoding import apply, decode_entries, encode
from gradshare.encoding.folded import clip_folded, encode_folded, fold, rescale_folded, unfold
from gradshare.encoding.kernels import BLOCK

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCALES = st.sampled_from([1.0, 0.5, 1 / 3, 0.25, 1 / 7])


@st.composite
def folded_pairs(draw):
    """(point, params, τ, scale): P of mixed magnitudes, r around τ with exact ±τ edges, zeros, subnormals."""
    n = draw(st.integers(0, 5_000))
    tau = draw(st.sampled_from([1e-3, 0.05, 1.0, 2.0**-20]))
    scale = draw(SCALES)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p = (rng.standard_normal(n) * draw(st.sampled_from([0.0, 1e-3, 0.1, 10.0]))).astype(np.float32)
    r = (rng.standard_normal(n) * tau * draw(st.sampled_from([0.3, 1.0, 3.0]))).astype(np.float32)
    if n:
        k = draw(st.integers(0, min(n, 32)))
        pos = rng.integers(0, n, size=k)
        r[pos] = np.array([tau, -tau, 0.0, -0.0, 1e-45, 2 * tau], np.float32)[rng.integers(0, 6, size=k)]
    q = (p + np.float32(scale) * r).astype(np.float32)
    if n:  # points exactly τ·s away from P: the edge of the comparison, after the rounding of q − p
        k = draw(st.integers(0, min(n, 16)))
        pos = rng.integers(0, n, size=k)
        q[pos] = p[pos] + np.float32(tau * scale)
    return q, p, tau, scale


def _tensors(*arrays):
    return [torch.from_numpy(a.copy()) for a in arrays]


@SETTINGS
@given(folded_pairs(), st.booleans())
def test_encode_folded_matches_the_oracle(case, tensors):
    q, p, tau, scale = case
    want_q, want_codes = naive.folded_encode(q, p, tau, scale)
    if tensors:
        tq, tp = _tensors(q, p)
        msg = encode_folded(tq, tp, tau, scale)
        got_q = tq.numpy()
        assert np.array_equal(tp.numpy(), p)
    else:
        got_q, p_before = q.copy(), p.copy()
        msg = encode_folded(got_q, p, tau, scale)
        assert np.array_equal(p, p_before)  # P is read only: it moves through the log alone
    index, signs = decode_entries(msg)
    assert np.array_equal(2 * index + (signs < 0), want_codes)
    assert got_q.tobytes() == want_q.tobytes()


@SETTINGS
@given(folded_pairs())
def test_encode_folded_sends_what_encoding_r_itself_sends_and_the_log_restores_the_distance(case):
    q, p, tau, scale = case
    r = unfold(q, p, scale)
    plain = encode(r.copy(), None, tau)
    got_q = q.copy()
    msg = encode_folded(got_q, p, tau, scale)
    assert msg.to_bytes() == plain.to_bytes()
    # the log applies the message to P and to q alike: q − P is back where it was, less what was sent
    p_after, q_after = p.copy(), got_q.copy()
    apply(msg, p_after, scale)
    apply(msg, q_after, scale)
    sent = np.zeros_like(r)
    apply(msg, sent)
    want = np.float32(scale) * (r - sent)
    ulp = np.spacing(np.maximum(np.abs(p_after), np.abs(q_after)) + np.abs(q)) + np.spacing(np.abs(want))
    # a sent entry moved q and P by the step float32(τ·s), one rounding away from the s·τ in `want`
    ulp += np.spacing(np.float32(tau * scale)) * (sent != 0)
    assert (np.abs((q_after - p_after) - want) <= 16 * ulp).all()  # a few roundings of q, P and r


@SETTINGS
@given(folded_pairs(), st.sampled_from([0.5, 1.0, 5.0]), st.booleans())
def test_clip_folded_matches_the_oracle(case, clip, tensors):
    q, p, tau, scale = case
    bound = np.float32(clip * tau)
    want = naive.folded_clip(q, p, bound, scale)
    if tensors:
        tq, tp = _tensors(q, p)
        clipped = clip_folded(tq, tp, bound, scale)
        got = tq.numpy()
    else:
        got = q.copy()
        clipped = clip_folded(got, p, bound, scale)
    assert got.tobytes() == want.tobytes()
    assert clipped == int(np.count_nonzero(np.abs(unfold(q, p, scale)) > bound))


@SETTINGS
@given(folded_pairs(), st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.7]), st.booleans())
def test_rescale_folded_matches_the_oracle(case, ratio, tensors):
    q, p, _, _ = case
    want = naive.folded_rescale(q, p, ratio)
    if tensors:
        tq, tp = _tensors(q, p)
        rescale_folded(tq, tp, ratio)
        got = tq.numpy()
    else:
        got = q.copy()
        rescale_folded(got, p, ratio)
    assert got.tobytes() == want.tobytes()


@SETTINGS
@given(folded_pairs(), st.booleans())
def test_fold_and_unfold_round_trip_within_the_rounding_of_the_point(case, tensors):
    q, p, _, scale = case
    r = unfold(q, p, scale)
    got = _tensors(q)[0] if tensors else q.copy()
    fold(got, _tensors(p)[0] if tensors else p, _tensors(r)[0] if tensors else r, scale)
    got = got.numpy() if tensors else got
    assert (np.abs(got - q) <= 2 * np.spacing(np.abs(q) + np.abs(p))).all()
    tr = unfold(*_tensors(q, p), scale)
    assert tr.numpy().tobytes() == r.tobytes()  # the same r on either


@SETTINGS
@given(folded_pairs(), st.lists(st.integers(0, 5_000), max_size=4))
def test_encoding_consecutive_slices_sends_what_one_encode_of_the_whole_sends(case, cuts):
    # What an encode per parameter (one slice per gradient hook, as benchmarks/overlap_probe.py measures)
    # would rest on: the blocks carry nothing from one slice to the next, so the slices' codes, shifted
    # by their offsets, are the whole vector's codes and the point ends with the same bits.
    q, p, tau, scale = case
    edges = sorted({0, q.size, *(c for c in cuts if c < q.size)})
    whole_q = q.copy()
    index, signs = decode_entries(encode_folded(whole_q, p, tau, scale))
    want = 2 * index.astype(np.int64) + (signs < 0)
    got = []
    for a, b in zip(edges[:-1], edges[1:]):
        i, s = decode_entries(encode_folded(q[a:b], p[a:b], tau, scale))
        got.append(2 * (i.astype(np.int64) + a) + (s < 0))
    assert np.array_equal(np.concatenate(got) if got else np.empty(0, np.int64), want)
    assert q.tobytes() == whole_q.tobytes()


def test_bad_input_is_named():
    q, p = np.zeros(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        encode_folded(q, p, 1.0, 0.0)
    with pytest.raises(ValueError, match="params has 3 elements, expected 4"):
        encode_folded(q, p[:3], 1.0)
    with pytest.raises(ValueError, match="must not overlap"):
        encode_folded(q, q, 1.0)
    bad = q.copy()
    bad[2] = np.inf
    with pytest.raises(ValueError, match="not finite at index 2"):
        encode_folded(bad, p, 1.0)
    with pytest.raises(ValueError, match="not finite at index 2"):
        encode_folded(torch.from_numpy(bad), torch.from_numpy(p), 1.0)


def test_a_block_too_full_for_the_entry_buffer_resumes_with_the_same_codes():
    # every entry crosses: the first entry buffer (1024 codes) fills and the pass resumes at that block
    n = 5_000
    p = np.linspace(-1, 1, n, dtype=np.float32)
    q = p + np.float32(0.5)
    want_q, want_codes = naive.folded_encode(q, p, 0.25, 1.0)
    msg = encode_folded(q, p, 0.25)
    index, signs = decode_entries(msg)
    assert np.array_equal(2 * index + (signs < 0), want_codes) and len(want_codes) == n
    assert q.tobytes() == want_q.tobytes()


@SETTINGS
@given(st.integers(1, 3 * BLOCK + 70), st.data(), st.sampled_from([np.nan, np.inf, -np.inf]), st.booleans())
def test_a_non_finite_value_is_named_wherever_it_is_and_whatever_else_crosses_tau(n, data, bad, hits):
    # The pass flags an entry and a non-finite value with one compare, and checks finiteness only in
    # the blocks it flagged: a lone NaN in a block with no entry, or one beside entries, must still be
    # named, at the first bad index, before any entry of its block is sent.
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    p = rng.standard_normal(n).astype(np.float32)
    r = (rng.standard_normal(n) * (0.6 if hits else 0.1)).astype(np.float32)  # τ = 1: entries or none
    at = data.draw(st.sampled_from(sorted({0, n - 1, n // 2, min(n - 1, 63), min(n - 1, 64), min(n - 1, 255)})))
    q = p + r
    q[at] = bad
    first = int(np.flatnonzero(~np.isfinite(q - p))[0])
    before = q.copy()
    with pytest.raises(ValueError, match=f"not finite at index {first}"):
        encode_folded(q, p, 1.0)
    start = at - at % BLOCK  # the bad block is left as it was
    block = slice(start, start + BLOCK)
    assert q[block].tobytes() == before[block].tobytes()
