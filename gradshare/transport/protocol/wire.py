"""Datagram layout and the byte codecs of every message (symmetric ``encode_x``/``decode_x`` pairs).

Every datagram::

    header (42 bytes, little-endian, authenticated as AEAD associated data)
      magic "GS" | version u8 | kind u8 | sender u16 | attempt u16 | job u64 | session u32 | counter u64
      | origin u16 | step u32 | index u32 | count u32
    body (sealed): a msgpack list for control kinds; one chunk of an update or snapshot otherwise
    tag (16 bytes, absent with insecure=True)

``sender`` is who sealed the datagram (a rank, or RELAY_ID); ``origin`` is the rank whose update this is.
The relay forwards update chunks exactly as their origin sealed them (sender = origin), so a forwarded
chunk is authenticated end to end by the rank that wrote it; ``step``/``index``/``count`` place a chunk;
``session`` + ``counter`` make the nonce (see crypto.py). An update message is ``u16 meta length | msgpack meta |
encoder payload``, split into ``count`` chunks of at most ``datagram_size - header - tag`` bytes.

Decoders are bounded: msgpack limits are explicit and every field is range-checked; anything invalid raises
:class:`~gradshare.errors.DecodeError` (msgpack ``Unpacker`` limits, aioquic ``quic/packet.py``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import msgpack

from gradshare.errors import DecodeError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.step_meta import StepMeta

MAGIC = b"GS"
VERSION = 1
RELAY_ID = 0xFFFF
AGGREGATE_ORIGIN = ev.AGGREGATE_ORIGIN  # the origin field of the relay's aggregated messages
HEADER = struct.Struct("<2sBBHHQIQHIII")
HEADER_BYTES = HEADER.size
MAX_COUNTER = 1 << 48  # the nonce holds 48 bits of it (crypto.nonce)
# where the two fields that differ between the chunks of one update sit (header_key)
_COUNTER_AT, _COUNTER = struct.calcsize("<2sBBHHQI"), struct.Struct("<Q")
_INDEX_AT, _INDEX = struct.calcsize("<2sBBHHQIQHI"), struct.Struct("<I")
DEFAULT_DATAGRAM_SIZE = 1400  # fits a 1500-byte Ethernet MTU with IPv4/IPv6 + UDP headers
DEFAULT_PORT = 40123  # the relay's UDP port on the driver (SharedTrainer, `gradshare relay`)
DEFAULT_BIND = "0.0.0.0"  # the address the relay binds: every interface
MIN_DATAGRAM_SIZE = 256
MAX_DATAGRAM_SIZE = 65000
MAX_META_BYTES = 1024
MAX_META_KEYS = 32


class Kind:
    # Final: mypy then knows each as a Literal int (Channel.control's overloads rely on it)
    JOIN: Final = 1
    WELCOME: Final = 2
    REJECT: Final = 3
    UPDATE: Final = 4
    ACK: Final = 5
    NAK: Final = 6
    HEARTBEAT: Final = 7
    STATUS: Final = 8
    FINISHED: Final = 9
    LEAVE: Final = 10
    SNAP_REQUEST: Final = 11
    SNAP_INFO: Final = 12
    SNAP_CHUNK: Final = 13
    SNAP_NAK: Final = 14
    SNAP_DONE: Final = 15
    FAIL: Final = 16
    FAIL_ACK: Final = 17
    LOADING: Final = 18


CHUNKED_KINDS = frozenset({Kind.UPDATE, Kind.SNAP_CHUNK})


class Header(NamedTuple):
    kind: int
    sender: int
    attempt: int
    job: int
    session: int
    counter: int
    origin: int = 0
    step: int = 0
    # These two shadow tuple.index()/tuple.count(), which nothing calls on a Header; the wire's names are
    # kept (every layer reads h.index/h.count), hence the two ignores.
    index: int = 0  # type: ignore[assignment]
    count: int = 1  # type: ignore[assignment]


def encode_header(h: Header) -> bytes:
    return HEADER.pack(
        MAGIC, VERSION, h.kind, h.sender, h.attempt, h.job, h.session, h.counter, h.origin, h.step, h.index, h.count
    )


def decode_header(data: bytes, max_chunks: int) -> Header:
    """Parse and range-check the header of a datagram; raises DecodeError naming the bad field."""
    if len(data) < HEADER_BYTES:
        raise DecodeError(f"truncated: {len(data)} bytes < {HEADER_BYTES}-byte header")
    (magic, version, kind, sender, attempt, job, session, counter, origin, step, index, count) = HEADER.unpack_from(
        data
    )
    if magic != MAGIC:
        raise DecodeError("bad magic")
    if version != VERSION:
        raise DecodeError(f"unsupported version {version}")
    if not Kind.JOIN <= kind <= Kind.LOADING:
        raise DecodeError(f"unknown kind {kind}")
    if counter >= MAX_COUNTER:
        raise DecodeError("nonce counter out of range")
    if kind in CHUNKED_KINDS:
        if not 1 <= count <= max_chunks or index >= count:
            raise DecodeError(f"chunk {index}/{count} out of range (max {max_chunks} chunks)")
    elif index != 0 or count != 1 or step != 0 or origin != 0:
        raise DecodeError("control datagram with chunk fields set")
    return Header(kind, sender, attempt, job, session, counter, origin, step, index, count)


def header_key(data: bytes) -> tuple[bytes, bytes, bytes]:
    """A datagram's header bytes but its counter and chunk index: equal for the chunks of one update (the
    relay's fast path for a run of them, RelayCore.receive_run). ``data`` holds a whole header."""
    return (
        data[:_COUNTER_AT],
        data[_COUNTER_AT + _COUNTER.size : _INDEX_AT],
        data[_INDEX_AT + _INDEX.size : HEADER_BYTES],
    )


