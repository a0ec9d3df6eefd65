"""The small pure bookkeeping classes, each against a naive oracle, each small enough to test alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.transport.protocol.crypto import ReplayWindow
from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.history import History
from gradshare.transport.protocol.rangeset import RangeSet
from gradshare.transport.protocol.reassembly import Reassembler

ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 20)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ranges, st.integers(0, 220), st.integers(0, 220))
def test_rangeset_matches_a_python_set(adds, probe, cut):
    rs, oracle = RangeSet(), set()
    for a, n in adds:
        new = rs.add(a, a + n)
        assert new == (not set(range(a, a + n)) <= oracle)
        oracle |= set(range(a, a + n))
    spans = list(rs)
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(spans, spans[1:])), "ranges must not touch"
    assert (probe in rs) == (probe in oracle)
    assert rs.count() == len(oracle)
    run = probe
    while run in oracle:
        run += 1
    assert rs.contiguous_from(probe) == run
    gaps = rs.gaps(0, 230, limit=1000)
    assert {v for a, b in gaps for v in range(a, b)} == set(range(230)) - oracle
    rs.discard_below(cut)
    assert {v for a, b in rs for v in range(a, b)} == {v for v in oracle if v >= cut}


def test_rangeset_rejects_empty_range():
    import pytest

    with pytest.raises(ValueError, match="stop"):
        RangeSet().add(5, 5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=300), st.sampled_from([1, 16, 1024]))
def test_replay_window_accepts_each_counter_once(counters, size):
    w, seen, top = ReplayWindow(size), set(), -1
    for c in counters:
        reason = w.check(c)
        if c in seen and top - c < size:
            assert reason == "replayed"
        elif top - c >= size:
            assert reason == "too_old"
        else:
            assert reason is None
            w.accept(c)
            seen.add(c)
            top = max(top, c)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_reassembly_any_order_with_duplicates(data):
    n = data.draw(st.integers(1, 12))
    chunks = [bytes([i]) * data.draw(st.integers(0, 30)) for i in range(n)]
    order = data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=3 * n))
    order += [i for i in range(n) if i not in order]
    r = Reassembler(max_messages=4, max_bytes=10_000, max_message_bytes=1000)
    results = []
    for i in order:
        whole, reason = r.add("k", i, n, chunks[i], now=0.0)
        if whole is not None:
            results.append(whole)
    assert results[0] == b"".join(chunks)
    assert r.nbytes == 0 or len(r) == 1  # a duplicate after completion starts a fresh partial


def test_reassembly_bounds_are_enforced_and_counted():
    r = Reassembler(max_messages=2, max_bytes=100, max_message_bytes=60)
    assert r.add("a", 0, 3, b"x" * 10, 0.0) == (None, None)
    assert r.add("b", 0, 3, b"x" * 10, 0.0) == (None, None)
    assert r.add("c", 0, 3, b"x" * 10, 0.0) == (None, "reassembly_full")
    assert r.add("a", 1, 4, b"x", 0.0) == (None, "chunk_count_mismatch")
    assert r.add("a", 0, 3, b"x" * 10, 0.0) == (None, "duplicate_chunk")
    assert r.add("a", 1, 3, b"x" * 55, 0.0) == (None, "message_too_large")
    assert "a" not in r and r.nbytes == 10
    assert r.expire(now=100.0, max_age=30.0) == 1 and r.nbytes == 0


def test_history_bounded_by_count_and_bytes():
    h = History(max_entries=3, max_bytes=10)
    assert h.put(1, b"aaaa") == []
    assert h.put(2, b"bbbb") == []
    assert h.put(3, b"cc") == []
    assert h.put(4, b"d") == [1]  # 4 entries > 3
    assert h.put(5, b"eeeeeeee") == [2, 3]  # 15 bytes > 10: oldest go until 9 bytes remain
    assert list(h) == [4, 5] and h.nbytes == 9
    assert h.get(5) == b"eeeeeeee" and h.pop(5) == b"eeeeeeee" and h.nbytes == 1


def test_cursor_skips_ranks_that_ended():
    c = LogCursor(3, start_step=2)
    assert c.next_key() == (2, 0)
    c.end(1, 1)  # rank 1 finished before this attempt's start
    c.advance()
    assert c.next_key() == (2, 2)
    c.advance()
    assert c.complete_through == 2 and c.next_key() == (3, 0)
    c.end(0, 2)
    c.end(2, 3)
    assert c.next_key() == (3, 2)
    c.advance()
    assert c.next_key() is None and c.finished() and c.complete_through == 3


def test_late_allowance_grows_on_spurious_naks_and_decays_on_clean_updates():
    from gradshare.transport.protocol.reassembly import LateAllowance

    late = LateAllowance(0.004, cap=0.02)
    late.arrived_twice(1)  # never NAKed: a plain duplicate says nothing
    assert late.value == 0.004
    late.nakked(1)
    late.arrived_twice(1)  # the NAKed chunk came anyway: the NAK was spurious
    assert late.value == pytest.approx(0.006)
    late.arrived_twice(1)  # counted once per NAK
    assert late.value == pytest.approx(0.006)
    for step in range(2, 12):
        late.nakked(step)
        late.arrived_twice(step)
    assert late.value == 0.02  # capped
    late.nakked(50)
    late.completed(50)  # repaired by a NAK: no evidence either way
    assert late.value == 0.02
    for step in range(100, 1000):
        late.completed(step)
    assert late.value == 0.004  # decays back to the floor, never below
    small = LateAllowance(0.001, remember=2)
    for step in range(3):
        small.nakked(step)
    small.arrived_twice(0)  # forgotten (bounded memory): no growth
    assert small.value == 0.001


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, (1 << 48) - 1))
def test_nonce_is_sender_session_counter_little_endian(sender, session, counter):
    from gradshare.transport.protocol.crypto import nonce

    assert nonce(sender, session, counter) == (
        sender.to_bytes(2, "little") + session.to_bytes(4, "little") + counter.to_bytes(6, "little")
    )
