"""Wire codecs: symmetric round trips, and any bytes decode or raise DecodeError (decoders are bounded and raise one
error type)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.errors import DecodeError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.crypto import Sealer, new_job_key
from gradshare.transport.protocol.step_meta import StepMeta

CONTROL = [
    ev.Join(10, 4),
    ev.Welcome(10, 4, 3, 2),
    ev.Reject("no"),
    ev.Ack((1, 2, 3)),
    ev.Nak((ev.NakItem(4, 1, ()), ev.NakItem(5, 2, (0, 7)))),
    ev.Heartbeat(-1, 5),
    ev.Heartbeat(4, 5, 6),
    ev.Status(0, -1, 3, 0, (3, -1, 7), (ev.Ended(1, -1, True),)),
    ev.Status(2, 5, 300, 256, (9, 8), ()),
    ev.Finished(9),
    ev.Leave(),
    ev.SnapRequest(),
    ev.SnapInfo(1, 5, 10, 1, 40, "ab"),
    ev.SnapNak(1, ((0, 3), (5, 9))),
    ev.SnapDone(1),
    ev.Fail(3, 700, "ModuleNotFoundError", "No module named 'x'"),
    ev.FailAck(3, 700),
    ev.Loading(),
]


@pytest.mark.parametrize("msg", CONTROL, ids=lambda m: type(m).__name__)
def test_control_round_trip(msg):
    kind, body = wire.encode_control(msg)
    assert wire.decode_control(kind, body) == msg


@settings(max_examples=300, deadline=None)
@given(st.integers(1, wire.Kind.LOADING), st.binary(max_size=200))
def test_any_control_body_decodes_or_raises_decode_error(kind, body):
    try:
        wire.decode_control(kind, body)
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_any_bytes_as_header_decode_or_raise(data):
    try:
        h = wire.decode_header(data, max_chunks=100)
    except DecodeError:
        return
    assert h.index < h.count <= 100


def test_header_round_trip_and_size():
    h = wire.Header(wire.Kind.UPDATE, 3, 1, 2**63, 77, 2**48 - 1, 3, 10, 2, 5)
    raw = wire.encode_header(h)
    assert len(raw) == wire.HEADER_BYTES == 42
    assert wire.decode_header(raw, 10) == h
    with pytest.raises(DecodeError, match="chunk"):
        wire.decode_header(raw, 4)


_floats = st.one_of(st.none(), st.floats(allow_nan=False))
_wholes = st.one_of(st.none(), st.integers(-(2**53), 2**53))
step_metas = st.builds(
    StepMeta,
    loss=_floats,
    sparsity=_floats,
    bytes=_floats,
    epoch=_wholes,
    tau=_floats,
    lr=_floats,
    val_epoch=_wholes,
    val_metric=_floats,
    es_best=_floats,
    es_waited=_wholes,
    stop_requested=_wholes,
    stop_epoch=_wholes,
)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=3000), st.one_of(st.none(), step_metas), st.integers(20, 500))
def test_update_body_round_trip_through_chunks(payload, meta, chunk):
    body = wire.encode_update_body(payload, meta)
    parts = wire.split(body, chunk)
    assert all(len(p) <= chunk for p in parts) and len(parts) >= 1
    got, got_meta = wire.decode_update_body(b"".join(parts))
    assert got == payload and got_meta == meta


def test_meta_is_the_msgpack_map_of_floats_it_always_was():
    body = wire.encode_update_body(b"xy", StepMeta(loss=0.5, epoch=2, stop_epoch=3))
    assert msgpack.unpackb(body[2:-2]) == {"loss": 0.5, "epoch": 2.0, "stop_epoch": 3.0}
    assert wire.encode_update_body(b"", None) == b"\x00\x00"  # no meta: length 0


def test_meta_must_be_a_step_meta_of_numbers():
    with pytest.raises(ValueError, match="meta"):
        wire.encode_update_body(b"", {"loss": 1.0})
    with pytest.raises(ValueError, match="loss must be a number"):
        StepMeta(loss="high")
    with pytest.raises(ValueError, match="epoch must be a whole number"):
        StepMeta(epoch=1.5)


def _body(fields) -> bytes:
    packed = msgpack.packb(fields)
    return len(packed).to_bytes(2, "little") + packed


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"loss": 1.0, "step": 3.0}, "unknown entry 'step'"),  # an unknown key is refused, not dropped
        ({"loss": 1}, "'loss' is not a float"),  # msgpack ints never were meta values
        ({"loss": "x"}, "'loss' is not a float"),
        ({"epoch": 1.5}, "'epoch' is not a whole number"),
        ({1: 1.0}, "bad meta"),  # msgpack itself refuses a number key
        (3.0, "meta is not a map"),
    ],
)
def test_a_malformed_meta_is_refused_with_a_clear_error(fields, error):
    with pytest.raises(DecodeError, match=error):
        wire.decode_update_body(_body(fields))


@pytest.mark.parametrize("insecure", [False, True])
def test_channel_seals_opens_and_rejects(insecure):
    key = new_job_key()
    a = Channel(key=key, insecure=insecure, job=5, sender=1, attempt=0, datagram_size=400, max_chunks=99, max_windows=4)
    b = Channel(key=key, insecure=insecure, job=5, sender=2, attempt=0, datagram_size=400, max_chunks=99, max_windows=4)
    d = a.seal_control(ev.Finished(3))
    h = b.parse(d)
    assert b.open(h, d) is not None
    assert b.open(h, d) is None and b.drops["replayed"] == 1
    if not insecure:
        forged = d[:-1] + bytes([d[-1] ^ 1])
        h2 = b.parse(forged)
        b.replay = type(b.replay)(4)
        assert b.open(h2, forged) is None and b.drops["auth_failed"] == 1
        other = Channel(
            key=new_job_key(),
            insecure=False,
            job=5,
            sender=1,
            attempt=0,
            datagram_size=400,
            max_chunks=99,
            max_windows=4,
        )
        d3 = other.seal_control(ev.Finished(3))
        assert b.open(b.parse(d3), d3) is None and b.drops["auth_failed"] == 2
    wrong_job = Channel(
        key=key, insecure=insecure, job=6, sender=1, attempt=0, datagram_size=400, max_chunks=99, max_windows=4
    ).seal_control(ev.Leave())
    assert b.parse(wrong_job) is None and b.drops["wrong_job"] == 1
    assert b.parse(b"x" * 401) is None and b.drops["oversized"] == 1
    assert b.parse(b"GS") is None and b.drops["malformed"] == 1


def test_key_and_job_id_validation():
    with pytest.raises(ValueError, match="key"):
        Sealer(b"short")
    assert len(new_job_key()) == 32 and new_job_key() != new_job_key()
    assert wire.job_id_to_int("job-a") == wire.job_id_to_int("job-a") != wire.job_id_to_int("job-b")
    with pytest.raises(ValueError, match="job_id"):
        wire.job_id_to_int(-1)
    with pytest.raises(ValueError, match="datagram_size"):
        wire.check_datagram_size(100)