def counter_and_index(data: bytes) -> tuple[int, int]:
    """The header's nonce counter and chunk index (``data`` holds a whole header)."""
    return _COUNTER.unpack_from(data, _COUNTER_AT)[0], _INDEX.unpack_from(data, _INDEX_AT)[0]


def job_id_to_int(job_id: int | str | bytes) -> int:
    """Jobs are told apart by a 64-bit id; strings/bytes (e.g. a Spark job group) are hashed to one."""
    if isinstance(job_id, bool):
        raise TypeError("job_id must be an int, str or bytes (got bool)")
    if isinstance(job_id, int):
        if not 0 <= job_id < 1 << 64:
            raise ValueError(f"job_id must be in [0, 2**64) (got {job_id})")
        return job_id
    if isinstance(job_id, str):
        job_id = job_id.encode()
    if isinstance(job_id, (bytes, bytearray)):
        return int.from_bytes(hashlib.blake2b(bytes(job_id), digest_size=8).digest(), "little")
    raise TypeError(f"job_id must be an int, str or bytes (got {type(job_id).__name__})")


def check_datagram_size(datagram_size: int) -> int:
    if type(datagram_size) is not int or not MIN_DATAGRAM_SIZE <= datagram_size <= MAX_DATAGRAM_SIZE:
        raise ValueError(
            f"datagram_size must be an int in [{MIN_DATAGRAM_SIZE}, {MAX_DATAGRAM_SIZE}] (got {datagram_size!r})"
        )
    return datagram_size


def split(body: bytes, chunk_bytes: int) -> list[bytes]:
    """Chunks of at most ``chunk_bytes``; an empty body is one empty chunk (it still has to arrive)."""
    if not body:
        return [b""]
    mv = memoryview(body)
    return [bytes(mv[i : i + chunk_bytes]) for i in range(0, len(body), chunk_bytes)]


# --- update bodies ------------------------------------------------------------------------------------


def encode_update_body(payload: bytes, meta: StepMeta | None) -> bytes:
    """``u16 meta length | msgpack meta | payload``; no meta is length 0 (step_meta.py: the map's keys)."""
    if meta is None:
        packed = b""
    else:
        if not isinstance(meta, StepMeta):
            raise ValueError(f"meta must be a StepMeta or None (got {type(meta).__name__})")
        packed = msgpack.packb(meta.to_wire(), use_bin_type=True)
        if len(packed) > MAX_META_BYTES:  # 12 floats and their names pack to ~180 bytes: never, today
            raise ValueError(f"meta packs to {len(packed)} bytes > {MAX_META_BYTES}")
    return len(packed).to_bytes(2, "little") + packed + bytes(payload)


def decode_update_body(body: bytes) -> tuple[bytes, StepMeta | None]:
    if len(body) < 2:
        raise DecodeError("update body shorter than its meta length")
    n = int.from_bytes(body[:2], "little")
    if n > MAX_META_BYTES or 2 + n > len(body):
        raise DecodeError(f"meta length {n} out of range")
    meta: StepMeta | None = None
    if n:
        try:
            fields = msgpack.unpackb(
                body[2 : 2 + n],
                max_str_len=64,
                max_bin_len=0,
                max_array_len=0,
                max_map_len=MAX_META_KEYS,
                max_ext_len=0,
                raw=False,
            )
        except Exception as exc:  # msgpack raises several types for bad input; all mean the same here
            raise DecodeError(f"bad meta: {exc}") from None
        meta = StepMeta.from_wire(fields)  # DecodeError naming the entry that is wrong
    return body[2 + n :], meta


