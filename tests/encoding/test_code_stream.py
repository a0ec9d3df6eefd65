"""A message read a bounded batch at a time (encoding/code_stream.py, the forms' `decode_batch`) against
the naive payload parsers of tests/naive.py, in every form, at any batch size and any cut points; and
the step cap's windowed sums (step_cap.summed_norms2) against a dense float64 oracle at any window."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import naive
from gradshare.encoding import Message, StepUpdate, step_cap
from gradshare.encoding.code_stream import CodeStream
from gradshare.encoding.forms import BY_NAME
from gradshare.encoding.step_cap import summed_norms2

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARSERS = {"sparse": naive.parse_sparse, "rice": naive.parse_rice, "bitmap": naive.parse_bitmap}


@st.composite
def messages(draw):
    """A message of 1-400 parameters at a density from none to all, in a form drawn among those that hold it."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 400))
    idx = np.flatnonzero(rng.random(n) < draw(st.sampled_from([0.0, 0.01, 0.2, 0.7, 1.0])))
    codes = (idx.astype(np.int64) << 1) | (rng.random(idx.size) < 0.5)
    form = "empty" if codes.size == 0 else draw(st.sampled_from(["sparse", "rice", "bitmap"]))
    return Message.from_codes(codes, 0.5, n, form), codes


def naive_codes(message: Message) -> list[int]:
    return (
        [] if message.form == "empty" else PARSERS[message.form](message.payload, message.n_entries, message.n_params)
    )


@SETTINGS
@given(messages(), st.integers(1, 70))
def test_batches_give_every_code_in_order(case, batch):
    message, codes = case
    got = [c for b in CodeStream(message, batch).batches() for c in b.tolist()]
    assert got == naive_codes(message) == codes.tolist()


@SETTINGS
@given(messages(), st.integers(1, 70), st.lists(st.integers(0, 450), max_size=8))
def test_below_takes_each_code_once_below_each_cut(case, batch, cuts):
    message, codes = case
    stream = CodeStream(message, batch)
    taken, lo = [], 0
    for hi in sorted(cuts) + [message.n_params]:
        part = stream.below(hi).tolist()
        assert all(lo <= c >> 1 < max(hi, lo) for c in part)
        taken += part
        lo = max(lo, hi)
    assert taken == codes.tolist()
    assert stream.below(message.n_params).size == 0 and list(stream.batches()) == []


@SETTINGS
@given(messages(), st.integers(1, 70), st.integers(0, 400))
def test_a_form_decodes_a_batch_from_any_cursor_as_the_naive_parser(case, batch, skip):
    """decode_batch straight from a form: the codes after `skip` entries, from the cursor they left."""
    message, _ = case
    want = naive_codes(message)
    form = BY_NAME[message.form]
    skip = min(skip, len(want))
    out = np.empty(max(len(want), 1), np.int64)
    cursor = form.decode_batch(message.reader, form.start, out, skip)
    cnt = min(batch, len(want) - skip)
    form.decode_batch(message.reader, cursor, out, cnt)
    assert out[:cnt].tolist() == want[skip : skip + cnt]


def test_the_empty_form_decodes_nothing_and_refuses_a_count():
    form = BY_NAME["empty"]
    assert form.decode_batch(form.reader(b""), form.start, np.empty(1, np.int64), 0) == form.start
    with pytest.raises(ValueError, match="no entries"):
        form.decode_batch(form.reader(b""), form.start, np.empty(1, np.int64), 1)


def test_a_batch_below_one_is_refused():
    with pytest.raises(ValueError, match="batch"):
        CodeStream(Message.from_codes(np.array([0], np.int64), 0.5, 4), 0)


@st.composite
def steps(draw):
    """(tensor starts, n, messages, scale): 1-5 tensors, 1-6 overlapping messages of several τ."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = draw(st.lists(st.integers(1, 120), min_size=1, max_size=5))
    n = sum(sizes)
    updates = []
    for _ in range(draw(st.integers(1, 6))):
        idx = np.flatnonzero(rng.random(n) < draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])))
        codes = (idx.astype(np.int64) << 1) | (rng.random(idx.size) < 0.5)
        tau = float(np.float32(draw(st.sampled_from([1e-3, 0.05, 2.0]))))
        updates.append(StepUpdate(Message.from_codes(codes, tau, n)))
    starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    return starts, n, updates, draw(st.sampled_from([1.0, 0.25]))


@SETTINGS
@given(steps(), st.one_of(st.none(), st.integers(1, 700)), st.sampled_from([1, 5, 64, step_cap.WINDOW]))
def test_windowed_sums_match_a_dense_oracle_at_any_window(case, window, entries):
    """A window of fixed width, or (None) one that ends with the first of the messages' decoded batches of
    `entries` / N codes each: the default, which holds at most `entries` entries at once."""
    starts, n, updates, scale = case
    total = np.zeros(n)
    for u in updates:
        step = float(u.message.step(scale))
        for code in naive_codes(u.message):
            total[code >> 1] += -step if code & 1 else step
    ends = [*starts[1:].tolist(), n]
    want = [math.fsum(total[lo:hi] ** 2) for lo, hi in zip(starts.tolist(), ends)]
    with mock.patch.object(step_cap, "WINDOW", entries):
        got = summed_norms2(updates, scale, starts, n, window)
        # the same sums again: every replica gets the same factors
        assert np.array_equal(got, summed_norms2(updates, scale, starts, n, window))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_a_stream_reaches_to_the_end_of_its_decoded_batch():
    codes = (np.array([3, 9, 10, 40, 41], np.int64) << 1) | 1
    stream = CodeStream(Message.from_codes(codes, 0.5, 50, "rice"), batch=2)
    assert stream.reach() == 10  # the batch 3, 9
    assert stream.below(5).tolist() == [7] and stream.reach() == 10
    assert stream.below(10).tolist() == [19]
    assert stream.reach() == 41  # the next batch: 10, 40
    assert stream.below(41).tolist() == [21, 81] and stream.reach() == 42
    assert stream.below(42).tolist() == [83] and stream.reach() is None


def bincount_window_norms2(runs, steps, starts, out):
    """NumPy oracle of norms.window_norms2: the values of each index summed in run order by bincount, their
    squares summed per tensor in index order by bincount, then added to ``out``."""
    index = [c >> 1 for c in runs]
    values = [np.where(c & 1, -s, s) for c, s in zip(runs, steps)]
    where, inverse = np.unique(np.concatenate(index), return_inverse=True)
    total = np.bincount(inverse, weights=np.concatenate(values), minlength=where.size)
    tensor = np.searchsorted(starts, where, side="right") - 1
    out += np.bincount(tensor, weights=total * total, minlength=len(starts))


@SETTINGS
@given(steps())
def test_the_window_kernel_is_the_bincount_merge_bit_for_bit(case):
    from gradshare.encoding.norms import window_norms2

    starts, n, updates, scale = case
    runs = [naive_codes_array(u.message) for u in updates if u.message.n_entries]
    steps_ = [float(u.message.step(scale)) for u in updates if u.message.n_entries]
    if not runs:
        return
    got, want = np.full(len(starts), 0.25), np.full(len(starts), 0.25)  # added to what is there
    window_norms2(runs, steps_, starts, got)
    bincount_window_norms2(runs, steps_, starts, want)
    assert got.tobytes() == want.tobytes()


def naive_codes_array(message: Message) -> np.ndarray:
    return np.array(naive_codes(message), np.int64)
