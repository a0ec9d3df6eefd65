"""A dense step's message built in passes (gradshare/encoding/encode_passes.py): the same entries, residual
and point as the naive oracles of tests/naive.py, the payload of `Message.from_codes` over those codes in
every form, a NaN named by its index, and no array of all the codes held on the way. The forms' writers
and `SizeTally` fed in batches against the whole-array encode."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import naive
from gradshare.encoding import Message, encode
from gradshare.encoding.encode_passes import first_buffer
from gradshare.encoding.folded import encode_folded
from gradshare.encoding.forms import BY_NAME, measure
from gradshare.encoding.forms.rice import SizeTally
from gradshare.errors import NonFiniteError

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMS = [None, "sparse", "rice", "bitmap"]


@st.composite
def vectors(draw):
    """(residual, update or None, τ, form): 4 k-40 k values, dense enough that most overflow the first buffer
    (1,024 codes here), with runs of zeros so the gaps vary."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(4096, 40_000))
    r = (rng.standard_normal(n) * draw(st.sampled_from([0.5, 2.0]))).astype(np.float32)
    r[rng.random(n) < draw(st.sampled_from([0.0, 0.3, 0.9]))] = 0.0
    u = (rng.standard_normal(n)).astype(np.float32) if draw(st.booleans()) else None
    return r, u, draw(st.sampled_from([0.05, 0.5, 1.0])), draw(st.sampled_from(FORMS))


def _same(message: Message, codes: np.ndarray, tau: float, form: str | None):
    want = Message.from_codes(codes, tau, message.n_params, form)
    assert (message.form, message.n_entries) == (want.form, want.n_entries)
    assert message.payload == want.payload
    decoded = Message.from_bytes(message.to_bytes(), max_params=message.n_params)  # the validating decoder
    assert decoded.n_entries == codes.size


@SETTINGS
@given(vectors())
def test_the_plain_encode_in_passes_matches_the_oracle(case):
    r, u, tau, form = case
    want_r, codes = naive.accumulate_encode(r, u, tau)
    got_r = r.copy()
    message = encode(got_r, None if u is None else u.copy(), tau, form=form)
    assert np.array_equal(got_r, want_r)
    _same(message, codes, tau, form)


@SETTINGS
@given(vectors(), st.booleans())
def test_the_general_paths_diff_and_rewind_in_passes_match_the_oracle(case, rewind):
    r, u, tau, form = case
    rng = np.random.default_rng(r.size)
    before = rng.standard_normal(r.size).astype(np.float32)
    after = before + (rng.standard_normal(r.size) if u is None else u).astype(np.float32)
    want_r, codes = naive.accumulate_diff_encode(r, after, before, tau)
    got_r, got_after = r.copy(), after.copy()
    message = encode(got_r, got_after, tau, base=before, rewind=rewind, form=form)
    assert np.array_equal(got_r, want_r)
    assert np.array_equal(got_after, before if rewind else after)
    _same(message, codes, tau, form)


@SETTINGS
@given(vectors(), st.sampled_from([1.0, 0.5]))
def test_the_folded_encode_in_passes_matches_the_oracle(case, scale):
    r, _, tau, form = case
    p = np.random.default_rng(r.size).standard_normal(r.size).astype(np.float32)
    q = (p + np.float32(scale) * r).astype(np.float32)
    want_q, codes = naive.folded_encode(q, p, tau, scale)
    got_q = q.copy()
    message = encode_folded(got_q, p, tau, scale, form=form)
    assert np.array_equal(got_q, want_q)
    _same(message, codes, tau, form)


@pytest.mark.parametrize("where", [10, 30_000])  # in the first buffer's blocks, and in the passes' part
@pytest.mark.parametrize("kind", ["plain", "update", "folded"])
def test_a_nan_is_named_by_its_index_in_either_part(where, kind):
    n = 40_000
    r = np.full(n, 2.0, np.float32)  # every value an entry: the first buffer fills in the first blocks
    r[where] = np.nan
    assert first_buffer(n).size < where or where == 10
    with pytest.raises(NonFiniteError, match=f"not finite at index {where}"):  # a ValueError too
        if kind == "folded":
            encode_folded(r, np.zeros(n, np.float32), 1.0)
        else:
            encode(r, np.zeros(n, np.float32) if kind == "update" else None, 1.0)


def test_a_dense_step_holds_no_array_of_all_its_codes():
    """2 M values, every one an entry: the codes alone are 16 MB as int64; the passes hold the first
    buffer (64 kB), one chunk (512 kB) and the payload (2 bits an entry here: 0.5 MB, and its bytes copy)."""
    n = 2_000_000
    rng = np.random.default_rng(0)
    r = np.where(rng.random(n) < 0.5, 1.5, -1.5).astype(np.float32)
    p = np.zeros(n, np.float32)
    for run in (lambda: encode(r.copy(), None, 1.0), lambda: encode_folded(r.copy(), p, 1.0)):
        run()  # compile the kernels first
        tracemalloc.start()
        message = run()
        peak = tracemalloc.get_traced_memory()[1] - r.nbytes  # less the copy of r the call is given
        tracemalloc.stop()
        assert message.n_entries == n
        assert peak < 3 << 20, f"{peak / 2**20:.1f} MiB held"


@st.composite
def code_batches(draw):
    """Sorted codes of up to 3,000 parameters and the cut points that split them into batches."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 3000))
    idx = np.flatnonzero(rng.random(n) < draw(st.sampled_from([0.0, 0.01, 0.3, 1.0])))
    codes = (idx.astype(np.int64) << 1) | (rng.random(idx.size) < 0.5)
    cuts = sorted(draw(st.lists(st.integers(0, codes.size), max_size=6)))
    return n, codes, np.split(codes, cuts)


@SETTINGS
@given(code_batches())
def test_sizes_and_payloads_written_in_batches_are_those_of_the_whole(case):
    n, codes, batches = case
    tally = SizeTally(n, codes.size)
    for b in batches:
        tally.add(b)
    sizes = tally.sizes()
    assert sizes == measure(codes, n)
    for name in ("sparse", "rice", "bitmap") if codes.size else ("empty",):
        form = BY_NAME[name]
        writer = form.writer(sizes)
        for b in batches:
            writer.add(b)
        payload = writer.payload()
        assert payload == form.encode(codes, sizes)
        if name != "empty":
            parse = {"sparse": naive.parse_sparse, "rice": naive.parse_rice, "bitmap": naive.parse_bitmap}[name]
            assert parse(payload, codes.size, n) == codes.tolist()


def test_a_writer_given_other_codes_than_measured_refuses_them():
    codes = np.array([0, 2, 4, 7], np.int64)  # indices 0-3
    sizes = measure(codes, 100)
    for name in ("sparse", "rice", "bitmap"):
        writer = BY_NAME[name].writer(sizes)
        writer.add(codes[:3])
        with pytest.raises(ValueError, match="measured 4 entries"):
            writer.payload()  # one code short
    for name in ("sparse", "rice"):
        writer = BY_NAME[name].writer(sizes)
        with pytest.raises(IndexError):  # far gaps need more bytes than measured: never past the buffer
            writer.add(np.array([0, 2, 4, 199], np.int64))
    with pytest.raises(ValueError, match="measured 0 codes of the 4 announced"):
        SizeTally(100, 4).sizes()