# --- control bodies -----------------------------------------------------------------------------------


def _pack(fields: object) -> bytes:
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


# Any: the fields are msgpack values of unchecked types; decode_control hands them to the message
# constructors, which check every field's type and range (events.py) and raise what becomes DecodeError.
def _unpack(body: bytes) -> list[Any]:
    try:
        obj = msgpack.unpackb(
            body,
            max_str_len=400,
            max_bin_len=0,
            max_array_len=ev.MAX_NAK_ITEMS * 2,
            max_map_len=0,
            max_ext_len=0,
            raw=False,
            strict_map_key=True,
        )
    except Exception as exc:  # msgpack raises ValueError/ExtraData/FormatError/StackError...
        raise DecodeError(f"bad control body: {exc}") from None
    if not isinstance(obj, list):
        raise DecodeError("control body is not a list")
    return obj


def _same(value: Any) -> Any:
    return value


def _ints(obj: object, name: str) -> tuple[int, ...]:
    if not isinstance(obj, list) or not all(type(x) is int for x in obj):
        raise DecodeError(f"{name} must be a list of ints")
    return tuple(obj)


class _Field(NamedTuple):
    """One field of a control message: its attribute, how it goes into the msgpack list and how it comes
    back out (the message's constructor then checks its type and range, events.py)."""

    name: str
    encode: Callable[[Any], object] = _same
    decode: Callable[[Any], Any] = _same


def _int_list(name: str) -> _Field:
    return _Field(name, list, lambda v: _ints(v, name))


def _records(name: str, what: str, make: Callable[..., object], fields: tuple[_Field, ...]) -> _Field:
    """A list of small records (NAK items, ended ranks), each a msgpack list of ``fields``."""

    def encode(records: Any) -> list[list[object]]:
        return [[f.encode(getattr(r, f.name)) for f in fields] for r in records]

    def decode(obj: Any) -> tuple[object, ...]:
        if not isinstance(obj, list):
            raise DecodeError(f"{name} is not a list")
        out = []
        for entry in obj:
            if not isinstance(entry, list):
                raise DecodeError(f"{what} is not a list")
            if len(entry) != len(fields):
                raise DecodeError(f"{what} has {len(entry)} fields, expected {len(fields)}")
            out.append(make(*(f.decode(v) for f, v in zip(fields, entry))))
        return tuple(out)

    return _Field(name, encode, decode)


def _decode_notes(obj: Any) -> tuple[tuple[Any, ...], ...]:
    if not isinstance(obj, list) or not all(isinstance(x, list) for x in obj):
        raise DecodeError("WELCOME notes must be a list of [name, value] pairs")
    return tuple(tuple(x) for x in obj)


def _decode_bool(obj: Any) -> bool:
    if not isinstance(obj, bool):
        raise DecodeError("gone is not a bool")
    return obj


def _decode_range(obj: Any) -> tuple[int, int]:
    a, b = _ints(obj, "range")
    return a, b


class _Spec(NamedTuple):
    """How a control message travels: its kind and its fields, in order. ``flat``: the message's one field
    is the whole msgpack list (ACK's steps, NAK's items) instead of its only element."""

    kind: int
    make: Callable[..., ev.ControlMessage]
    fields: tuple[_Field, ...] = ()
    flat: bool = False


