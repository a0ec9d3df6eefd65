"""Kernels against the naive oracles (tests/naive.py) on hypothesis-drawn vectors, and codec properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import naive
from gradshare.encoding import BITMAP, EMPTY, RICE, SPARSE, Message, apply, convert, decode, decode_entries, encode
from gradshare.encoding import kernels as K

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TAUS = st.sampled_from([1e-3, 0.5, 1.0, 3.0, 1e-30, 2.0**-126, 1e20])


def _specials(tau: float) -> np.ndarray:
    t = np.float32(tau)
    tiny = np.float32(1e-45)  # smallest subnormal
    return np.array(
        [
            t,
            -t,
            np.nextafter(t, np.float32(0)),
            -np.nextafter(t, np.float32(0)),
            np.nextafter(t, np.float32(np.inf)),
            2 * t,
            -2 * t,
            t / 2,
            -t / 2,
            0.0,
            -0.0,
            tiny,
            -tiny,
            np.float32(1.17e-38) / 3,
            1e37,
            -1e37,
            3e36,
            -3e36,
        ],
        dtype=np.float32,
    )


@st.composite
def vector_pairs(draw):
    """(residual, update, τ): sizes 0..1e5, random scale around τ, with ±τ/subnormal/huge values spliced in."""
    tau = draw(TAUS)
    n = draw(st.integers(0, 100_000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = np.float32(tau) * draw(st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    r = (rng.standard_normal(n) * scale * 0.5).astype(np.float32)
    u = (rng.standard_normal(n) * scale).astype(np.float32)
    if n:
        special = _specials(tau)
        for arr in (r, u):
            k = draw(st.integers(0, min(n, 64)))
            pos = rng.integers(0, n, size=k)
            arr[pos] = special[rng.integers(0, special.size, size=k)]
        # exact ±τ after accumulation: put the edge in r and a zero in u at a few places
        k = draw(st.integers(0, min(n, 16)))
        pos = rng.integers(0, n, size=k)
        r[pos] = special[rng.integers(0, 2, size=k)]
        u[pos] = 0
    return r, u, tau


small_vectors = st.tuples(
    arrays(np.float32, st.integers(0, 300), elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=True)),
    st.floats(2.0**-20, 2.0**20, width=32),
)


@SETTINGS
@given(vector_pairs(), st.booleans())
def test_fused_encode_matches_oracle(data, with_update):
    r, u, tau = data
    if not with_update:
        u = None
    want_r, want_codes = naive.accumulate_encode(r, u, tau)
    got_r = r.copy()
    m = encode(got_r, u, tau)
    assert Message(m.threshold, m.n_params, m.n_entries, m.form, m.payload) == m
    idx, signs = decode_entries(m)
    codes = (idx << 1) | (signs < 0)
    np.testing.assert_array_equal(codes, want_codes)
    assert got_r.tobytes() == want_r.tobytes()  # bit-exact, -0.0 and subnormals included


@st.composite
def vector_triples(draw):
    """(residual, after, before, τ): `vector_pairs` with the update split into two parameter vectors
    (after = before + u, rounded: after - before need not give u back), sometimes with huge or special
    values in `before` so the difference cancels, overflows or is not finite."""
    r, u, tau = draw(vector_pairs())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    before = (rng.standard_normal(r.size) * draw(st.sampled_from([0.0, 1e-3, 1.0, 1e30]))).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        after = (before + u).astype(np.float32)
    if r.size:
        special = np.concatenate([_specials(tau), np.array([np.nan, np.inf, -np.inf, 3.4e38], np.float32)])
        for arr in (after, before):
            k = draw(st.integers(0, min(r.size, 8)))
            pos = rng.integers(0, r.size, size=k)
            arr[pos] = special[rng.integers(0, special.size if draw(st.booleans()) else 18, size=k)]
    return r, after, before, tau


@SETTINGS
@given(vector_triples(), st.integers(1, 3), st.booleans())
def test_fused_diff_encode_matches_oracle(data, threads, rewind):
    r, after, before, tau = data
    after_in = after.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        want_r, want_codes = naive.accumulate_diff_encode(r, after, before, tau)
        finite = bool(np.all(np.isfinite(want_r)))
    got_r = r.copy()
    if not finite:  # a NaN/inf difference or an overflow: the documented error, naming the first index
        first = int(np.flatnonzero(~np.isfinite(want_r))[0])
        with pytest.raises(ValueError, match=rf"residual \+ update - base is not finite at index {first}\b"):
            encode(got_r, after, tau, base=before, threads=threads, rewind=rewind)
        return
    m = encode(got_r, after, tau, base=before, threads=threads, rewind=rewind)
    # rewind: `after` now holds `before` bit for bit; otherwise it is untouched
    assert after.tobytes() == (before if rewind else after_in).tobytes()
    after = after_in
    assert Message(m.threshold, m.n_params, m.n_entries, m.form, m.payload) == m
    idx, signs = decode_entries(m)
    np.testing.assert_array_equal((idx << 1) | (signs < 0), want_codes)
    assert got_r.tobytes() == want_r.tobytes()  # bit-exact: as subtracting first, then encoding
    r2 = r.copy()
    assert encode(r2, (after - before).astype(np.float32), tau) == m and r2.tobytes() == got_r.tobytes()


def test_fused_diff_encode_regrows_its_entry_buffer():
    # Every parameter crosses τ, so the pass stops FULL and resumes several times: blocks accumulated
    # before a stop must not subtract `before` twice.
    n = 200_003
    rng = np.random.default_rng(8)
    before = rng.standard_normal(n).astype(np.float32)
    after = (before + rng.choice([-1, 1], n) * (1 + rng.random(n))).astype(np.float32)
    r = np.zeros(n, np.float32)
    want_r, want_codes = naive.accumulate_diff_encode(r, after, before, 1.0)
    m = encode(r, after, 1.0, base=before, rewind=True)
    assert m.n_entries == n and after.tobytes() == before.tobytes()
    assert r.tobytes() == want_r.tobytes()
    assert decode(m).tobytes() == naive.dense(want_codes, 1.0, n).tobytes()


@SETTINGS
@given(small_vectors)
def test_fused_encode_matches_oracle_on_arbitrary_floats(data):
    x, tau = data
    want_r, want_codes = naive.accumulate_encode(x, None, tau)
    got = x.copy()
    m = encode(got, None, tau)
    assert got.tobytes() == want_r.tobytes()
    assert m.n_entries == want_codes.size


@SETTINGS
@given(vector_pairs())
def test_decoded_update_plus_new_residual_is_old_residual_plus_update(data):
    # Float statement: with x = fl32(r + u) (one float32 addition, as numpy computes it), an index
    # without entry keeps r' == x exactly; an entry's r' = fl32(x ∓ τ) is x ∓ τ rounded once, so
    # |(r' ± τ) - x| <= ulp(r')/2 in exact arithmetic, with equality to 0 when τ/2 <= |x| <= 2τ (Sterbenz).
    r, u, tau = data
    x = (r + u).astype(np.float32)
    new = r.copy()
    m = encode(new, u, tau)
    d = decode(m)
    t = np.float32(tau)
    hit = d != 0
    assert (new[~hit].tobytes()) == x[~hit].tobytes()
    err = np.abs(new[hit].astype(np.float64) + d[hit].astype(np.float64) - x[hit].astype(np.float64))
    half_ulp = np.spacing(np.abs(new[hit])).astype(np.float64) / 2
    assert np.all(err <= half_ulp)
    sterbenz = (np.abs(x[hit]) >= t / 2) & (np.abs(x[hit]) <= 2 * t)
    assert np.all(err[sterbenz] == 0)
    assert np.all(np.abs(d[hit]) == t)


@SETTINGS
@given(vector_pairs(), st.floats(-4, 4, allow_nan=False))
def test_every_form_decodes_to_the_same_vector_as_the_oracle(data, scale):
    r, u, tau = data
    n = r.size
    m = encode(r, u, tau)
    codes = (decode_entries(m)[0] << 1) | (decode_entries(m)[1] < 0)
    forms = [SPARSE, RICE, BITMAP] + ([EMPTY] if m.n_entries == 0 else [])
    base = np.linspace(-1, 1, n, dtype=np.float32)
    want = naive.apply(codes, m.threshold, base, scale)
    for form in forms:
        other = convert(m, form)
        assert other.form == form and other.n_entries == m.n_entries
        # built without the validation pass, yet exactly what the validating constructor accepts
        assert Message(other.threshold, other.n_params, other.n_entries, other.form, other.payload) == other
        got = base.copy()
        apply(other, got, scale)
        assert got.tobytes() == want.tobytes(), form
    assert len(convert(m, SPARSE).payload) == len(naive.sparse_payload(codes))
    assert convert(m, SPARSE).payload == naive.sparse_payload(codes)
    assert convert(m, BITMAP).payload == naive.bitmap_payload(codes, n)
    rice = convert(m, RICE).payload
    assert rice == naive.rice_payload(codes, rice[0])


@SETTINGS
@given(vector_pairs())
def test_encode_picks_the_smallest_form(data):
    r, u, tau = data
    m = encode(r, u, tau)
    sizes = {f: len(convert(m, f).payload) for f in (SPARSE, RICE, BITMAP)}
    if m.n_entries == 0:
        assert m.form == EMPTY and m.payload == b""
    else:
        assert len(m.payload) == min(sizes.values())


@SETTINGS
@given(vector_pairs(), st.integers(2, 4))
def test_threads_give_the_identical_message_and_residual(data, threads):
    r, u, tau = data
    r2 = r.copy()
    assert encode(r, u, tau, threads=threads) == encode(r2, u, tau)
    assert r.tobytes() == r2.tobytes()


def test_entry_buffer_regrowth_at_full_density():
    # Every parameter crosses τ: the initial buffer (n/256) must grow several times mid-pass.
    n = 200_003
    rng = np.random.default_rng(7)
    u = (rng.choice([-1, 1], n) * (1 + rng.random(n))).astype(np.float32)
    r = np.zeros(n, np.float32)
    want_r, want_codes = naive.accumulate_encode(r, u, 1.0)
    m = encode(r, u, 1.0)
    assert m.n_entries == n and m.form == BITMAP
    assert r.tobytes() == want_r.tobytes()
    assert decode(m).tobytes() == naive.dense(want_codes, 1.0, n).tobytes()


def test_empty_step_round_trips():
    r = np.full(1000, 0.25, np.float32)
    m = encode(r, None, 1.0)
    assert (m.form, m.n_entries, m.payload) == (EMPTY, 0, b"")
    assert Message.from_bytes(m.to_bytes(), max_params=1000) == m
    p = np.ones(1000, np.float32)
    apply(m, p)
    assert np.all(p == 1)


def test_zero_length_vector():
    m = encode(np.zeros(0, np.float32), np.zeros(0, np.float32), 1.0)
    assert (m.n_params, m.n_entries, m.form) == (0, 0, EMPTY)
    assert Message.from_bytes(m.to_bytes(), max_params=0) == m


def test_sparse_kernels_handle_gaps_needing_long_varints():
    # Gaps of 2**40 take 6-byte varints; the bounds check must hold near 2**61 parameters too.
    n = 2**61
    codes = np.array([0, (2**40 << 1) | 1, ((2**61 - 1) << 1)], np.int64)
    payload = naive.sparse_payload(codes)
    m = Message(1.0, n, 3, SPARSE, payload)
    back = Message.from_bytes(m.to_bytes(), max_params=n)
    idx, signs = decode_entries(back)
    assert idx.tolist() == [0, 2**40, 2**61 - 1] and signs.tolist() == [1, -1, 1]
    with pytest.raises(ValueError, match="index"):
        Message(1.0, 2**61 - 1, 3, SPARSE, payload)  # last index == n_params


def test_kernels_under_disabled_jit_match_the_jitted_ones(tmp_path):
    # Exercise the pure-Python path of every kernel once (NUMBA_DISABLE_JIT=1 in a fresh process).
    import os
    import subprocess
    import sys

    script = tmp_path / "nojit.py"
    script.write_text(
        "import numpy as np, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import naive\n"
        "from gradshare.encoding import encode, decode, convert, Message, BITMAP, RICE, SPARSE\n"
        "rng = np.random.default_rng(3)\n"
        "n = 5000\n"
        "r = (rng.standard_normal(n) * 0.5).astype(np.float32); u = rng.standard_normal(n).astype(np.float32)\n"
        "want_r, want_codes = naive.accumulate_encode(r, u, 1.5)\n"
        "m = encode(r, u, 1.5)\n"
        "assert r.tobytes() == want_r.tobytes()\n"
        "b = rng.standard_normal(n).astype(np.float32); a = (b + u).astype(np.float32)\n"
        "r2 = np.zeros(n, np.float32); want2, codes2 = naive.accumulate_diff_encode(r2, a, b, 1.5)\n"
        "m2 = encode(r2, a, 1.5, base=b)\n"
        "assert r2.tobytes() == want2.tobytes() and m2.n_entries == codes2.size\n"
        "ref = naive.dense(want_codes, 1.5, n).tobytes()\n"
        "for f in (SPARSE, RICE, BITMAP):\n"
        "    c = Message.from_bytes(convert(m, f).to_bytes(), max_params=n)\n"
        "    assert decode(c).tobytes() == ref, f\n"
        "print('ok', m.n_entries)\n"
    )
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # naive.py lives in tests/
    out = subprocess.run([sys.executable, str(script), tests_dir], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
    assert int(out.stdout.split()[1]) > 0


@pytest.mark.parametrize(
    "n", [1, K.SUB - 1, K.SUB, K.SUB + 1, K.BLOCK - 1, K.BLOCK, K.BLOCK + 1, 2 * K.BLOCK + K.SUB + 1]
)
def test_entries_at_block_and_sub_block_edges_are_all_found(n):
    # The fused pass scans a block only where its count says an entry is, and a sub-block only where
    # its own count does: an entry on the first or last element of either, in a short tail block, or
    # a block where every element crosses τ must still come out once, in order, and be reduced by τ.
    edges = {0, n - 1}
    for start in range(0, n, K.SUB):
        edges |= {start, min(start + K.SUB, n) - 1}
    r = np.full(n, 0.25, np.float32)
    u = np.zeros(n, np.float32)
    r[sorted(edges)] = 1.5
    u[min(n, K.BLOCK) - 1 :: 2] = -3.0  # the second block (when there is one) is crossed densely
    want_r, want_codes = naive.accumulate_encode(r, u, 1.0)
    for threads in (1, 2):
        got_r = r.copy()
        m = encode(got_r, u, 1.0, threads=threads)
        idx, signs = decode_entries(m)
        np.testing.assert_array_equal((idx << 1) | (signs < 0), want_codes)
        assert got_r.tobytes() == want_r.tobytes()
        assert m.n_entries == len(want_codes) >= len(edges)  # every edge crosses τ


def test_clustered_entries_pick_varints_and_random_ones_pick_rice():
    # A run of neighbours plus one far entry: Rice's k follows the mean gap and wastes bits on the run,
    # varints spend one byte per neighbour. Random gaps are near geometric: Rice wins.
    n = 1_000_000
    r = np.zeros(n, np.float32)
    r[:100] = 2.0
    r[-1] = -2.0
    m = encode(r, None, 1.0)
    assert m.form == SPARSE and len(m.payload) < len(convert(m, RICE).payload)
    u = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    m = encode(np.zeros(n, np.float32), u, 3.3)
    assert m.form == RICE and len(m.payload) < 0.85 * len(convert(m, SPARSE).payload)
