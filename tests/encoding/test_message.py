"""Message byte format: symmetric, bounded, and every bad input is a DecodeError."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import naive
from gradshare.encoding import BITMAP, EMPTY, RICE, SPARSE, Message, apply, convert, decode, decode_entries, encode
from gradshare.encoding.message import HEADER, HEADER_SIZE
from gradshare.errors import DecodeError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX = 4096


@st.composite
def messages(draw):
    n = draw(st.integers(0, MAX))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]))
    u = (rng.standard_normal(n) * rng.random(n).__lt__(density) * 3).astype(np.float32)
    tau = draw(st.sampled_from([1e-3, 0.7, 1.0, 2.5]))
    m = encode(np.zeros(n, np.float32), u, tau)
    form = draw(st.sampled_from([None, SPARSE, RICE, BITMAP] + ([EMPTY] if m.n_entries == 0 else [])))
    return m if form is None else convert(m, form)


def _decode_or_decode_error(data: bytes, max_params: int = MAX) -> Message | None:
    try:
        m = Message.from_bytes(data, max_params=max_params)
    except DecodeError:
        return None
    # Whatever decodes is a valid message: it applies within bounds, and round-trips.
    assert m.n_params <= max_params and 0 <= m.n_entries <= m.n_params
    p = np.zeros(m.n_params, np.float32)
    apply(m, p)
    assert np.count_nonzero(p) == m.n_entries
    assert Message.from_bytes(m.to_bytes(), max_params=max_params) == m
    return m


@SETTINGS
@given(messages())
def test_round_trip(m):
    data = m.to_bytes()
    assert len(data) == m.nbytes == HEADER_SIZE + len(m.payload)
    back = Message.from_bytes(data, max_params=m.n_params)
    assert back == m
    assert decode(back).tobytes() == decode(m).tobytes()
    assert Message.from_bytes(bytearray(data), max_params=MAX) == m
    assert Message.from_bytes(memoryview(data), max_params=MAX) == m


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_decode_error(data):
    _decode_or_decode_error(data)


@SETTINGS
@given(messages(), st.data())
def test_mutated_messages_decode_or_raise_decode_error(m, data):
    raw = bytearray(m.to_bytes())
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "header"]))
    if action == "flip" and raw:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    elif action == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=20))
    else:  # forge one header field with an arbitrary value, keeping the rest consistent
        fields = list(HEADER.unpack_from(raw))
        i = data.draw(st.integers(1, 6))
        limits = {1: 255, 2: 255, 4: 2**64 - 1, 5: 2**64 - 1, 6: 2**64 - 1}
        if i == 3:
            fields[3] = data.draw(st.floats(width=32))
        else:
            fields[i] = data.draw(st.integers(0, limits[i]))
        raw[:HEADER_SIZE] = HEADER.pack(*fields)
    _decode_or_decode_error(bytes(raw))


def _header(form: int, tau: float, n_params: int, n_entries: int, length: int) -> bytes:
    return HEADER.pack(b"GS", 1, form, tau, n_params, n_entries, length)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "too short"),
        (b"GS\x01", "too short"),
        (b"XX" + bytes(30), "magic"),
        (_header(1, 1.0, 10, 1, 1)[:2] + b"\x02" + _header(1, 1.0, 10, 1, 1)[3:] + b"\x00", "version"),
        (_header(9, 1.0, 10, 0, 0), "form"),
        (_header(0, 0.0, 10, 0, 0), "threshold"),
        (_header(0, -1.0, 10, 0, 0), "threshold"),
        (_header(0, float("nan"), 10, 0, 0), "threshold"),
        (_header(0, float("inf"), 10, 0, 0), "threshold"),
        (_header(0, 1.0, MAX + 1, 0, 0), "max_params"),
        (_header(1, 1.0, 10, 11, 11) + bytes(11), "n_entries"),
        (_header(1, 1.0, 10, 1, 5) + b"\x00", "payload length"),
        (_header(1, 1.0, 10, 1, 1), "payload length"),
        (_header(0, 1.0, 10, 1, 0), "empty form"),
        (_header(0, 1.0, 10, 0, 1) + b"\x00", "empty form"),
        (_header(1, 1.0, 10, 1, 1) + b"\x14", "index"),  # gap 10 at n_params 10
        (_header(1, 1.0, 10, 2, 2) + b"\x10\x02", "index"),  # 8, then 8 + 1 + 1 = 10
        (_header(1, 1.0, 10, 1, 2) + b"\x80\x00", "shortest form"),
        (_header(1, 1.0, 10, 1, 1) + b"\x80", "past the end"),
        (_header(1, 1.0, 10, 1, 2) + b"\x02\x02", "left over"),
        (_header(1, 1.0, 2**61, 1, 10) + b"\xff" * 9 + b"\x01", "cannot hold"),
        (_header(1, 1.0, 2**61, 1, 9) + b"\xff" * 9, "longer than 9 bytes"),
        (_header(2, 1.0, 8, 1, 2) + b"\x03\x00", "reserved"),
        (_header(2, 1.0, 6, 1, 2) + b"\x00\x10", "past the last parameter"),
        (_header(2, 1.0, 8, 2, 2) + b"\x01\x00", "different number"),
        (_header(2, 1.0, 8, 1, 3) + b"\x01\x00\x00", "bitmap payload"),
        (_header(3, 1.0, 10, 1, 2) + b"\x29\x08", "rice k is > 40"),
        (_header(3, 1.0, 1000, 1, 2) + b"\x00\x00", "past the end"),
        (_header(3, 1.0, 10, 1, 2) + b"\x00\x00", "index"),  # 64 zeros: the gap is past n_params already
        (_header(3, 1.0, 10, 1, 3) + b"\x00\x00\x04", "index"),  # gap 10 at n_params 10
        (_header(3, 1.0, 10, 1, 3) + b"\x00\x08\x00", "left over"),
        (_header(3, 1.0, 10, 1, 2) + b"\x00\x48", "bits are set past"),
        (_header(3, 1.0, 10, 9, 2) + b"\x00\x08", "cannot hold"),
        (_header(3, 1.0, 10, 0, 0), "cannot hold"),
    ],
)
def test_bad_bytes_raise_decode_error_naming_the_problem(data, why):
    with pytest.raises(DecodeError, match=why):
        Message.from_bytes(data, max_params=MAX if why == "max_params" else 2**61)


def test_forged_lengths_never_allocate_from_the_header():
    # A header claiming 2**60 parameters (bitmap: 2**58 bytes) or 2**63 payload bytes must be refused
    # by comparing with the data actually present, with no allocation anywhere near those sizes.
    forged = [
        _header(2, 1.0, 2**60, 1, 2**58) + b"\x01",
        _header(1, 1.0, 2**60, 2**60, 2**63) + b"\x01" * 64,
        _header(2, 1.0, 2**60, 0, 1),
    ]
    tracemalloc.start()
    try:
        for data in forged:
            with pytest.raises(DecodeError):
                Message.from_bytes(data, max_params=2**61)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_huge_sparse_message_is_valid_without_allocating():
    # n_params is only a bound: a sparse message for 2**60 parameters with 2 entries is a few bytes.
    codes = np.array([2, (2**60 - 1) << 1 | 1], np.int64)
    data = _header(1, 0.5, 2**60, 2, len(naive.sparse_payload(codes))) + naive.sparse_payload(codes)
    m = Message.from_bytes(data, max_params=2**60)
    assert m.n_entries == 2 and m.to_bytes() == data
    with pytest.raises(DecodeError, match="max_params"):
        Message.from_bytes(data, max_params=2**60 - 1)


def test_from_bytes_argument_errors():
    data = encode(np.zeros(4, np.float32), None, 1.0).to_bytes()
    with pytest.raises(TypeError, match="max_params"):
        Message.from_bytes(data)  # the bound is required
    with pytest.raises(ValueError, match="max_params"):
        Message.from_bytes(data, max_params=-1)
    with pytest.raises(TypeError, match="data"):
        Message.from_bytes("text", max_params=4)


def test_constructor_validates_like_the_decoder():
    with pytest.raises(ValueError, match="threshold"):
        Message(0.0, 4, 0, EMPTY, b"")
    with pytest.raises(ValueError, match="threshold"):
        Message(1e-50, 4, 0, EMPTY, b"")  # 0 in float32
    with pytest.raises(ValueError, match="form"):
        Message(1.0, 4, 0, "dense", b"")
    with pytest.raises(ValueError, match="n_entries"):
        Message(1.0, 4, 5, SPARSE, b"\x00" * 5)
    with pytest.raises(TypeError, match="n_params"):
        Message(1.0, 4.0, 0, EMPTY, b"")
    with pytest.raises(ValueError, match="index"):
        Message(1.0, 4, 1, SPARSE, b"\x08")
    # τ is held in float32 precision, so the object equals its decoded copy
    m = Message(0.1, 4, 1, SPARSE, bytearray(b"\x00"))
    assert m.threshold == float(np.float32(0.1)) and isinstance(m.payload, bytes)
    assert Message.from_bytes(m.to_bytes(), max_params=4) == m


def test_rice_payload_by_hand():
    m = Message.from_bytes(_header(3, 1.0, 10, 1, 2) + b"\x00\x08", max_params=10)  # k=0: 0001, sign 0
    assert decode(m).tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    m = Message.from_bytes(_header(3, 1.0, 10, 2, 2) + b"\x00\x3c", max_params=10)  # 0,0 | 1,1 | 1,1
    assert decode(m).tolist() == [0, 0, -1, -1, 0, 0, 0, 0, 0, 0]


def test_header_layout_is_little_endian_and_fixed():
    m = Message(0.5, 10, 1, SPARSE, b"\x06")  # index 3, +τ
    assert m.to_bytes() == b"GS\x01\x01" + struct.pack("<f", 0.5) + struct.pack("<QQQ", 10, 1, 1) + b"\x06"
    assert "1 bytes" in repr(m)


PARSERS = {SPARSE: naive.parse_sparse, RICE: naive.parse_rice, BITMAP: naive.parse_bitmap}


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([SPARSE, RICE, BITMAP]),
    st.binary(max_size=24),
    st.integers(0, 12),
    st.integers(0, 80),
    st.data(),
)
def test_validation_kernels_accept_exactly_what_the_naive_parsers_accept(form, payload, n_entries, n_params, data):
    # Seed half the cases with a valid payload so acceptance is exercised, not only rejection.
    if data.draw(st.booleans()) and n_params:
        idx = sorted(data.draw(st.sets(st.integers(0, n_params - 1), max_size=min(n_params, 12))))
        codes = np.array([(i << 1) | data.draw(st.integers(0, 1)) for i in idx], np.int64)
        m = convert(Message(1.0, n_params, len(idx), BITMAP, naive.bitmap_payload(codes, n_params)), form)
        payload, n_entries = bytearray(m.payload), m.n_entries
        if payload and data.draw(st.booleans()):
            payload[data.draw(st.integers(0, len(payload) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        payload = bytes(payload)
    n_entries = min(n_entries, n_params)
    want = PARSERS[form](payload, n_entries, n_params)
    try:
        m = Message(1.0, n_params, n_entries, form, payload)
    except ValueError:
        assert want is None
        return
    assert want is not None
    idx, signs = decode_entries(m)
    assert ((idx << 1) | (signs < 0)).tolist() == want


def test_the_form_table_is_keyed_by_the_wire_tag_and_names_every_form():
    from gradshare.encoding import forms

    assert forms.NAMES == (EMPTY, SPARSE, RICE, BITMAP)
    assert {f.name: f.tag for f in forms.ORDER} == {EMPTY: 0, SPARSE: 1, BITMAP: 2, RICE: 3}  # the header's form byte
    for tag, form in forms.BY_TAG.items():
        assert form.tag == tag and forms.BY_NAME[form.name] is form
        m = Message(1.0, 8, 0, form.name, form.encode(np.empty(0, np.int64), forms.measure(np.empty(0, np.int64), 8)))
        assert m.to_bytes()[3] == tag and Message.from_bytes(m.to_bytes(), max_params=8) == m
