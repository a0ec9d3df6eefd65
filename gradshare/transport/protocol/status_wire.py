"""The relay's status, pushed to the fit's client when the relay runs inside the Spark job (relay="in-job").

The client cannot ask a relay it may not reach; the relay host sends it, about twice a second, what the
client-side relay would have told the driver: the progress (the log's step, each rank's latest step
summary), the first fatal FAIL, the FAIL the latest attempt reported, the first cause and the fatal
incident. A client behind NAT or a firewall simply hears nothing (docs/guide/connect.md).

One datagram per status: ``MAGIC, job id (u32), counter (u64)`` as the header, then the msgpack body
sealed with AES-GCM under a key derived from the job key (HKDF-SHA256, its own `info`), so its nonces
can never meet those of the relay's and peers' datagrams, which use the job key itself. The receiver
keeps only a status newer than the last it took (the counter), so a replayed or reordered one is dropped.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.crypto import KEY_BYTES, MAX_COUNTER, Sealer

MAGIC = b"GSST"
HEADER = struct.Struct("<4sIQ")  # magic, job id, counter
SESSION_SENDER = 0xFFFE  # the nonce's sender field: one sender, the relay host
MAX_STATUS_BYTES = 60_000  # one UDP datagram; ranks' summaries are dropped from a status that would exceed it
INFO = b"gradshare relay status v1"


def status_key(key: bytes | None, insecure: bool) -> bytes | None:
    """The status channel's own key, derived from the job key (None when insecure)."""
    if insecure:
        return None
    assert key is not None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=INFO).derive(bytes(key))


@dataclass(frozen=True)
class Status:
    """What the relay host says about the job (the reads `Relay` offers the driver, at one moment)."""

    progress: dict[str, Any]
    failure: ev.Fail | None = None  # the first fatal FAIL
    reported: ev.Fail | None = None  # the FAIL the latest attempt that reported any sent
    first_cause: ev.Incident | None = None
    fatal: ev.Incident | None = None
    # the last finished epochs of the applied log: (epoch, mean loss, rank 0's score or None)
    epochs: tuple[tuple[int, float, float | None], ...] = ()


def _record(obj: object) -> dict[str, Any] | None:
    return None if obj is None else dataclasses.asdict(obj)  # type: ignore[call-overload]


class StatusSealer:
    """The sending end: ``seal(status)`` -> one datagram, the counter advancing."""

    def __init__(self, key: bytes | None, job_id: int, insecure: bool = False) -> None:
        self.sealer = Sealer(status_key(key, insecure), insecure)
        self.job_id = job_id & 0xFFFFFFFF
        self.session = int.from_bytes(os.urandom(4), "little")
        self.counter = 0

    def seal(self, status: Status) -> bytes:
        body = {
            "p": status.progress,
            "f": _record(status.failure),
            "r": _record(status.reported),
            "c": _record(status.first_cause),
            "x": _record(status.fatal),
            "e": [list(e) for e in status.epochs],
        }
        data = msgpack.packb(body, use_bin_type=True)
        if len(data) > MAX_STATUS_BYTES:  # many ranks: the bar's summaries go, the step and attempt stay
            body["p"] = {k: v for k, v in status.progress.items() if k != "ranks"}
            data = msgpack.packb(body, use_bin_type=True)
        self.counter += 1
        if self.counter >= MAX_COUNTER:
            raise OverflowError("status counter exhausted")
        header = HEADER.pack(MAGIC, self.job_id, self.counter)
        return self.sealer.seal(
            header + self.session.to_bytes(4, "little"), SESSION_SENDER, self.session, self.counter, data
        )


class StatusOpener:
    """The receiving end: ``open(datagram)`` -> the Status, or None for anything not a newer status of
    this job (a wrong job, a failed tag, a replay, a malformed body); `dropped` counts those."""

    def __init__(self, key: bytes | None, job_id: int, insecure: bool = False) -> None:
        self.sealer = Sealer(status_key(key, insecure), insecure)
        self.job_id = job_id & 0xFFFFFFFF
        self.last: dict[int, int] = {}  # session -> the newest counter taken
        self.dropped = 0

    def open(self, data: bytes) -> Status | None:
        head = HEADER.size + 4
        if len(data) < head or len(data) > MAX_STATUS_BYTES + head + 64:
            self.dropped += 1
            return None
        magic, job, counter = HEADER.unpack_from(data)
        session = int.from_bytes(data[HEADER.size : head], "little")
        if magic != MAGIC or job != self.job_id or counter <= self.last.get(session, 0):
            self.dropped += 1
            return None
        body = self.sealer.open(data[:head], SESSION_SENDER, session, counter, data[head:])
        if body is None:
            self.dropped += 1
            return None
        try:
            status = _parse(msgpack.unpackb(body, raw=False, strict_map_key=False))
        except (ValueError, TypeError, KeyError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.dropped += 1
            return None
        if len(self.last) >= 16 and session not in self.last:  # a retried host draws a new session
            self.last.pop(next(iter(self.last)))
        self.last[session] = counter
        return status


def _parse(body: object) -> Status:
    if not isinstance(body, dict) or not isinstance(body.get("p"), dict):
        raise ValueError("a status body is a map with a progress map")
    return Status(
        progress=body["p"],
        failure=_record_of(ev.Fail, body.get("f")),
        reported=_record_of(ev.Fail, body.get("r")),
        first_cause=_record_of(ev.Incident, body.get("c")),
        fatal=_record_of(ev.Incident, body.get("x")),
        epochs=_epochs(body.get("e", [])),
    )


R = TypeVar("R", ev.Fail, ev.Incident)


def _record_of(cls: type[R], fields: object) -> R | None:
    """A FAIL or an incident from its map (None: none); its own checks refuse bad fields (TypeError,
    ValueError), as a missing or unknown field does."""
    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise ValueError(f"a {cls.__name__} record is a map")
    return cls(**fields)


def _epochs(rows: object) -> tuple[tuple[int, float, float | None], ...]:
    if not isinstance(rows, list) or len(rows) > 64:
        raise ValueError("a status's epochs are a list of at most 64 rows")
    out = []
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 3
            or not isinstance(row[0], int)
            or not isinstance(row[1], (int, float))
            or not isinstance(row[2], (int, float, type(None)))
        ):
            raise ValueError("an epoch row is [epoch, loss, score or None]")
        out.append((int(row[0]), float(row[1]), None if row[2] is None else float(row[2])))
    return tuple(out)
