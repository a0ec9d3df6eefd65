"""The in-job relay's status channel, sans I/O (transport/protocol/status_wire.py): a status sealed under the
job's key opens to the same record; another job, another key, a replay, an older status, a flipped byte
or a malformed body is dropped and counted; a status too big for a datagram loses its ranks' summaries,
not its step."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.crypto import new_job_key
from gradshare.transport.protocol.status_wire import (
    HEADER,
    MAX_STATUS_BYTES,
    Status,
    StatusOpener,
    StatusSealer,
    status_key,
)

KEY = new_job_key()
FAIL = ev.Fail(
    rank=1,
    attempt=3,
    error_type="RuntimeError",
    message="boom",
    step=7,
    fatal=True,
    error_class="TrainingError",
    cause="",
)
INCIDENT = ev.Incident(kind="silent", rank=1, attempt=3, step=9, seconds=61.0, at=100.0, detail="")


def status(**kw):
    progress = {
        "complete_through": 41,
        "attempt": 3,
        "ranks": {0: {"meta": {"loss": 0.5, "tau": 1e-3}}, 1: {"meta": None}},
    }
    return Status(progress=kw.pop("progress", progress), **kw)


def test_a_status_opens_to_the_same_record_fail_and_incidents_included():
    sealer, opener = StatusSealer(KEY, 77), StatusOpener(KEY, 77)
    sent = status(
        failure=FAIL, reported=FAIL, first_cause=INCIDENT, fatal=INCIDENT, epochs=((0, 2.25, 0.5), (1, 1.5, None))
    )
    got = opener.open(sealer.seal(sent))
    assert got == sent and opener.dropped == 0


@pytest.mark.parametrize("change", ["job", "key", "insecure reader", "flipped byte", "truncated"])
def test_a_status_not_of_this_job_or_altered_is_dropped(change):
    data = StatusSealer(KEY, 77).seal(status())
    opener = StatusOpener(
        new_job_key() if change == "key" else KEY, 78 if change == "job" else 77, insecure=change == "insecure reader"
    )
    if change == "flipped byte":
        data = data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
    if change == "truncated":
        data = data[: HEADER.size + 2]
    assert opener.open(data) is None and opener.dropped == 1


def test_a_replayed_or_older_status_is_dropped_and_a_new_sender_session_is_taken():
    sealer, opener = StatusSealer(KEY, 5), StatusOpener(KEY, 5)
    first, second = sealer.seal(status()), sealer.seal(status(progress={"complete_through": 50, "attempt": 3}))
    assert opener.open(second).progress["complete_through"] == 50
    assert opener.open(first) is None and opener.open(second) is None and opener.dropped == 2
    # a restarted relay host draws a new session: its counter starts again and is taken
    assert opener.open(StatusSealer(KEY, 5).seal(status())) is not None


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"p": []},
        {"p": {}, "f": {"rank": "x"}},
        {"p": {}, "x": 3},
        {"p": {}, "f": {"no_such_field": 1}},
        {"p": {}, "e": [[0, 1.0]]},
        {"p": {}, "e": [["0", 1.0, None]]},
        {"p": {}, "e": [[0, 1.0, None]] * 65},
    ],
)
def test_a_malformed_body_is_dropped_not_raised(body, monkeypatch):
    sealer, opener = StatusSealer(None, 9, insecure=True), StatusOpener(None, 9, insecure=True)
    # seal the raw body as the channel would (insecure: no key, the body in the clear)
    real = msgpack.packb
    monkeypatch.setattr(msgpack, "packb", lambda *_a, **_k: real(body))
    data = sealer.seal(status())
    monkeypatch.setattr(msgpack, "packb", real)
    assert opener.open(data) is None and opener.dropped == 1


def test_a_status_too_big_for_a_datagram_keeps_the_step_and_drops_the_ranks():
    ranks = {
        r: {"meta": {"loss": 1.0, "sparsity": 1e-3, "tau": 1e-3, "bytes": 1e3, "note": "x" * 200}} for r in range(512)
    }
    data = StatusSealer(KEY, 1).seal(status(progress={"complete_through": 3, "attempt": 0, "ranks": ranks}))
    assert len(data) < MAX_STATUS_BYTES + 64
    got = StatusOpener(KEY, 1).open(data)
    assert got.progress == {"complete_through": 3, "attempt": 0}


def test_the_status_key_is_not_the_job_key():
    derived = status_key(KEY, False)
    assert len(derived) == len(KEY) and derived != KEY and status_key(KEY, True) is None


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise(data):
    opener = StatusOpener(KEY, 77)
    assert opener.open(data) is None
