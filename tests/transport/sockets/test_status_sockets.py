"""The status channel's sockets on loopback (transport/sockets/status.py): the sender's pushes reach the
inbox, which answers the reads the driver makes of a relay; the final status goes out on close; another
job's pushes to the same inbox are dropped."""

import time

import pytest

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.crypto import new_job_key
from gradshare.transport.protocol.status_wire import Status
from gradshare.transport.sockets.status import StatusInbox, StatusSender

pytestmark = pytest.mark.sockets


def wait_until(check, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_pushes_reach_the_inbox_and_the_last_one_goes_out_on_close():
    key = new_job_key()
    state = {"step": 0, "fail": None}

    def read():
        return Status(progress={"complete_through": state["step"], "attempt": 4}, failure=state["fail"])

    inbox = StatusInbox(key, 11, bind="127.0.0.1")
    assert inbox.progress() == {} and inbox.failure() is None  # nothing heard yet: a relay that heard nothing
    sender = StatusSender(read, ("127.0.0.1", inbox.address[1]), key, 11, interval=0.02)
    try:
        state["step"] = 5
        assert wait_until(lambda: inbox.progress().get("complete_through") == 5)
        state["fail"] = ev.Fail(rank=1, attempt=4, error_type="ValueError", message="bad row", step=2)
        assert wait_until(lambda: inbox.failure() is not None)
        assert inbox.failure().message == "bad row" and inbox.fatal_incident() is None
    finally:
        state["step"] = 9
        sender.close()  # sends the final status at once
    assert wait_until(lambda: inbox.progress().get("complete_through") == 9)
    assert sender.sent >= 3 and inbox.received >= 3 and inbox.dropped == 0
    inbox.close()


def test_another_jobs_pushes_are_dropped():
    key = new_job_key()
    inbox = StatusInbox(key, 11, bind="127.0.0.1")
    try:
        other = StatusSender(
            lambda: Status(progress={"complete_through": 1}), ("127.0.0.1", inbox.address[1]), key, 12, interval=0.02
        )
        assert wait_until(lambda: inbox.dropped >= 2)
        other.close()
        assert inbox.received == 0 and inbox.progress() == {}
    finally:
        inbox.close()


def test_the_relay_knows_when_every_rank_has_left_and_says_so_within_its_timeout():
    """What rank 0's task waits for before its relay goes with it: every peer's LEAVE (after FINISHED and
    its last acknowledgements); a rank that vanished without one makes the wait end at its timeout."""
    import numpy as np

    from gradshare.transport import Peer, Relay
    from transport_util import TOY, N, exchange

    key = new_job_key()
    with Relay(np.zeros(N, np.float32), 2, key, 9, port=0, bind="127.0.0.1", **TOY) as relay:
        assert relay.wait_left(0.05) is False  # nobody joined, nobody left
        exchange(relay, key, 2, 5, np.random.default_rng(2))  # closes both peers: LEAVE
        assert relay.wait_left(5.0) is True
    with Relay(np.zeros(N, np.float32), 1, key, 9, port=0, bind="127.0.0.1", **TOY) as relay:
        peer = Peer(relay.address, 0, 1, 0, key, 9, N, timeout=10)
        peer.join(10)
        peer.close(linger=0.0, leave=False)  # vanishes, as a killed task
        t = time.monotonic()
        assert relay.wait_left(0.3) is False and 0.25 < time.monotonic() - t < 3.0


def test_a_status_that_cannot_be_read_is_counted_and_the_pushes_go_on():
    key = new_job_key()
    calls = {"n": 0}

    def read():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("relay closed")
        return Status(progress={"complete_through": calls["n"]})

    inbox = StatusInbox(key, 3, bind="127.0.0.1")
    sender = StatusSender(read, ("127.0.0.1", inbox.address[1]), key, 3, interval=0.02)
    try:
        assert wait_until(lambda: inbox.received >= 1)
        assert sender.failed >= 1 and sender.error == "RuntimeError: relay closed"
    finally:
        sender.close()
        inbox.close()
