"""The device-generic (torch) codec against the naive oracles and bit for bit against the Numba codec
(messages, residuals, applied parameters, calibrated τ, clipping, whole sharing steps).

On the CPU by default; ``GRADSHARE_TEST_DEVICE=cuda`` runs the same tests with the tensors on a GPU (the
check of the CUDA path on a machine that has one; the error-case tests stay on the CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_encoding_kernels import SETTINGS, small_vectors, vector_pairs, vector_triples

import naive
from gradshare.encoding import (
    BITMAP,
    EMPTY,
    FORMS,
    RICE,
    SPARSE,
    AdaptiveThreshold,
    CalibratedThreshold,
    FixedThreshold,
    Message,
    ResidualClipping,
    SharingState,
    apply,
    convert,
    encode,
    share_step,
)
from gradshare.encoding import torch_codec as tc
from gradshare.encoding.threshold import quantile_threshold

DEVICE = torch.device(os.environ.get("GRADSHARE_TEST_DEVICE", "cpu"))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy()).to(DEVICE)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().numpy().tobytes()


@SETTINGS
@given(vector_pairs(), st.booleans(), st.sampled_from((None,) + FORMS))
def test_tensor_encode_matches_oracle_and_numba_bytes(data, with_update, form):
    r, u, tau = data
    if not with_update:
        u = None
    want_r, want_codes = naive.accumulate_encode(r, u, tau)
    if form == EMPTY and want_codes.size:
        form = None
    rt = _t(r)
    got = encode(rt, None if u is None else _t(u), tau, form=form)
    numba_r = r.copy()
    ref = encode(numba_r, u, tau, form=form)
    assert got.to_bytes() == ref.to_bytes()  # the same message, header and payload
    assert _bits(rt) == want_r.tobytes() == numba_r.tobytes()  # -0.0 and subnormals included
    assert Message(got.threshold, got.n_params, got.n_entries, got.form, got.payload) == got


@SETTINGS
@given(vector_triples(), st.booleans())
def test_tensor_diff_encode_matches_oracle_and_numba(data, rewind):
    r, after, before, tau = data
    with np.errstate(over="ignore", invalid="ignore"):
        want_r, want_codes = naive.accumulate_diff_encode(r, after, before, tau)
    rt, at, bt = _t(r), _t(after), _t(before)
    if not np.all(np.isfinite(want_r)):  # the documented error, naming the first bad index
        first = int(np.flatnonzero(~np.isfinite(want_r))[0])
        with pytest.raises(ValueError, match=rf"residual \+ update - base is not finite at index {first}\b"):
            encode(rt, at, tau, base=bt, rewind=rewind)
        return
    got = encode(rt, at, tau, base=bt, rewind=rewind)
    numba_r = r.copy()
    assert got.to_bytes() == encode(numba_r, after.copy(), tau, base=before).to_bytes()
    assert _bits(rt) == want_r.tobytes()
    assert _bits(at) == (before if rewind else after).tobytes()  # rewound to base, else untouched


@SETTINGS
@given(small_vectors)
def test_tensor_encode_on_arbitrary_floats(data):
    # Any float32 magnitude up to 2**100, every sign of zero, subnormals.
    x, tau = data
    want_r, want_codes = naive.accumulate_encode(x, None, tau)
    xt = _t(x)
    got = encode(xt, None, tau)
    assert _bits(xt) == want_r.tobytes()
    assert got.to_bytes() == encode(x.copy(), None, tau).to_bytes()


@pytest.mark.parametrize("n", [0, 1, tc.BLOCK - 1, tc.BLOCK, tc.BLOCK + 1, 5 * tc.BLOCK + 7])
def test_block_edges_and_a_nan_in_the_tail(n):
    # Entries at the first and last index of every block and of the tail; a NaN only in the tail
    # must still be found (the tail is searched outside the blocks).
    x = np.zeros(n, np.float32)
    x[:: tc.BLOCK] = 2.0
    x[tc.BLOCK - 1 :: tc.BLOCK] = -2.0
    if n:
        x[-1] = -1.0
    want = encode(x.copy(), None, 1.0)
    xt = _t(x)
    assert encode(xt, None, 1.0).to_bytes() == want.to_bytes()
    if n % tc.BLOCK:
        bad = _t(x)
        bad[n - 1] = float("nan")
        with pytest.raises(ValueError, match=rf"residual is not finite at index {n - 1}\b"):
            encode(bad, None, 1.0)


def test_entry_search_at_full_density():
    # Every parameter crosses τ: every block is searched.
    n = 20_011
    rng = np.random.default_rng(7)
    u = (rng.choice([-1, 1], n) * (1 + rng.random(n))).astype(np.float32)
    rt = torch.zeros(n, device=DEVICE)
    m = encode(rt, _t(u), 1.0)
    r = np.zeros(n, np.float32)
    assert m.n_entries == n and m.form == BITMAP
    assert m.to_bytes() == encode(r, u, 1.0).to_bytes() and _bits(rt) == r.tobytes()


@SETTINGS
@given(vector_pairs(), st.floats(-4, 4, allow_nan=False))
def test_tensor_apply_is_bit_identical_to_numba_apply_in_every_form(data, scale):
    r, u, tau = data
    m = encode(r, u, tau)
    base = np.linspace(-1, 1, r.size, dtype=np.float32)
    for form in [SPARSE, RICE, BITMAP] + ([EMPTY] if m.n_entries == 0 else []):
        other = convert(m, form)
        want = base.copy()
        apply(other, want, scale)
        got = _t(base)
        apply(other, got, scale)
        assert _bits(got) == want.tobytes(), form


def test_tensor_apply_matches_the_naive_oracle():
    rng = np.random.default_rng(2)
    n = 10_000
    u = rng.standard_normal(n).astype(np.float32)
    r = np.zeros(n, np.float32)
    _, codes = naive.accumulate_encode(r, u, 2.0)
    m = encode(r, u, 2.0)
    params = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
    got = _t(params)
    apply(m, got, 0.3)
    assert _bits(got) == naive.apply(codes, m.threshold, params, 0.3).tobytes()


@SETTINGS
@given(
    st.lists(
        st.floats(-(2.0**100), 2.0**100, width=32) | st.sampled_from([0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf]),
        min_size=0,
        max_size=400,
    ),
    st.floats(1e-4, 1.0),
)
def test_tensor_quantile_is_the_numpy_quantile(values, density):
    # Ties (±1 repeated), signed zeros, NaN/inf (ignored by both), all-zero and empty inputs.
    a = np.array(values, np.float32)
    want = quantile_threshold(a, density)
    assert quantile_threshold(_t(a), density) == want
    oracle = naive.naive_kth_largest_abs(values, density)
    assert (want is None) == (oracle is None)


def test_tensor_clipping_is_numpy_clipping():
    rng = np.random.default_rng(4)
    r = (rng.standard_normal(5_000) * 10).astype(np.float32)
    r[:4] = [-0.0, np.inf, -np.inf, 3.4e38]
    clip = ResidualClipping(clip=2.0, every=3)
    rt = _t(r)
    for step in range(3):
        assert clip.apply(rt, 0.7, step) == clip.apply(r, 0.7, step) == (step == 2)
    assert _bits(rt) == r.tobytes()
    with pytest.raises(TypeError, match="residual must have dtype torch.float32"):
        clip.apply(torch.zeros(4, dtype=torch.float64), 0.7, 2)


@pytest.mark.parametrize(
    "make_rule",
    [
        lambda: CalibratedThreshold(density=5e-3, warmup_steps=4, min_entries=0),
        lambda: FixedThreshold(2e-3),
        lambda: AdaptiveThreshold(initial=2e-3),
    ],
    ids=["calibrated", "fixed", "adaptive"],
)
@pytest.mark.parametrize("path", ["direct", "general"])
def test_share_step_on_a_tensor_equals_the_numpy_state(make_rule, path):
    # Steps with a changing learning rate (follow_lr rescales the residual; 0 sends nothing), clipping every
    # 2nd step and the calibrated rule's strided sample: messages, τ and residuals stay bit-identical.
    rng = np.random.default_rng(5)
    n = 40_000
    clip = ResidualClipping(clip=3.0, every=2)
    host = SharingState(n, make_rule(), clip, keep_pending=True)
    dev = SharingState(n, make_rule(), clip, keep_pending=True, device=DEVICE)
    assert isinstance(dev.residual, torch.Tensor) and dev.n_params == n
    params = rng.standard_normal(n).astype(np.float32)
    params_t = _t(params)
    for t, lr in enumerate([1e-3, 1e-3, 2e-3, 5e-4, 0.0, 1e-4, 3e-3, 3e-3]):  # 0.0: a silent step
        host.set_lr(lr)
        dev.set_lr(lr)
        u = (lr * rng.standard_normal(n)).astype(np.float32)
        if path == "direct":
            host.residual += u
            dev.residual += _t(u)
            a, b = share_step(host, t), share_step(dev, t)
        else:
            after = params + u
            after_t = _t(after)
            a = share_step(host, t, update=after, base=params, rewind=True)
            b = share_step(dev, t, update=after_t, base=params_t, rewind=True)
            assert _bits(after_t) == after.tobytes() == params.tobytes()
        assert a.to_bytes() == b.to_bytes(), t
        assert _bits(dev.residual) == host.residual.tobytes(), t
        assert host.tau == dev.tau
        apply(a, params)
        apply(b, params_t)
        assert _bits(params_t) == params.tobytes()
    assert [s for s, _, _ in dev.pending] == list(range(8))
    assert host.silent_steps == dev.silent_steps >= 1  # the step at rate 0


def test_sharing_state_rejects_an_unusable_device():
    with pytest.raises(ValueError, match="cuda:99"):
        SharingState(10, FixedThreshold(), device=torch.device("cuda", 99))
    with pytest.raises(ValueError, match="device"):
        SharingState(10, FixedThreshold(), device="tpu")


@pytest.mark.parametrize(
    ("residual", "update", "exc", "match"),
    [
        (torch.zeros(4, dtype=torch.float64), None, TypeError, "residual must have dtype torch.float32"),
        (torch.zeros(2, 2), None, ValueError, "residual must be 1-D"),
        (torch.zeros(8)[::2], None, ValueError, "residual must be contiguous"),
        (torch.zeros(4), torch.zeros(5), ValueError, "update has 5 elements, expected 4"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float16), TypeError, "update must have dtype torch.float32"),
        (torch.zeros(4), np.zeros(4, np.float32), TypeError, "update must be a torch.Tensor"),
        (torch.zeros(4), torch.zeros(4, device="meta"), ValueError, "update is on meta, expected cpu"),
    ],
)
def test_tensor_encode_rejects_bad_tensors(residual, update, exc, match):
    with pytest.raises(exc, match=match):
        encode(residual, update, 1.0)


def test_tensor_encode_rejects_bad_arguments():
    z = torch.zeros
    with pytest.raises(ValueError, match="base needs an update"):
        encode(z(4), None, 1.0, base=z(4))
    with pytest.raises(ValueError, match="rewind needs a base"):
        encode(z(4), z(4), 1.0, rewind=True)
    both = z(8)
    with pytest.raises(ValueError, match="must not overlap"):
        encode(z(4), both[:4], 1.0, base=both[2:6], rewind=True)
    r = z(4)
    with pytest.raises(ValueError, match="must not overlap"):
        encode(r, r, 1.0, base=z(4), rewind=True)
    encode(z(4), both[:4], 1.0, base=both[4:], rewind=True)  # neighbours in one storage are fine
    with pytest.raises(ValueError, match="threshold must be finite and > 0"):
        encode(z(4), None, 0.0)
    with pytest.raises(ValueError, match="form must be one of"):
        encode(z(4), None, 1.0, form="dense")
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        encode(z(4), None, 1.0, threads=0)
    with pytest.raises(ValueError, match="form 'empty' cannot hold 4 entries"):
        encode(torch.ones(4), None, 0.5, form=EMPTY)


def test_tensor_apply_rejects_bad_arguments():
    m = encode(np.full(4, 2.0, np.float32), None, 1.0)
    with pytest.raises(TypeError, match="params must have dtype torch.float32"):
        apply(m, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="params has 5 elements, expected 4"):
        apply(m, torch.zeros(5))
    with pytest.raises(TypeError, match="message must be a Message"):
        apply(b"GS", torch.zeros(4))
    with pytest.raises(TypeError, match="scale"):
        apply(m, torch.zeros(4), "x")
    with pytest.raises(ValueError, match="not finite in float32"):
        apply(m, torch.zeros(4), 1e39)


def test_tensor_encode_with_grad_tracking_parameters():
    # A flat parameter buffer that requires grad is still encoded/applied in place (no autograd).
    p = torch.zeros(6, requires_grad=True)
    apply(encode(np.full(6, 2.0, np.float32), None, 1.0), p)
    assert p.detach().tolist() == [1.0] * 6 and p.grad_fn is None