# Every control message's fields, in wire order: encode_control and decode_control are derived from this
# table (the bytes are those of the hand-written codecs it replaced).
_CONTROL: tuple[tuple[type, _Spec], ...] = (
    (ev.Join, _Spec(Kind.JOIN, ev.Join, (_Field("n_params"), _Field("world_size")))),
    (
        ev.Welcome,
        _Spec(
            Kind.WELCOME,
            ev.Welcome,
            (
                _Field("n_params"),
                _Field("world_size"),
                _Field("start_step"),
                _Field("complete_through"),
                _Field("notes", lambda notes: [list(n) for n in notes], _decode_notes),
                _Field("aggregate"),
            ),
        ),
    ),
    (ev.Reject, _Spec(Kind.REJECT, ev.Reject, (_Field("reason"),))),
    (ev.Ack, _Spec(Kind.ACK, ev.Ack, (_int_list("steps"),), flat=True)),
    (
        ev.Nak,
        _Spec(
            Kind.NAK,
            ev.Nak,
            (_records("items", "NAK item", ev.NakItem, (_Field("step"), _Field("origin"), _int_list("chunks"))),),
            flat=True,
        ),
    ),
    (
        ev.Heartbeat,
        _Spec(Kind.HEARTBEAT, ev.Heartbeat, (_Field("delivered_through"), _Field("sent_through"), _Field("computing"))),
    ),
    (
        ev.Status,
        _Spec(
            Kind.STATUS,
            ev.Status,
            (
                _Field("start_step"),
                _Field("complete_through"),
                _Field("world_size"),
                _Field("first_rank"),
                _int_list("have"),
                _records(
                    "ended",
                    "ended entry",
                    ev.Ended,
                    (_Field("rank"), _Field("last_step"), _Field("gone", decode=_decode_bool)),
                ),
            ),
        ),
    ),
    (ev.Finished, _Spec(Kind.FINISHED, ev.Finished, (_Field("last_step"),))),
    (ev.Leave, _Spec(Kind.LEAVE, ev.Leave)),
    (ev.SnapRequest, _Spec(Kind.SNAP_REQUEST, ev.SnapRequest)),
    (
        ev.SnapInfo,
        _Spec(
            Kind.SNAP_INFO,
            ev.SnapInfo,
            (
                _Field("snap_id"),
                _Field("step"),
                _Field("n_params"),
                _Field("n_chunks"),
                _Field("chunk_bytes"),
                _Field("digest"),
            ),
        ),
    ),
    (
        ev.SnapNak,
        _Spec(
            Kind.SNAP_NAK,
            ev.SnapNak,
            (
                _Field("snap_id"),
                _Field(
                    "ranges",
                    lambda ranges: [list(r) for r in ranges],
                    lambda obj: _list_of(obj, "ranges", _decode_range),
                ),
            ),
        ),
    ),
    (ev.SnapDone, _Spec(Kind.SNAP_DONE, ev.SnapDone, (_Field("snap_id"),))),
    (
        ev.Fail,
        _Spec(
            Kind.FAIL,
            ev.Fail,
            tuple(
                _Field(name)
                for name in ("rank", "attempt", "error_type", "message", "step", "fatal", "error_class", "cause")
            ),
        ),
    ),
    (ev.FailAck, _Spec(Kind.FAIL_ACK, ev.FailAck, (_Field("rank"), _Field("attempt")))),
    (ev.Loading, _Spec(Kind.LOADING, ev.Loading)),
)
_BY_TYPE: dict[type, _Spec] = dict(_CONTROL)
_BY_KIND: dict[int, _Spec] = {spec.kind: spec for _, spec in _CONTROL}
_KIND_NAMES: dict[int, str] = {value: name for name, value in vars(Kind).items() if type(value) is int}


def _list_of(obj: Any, name: str, decode: Callable[[Any], Any]) -> tuple[Any, ...]:
    if not isinstance(obj, list):
        raise DecodeError(f"{name} is not a list")
    return tuple(decode(x) for x in obj)


def encode_control(msg: ev.ControlMessage) -> tuple[int, bytes]:
    """(kind, body bytes) for a control message."""
    spec = _BY_TYPE.get(type(msg))
    if spec is None:
        raise TypeError(f"not a control message: {type(msg).__name__}")
    values = [f.encode(getattr(msg, f.name)) for f in spec.fields]
    return spec.kind, _pack(values[0] if spec.flat else values)


def decode_control(kind: int, body: bytes) -> ev.ControlMessage:
    """The validated control message of ``kind`` in ``body``; DecodeError on anything else."""
    f = _unpack(body)
    spec = _BY_KIND.get(kind)
    if spec is None or kind in CHUNKED_KINDS:
        raise DecodeError(f"kind {kind} has no control body")
    values = [f] if spec.flat else f
    if len(values) != len(spec.fields):
        raise DecodeError(
            f"bad kind-{kind} body: {_KIND_NAMES[kind]} has {len(values)} fields, expected {len(spec.fields)}"
        )
    try:
        return spec.make(*(field.decode(v) for field, v in zip(spec.fields, values)))
    except DecodeError:
        raise
    except (ValueError, TypeError) as exc:  # a constructor's type or range check
        raise DecodeError(f"bad kind-{kind} body: {exc}") from None
