"""Relay and Peer over real loopback sockets (relays on port 0)."""

from __future__ import annotations

import socket
import threading
import time
import weakref

import numpy as np
import pytest

from gradshare.errors import GradshareError, LocalProtocolError, ProtocolError, TransportTimeout
from gradshare.transport import Peer, Relay, RelayTuning, new_job_key, param_hash
from gradshare.transport.protocol.step_meta import StepMeta
from transport_util import TOY, N, exchange, random_update, toy_apply_payload, wait_until


def test_exchange_is_exactly_once_and_bit_identical():
    key = new_job_key()
    with Relay(np.zeros(N, np.float32), 3, key, 9, port=0, bind="127.0.0.1", **TOY) as relay:
        params, logs, expected, _ = exchange(relay, key, 3, 30, np.random.default_rng(1))
        for r in range(3):
            assert logs[r] == expected
            assert param_hash(params[r]) == relay.param_hash()
        assert relay.complete_through == 29
        c = relay.counters()
        assert c["applied"] == 90 and c["updates_in"] == 90
        # nothing refused; on a loaded machine a late chunk may be NAKed and then arrive twice, which
        # is counted as a duplicate (and applied once, as the logs above show)
        assert set(c["drops"]) <= {"duplicate", "duplicate_chunk"}, c["drops"]
        prog = relay.progress()
        assert prog["ranks"][1]["meta"]["loss"] == pytest.approx(1 / 30)  # StepMeta.to_wire(): a plain map


def test_relay_port_in_use_names_the_port():
    key = new_job_key()
    with Relay(np.zeros(4, np.float32), 1, key, 1, port=0, bind="127.0.0.1") as relay:
        port = relay.address[1]
        with pytest.raises(OSError, match=str(port)):
            Relay(np.zeros(4, np.float32), 1, key, 1, port=port, bind="127.0.0.1").start()


def test_unreachable_relay_names_the_address_within_timeout():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    before = threading.active_count()
    with Peer(("127.0.0.1", port), 0, 1, 0, new_job_key(), 1, 10, timeout=5) as peer:
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match=f"127.0.0.1:{port}"):
            peer.join(timeout=0.5)
        assert time.monotonic() - t0 < 2.0
    assert threading.active_count() == before


def test_rank_outside_world_and_wrong_size_are_rejected_with_reason():
    key = new_job_key()
    with Relay(np.zeros(10, np.float32), 2, key, 3, port=0, bind="127.0.0.1") as relay:
        with Peer(relay.address, 1, 3, 0, key, 3, 10, timeout=5) as p:
            with pytest.raises(ProtocolError, match="world_size 3 does not match"):
                p.join(3)
        with Peer(relay.address, 0, 2, 0, key, 3, 11, timeout=5) as p:
            with pytest.raises(ProtocolError, match="n_params 11"):
                p.join(3)
        with pytest.raises(ValueError, match="rank"):
            Peer(relay.address, 2, 2, 0, key, 3, 10)
        with Peer(relay.address, 0, 2, 0, new_job_key(), 3, 10, timeout=5) as p:  # wrong key: silence
            with pytest.raises(TransportTimeout):
                p.join(0.5)
        assert relay.counters()["drops"]["auth_failed"] >= 1


def test_no_threads_or_sockets_leak_after_close_and_errors():
    import os

    def fds():
        return len(os.listdir("/proc/self/fd"))

    key = new_job_key()
    before_t, before_fd = threading.active_count(), fds()
    for _ in range(3):
        relay = Relay(np.zeros(10, np.float32), 1, key, 3, port=0, bind="127.0.0.1").start()
        p = Peer(relay.address, 0, 1, 0, key, 3, 10, timeout=5)
        p.join(3)
        with pytest.raises(LocalProtocolError, match="must send step 0 next"):
            p.send_update(5, b"")  # wrong step: our misuse, not the wire's
        p.close()
        p.close()  # idempotent
        relay.close()
    with pytest.raises(OSError):
        with Relay(np.zeros(10, np.float32), 1, key, 3, port=0, bind="203.0.113.7"):  # not local
            pass
    assert threading.active_count() == before_t
    assert fds() == before_fd


class _Node:
    next: object = None


def test_full_collections_skip_what_existed_while_a_relay_or_peer_runs_and_resume_after():
    # quiet_gc.py: the objects tracked when the first shell starts are frozen (a full collection would
    # scan them with the GIL held, 35-115 ms), objects made later are still collected, and the last shell
    # to close thaws, including after a failed start
    import gc

    from gradshare.transport.sockets import quiet_gc

    assert quiet_gc.holders() == 0 and gc.get_freeze_count() == 0  # no earlier test leaked a hold
    old = [[] for _ in range(1000)]
    key = new_job_key()
    with Relay(np.zeros(10, np.float32), 1, key, 3, port=0, bind="127.0.0.1") as relay:
        frozen = gc.get_freeze_count()
        assert frozen >= len(old) and quiet_gc.holders() == 1
        new = [[] for _ in range(1000)]  # made after the freeze: a second freeze would take them too
        p = Peer(relay.address, 0, 1, 0, key, 3, 10, timeout=5)
        p.join(3)
        assert quiet_gc.holders() == 2 and 0 < gc.get_freeze_count() < frozen + len(new)  # frozen once
        cycle = _Node()
        cycle.next = cycle  # garbage made while frozen is still collected
        alive = weakref.ref(cycle)
        del cycle
        assert gc.collect() >= 1 and alive() is None
        p.close()
        p.close()  # idempotent: releases once
        assert quiet_gc.holders() == 1 and 0 < gc.get_freeze_count() < frozen + len(new)
    assert quiet_gc.holders() == 0 and gc.get_freeze_count() == 0
    with pytest.raises(OSError):
        Relay(np.zeros(10, np.float32), 1, key, 3, port=0, bind="203.0.113.7").start()  # not local
    assert quiet_gc.holders() == 0
    with pytest.raises(RuntimeError, match="without a hold"):
        quiet_gc.release()
    del old


def test_fetch_snapshot_refuses_a_wrong_buffer_before_asking():
    key = new_job_key()
    with Relay(np.arange(10, dtype=np.float32), 1, key, 3, port=0, bind="127.0.0.1") as relay:
        with Peer(relay.address, 0, 1, 0, key, 3, 10, timeout=5) as p:
            p.join(3)
            with pytest.raises(ValueError, match=r"into must be .* float32 array of shape \(10,\)"):
                p.fetch_snapshot(3, into=np.zeros(9, np.float32))
            assert relay.counters().get("snapshots", 0) == 0
            into = np.zeros(10, np.float32)
            step, values = p.fetch_snapshot(3, into=into)
            assert values is into and values.tolist() == list(range(10)) and step == -1


def test_real_encoding_messages_make_bit_identical_replicas():
    """The default relay codec is gradshare.encoding: workers encode, everyone applies the same log."""
    from gradshare.encoding import Message, apply, encode

    n, W, steps = 20_000, 2, 12
    key = new_job_key()
    p0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    with Relay(p0, W, key, "job-enc", port=0, bind="127.0.0.1") as relay:
        peers = [Peer(relay.address, r, W, 0, key, "job-enc", n, timeout=10) for r in range(W)]
        try:
            for p in peers:
                assert p.join(5).start_step == 0
            params = [p0.copy() for _ in range(W)]
            residual = [np.zeros(n, np.float32) for _ in range(W)]
            rng = np.random.default_rng(1)
            for t in range(steps):
                for r, p in enumerate(peers):
                    m = encode(residual[r], (rng.standard_normal(n) * 0.01).astype(np.float32), 0.02)
                    p.send_update(t, m.to_bytes(), StepMeta(sparsity=m.n_entries / n))
                for r, p in enumerate(peers):
                    for u in p.receive(until_step=t, timeout=10):
                        apply(Message.from_bytes(u.payload, max_params=n), params[r])
            for p in peers:
                p.finish(steps - 1)
            relay.wait_finished(10)
            assert relay.complete_through == steps - 1
            assert param_hash(params[0]) == param_hash(params[1]) == relay.param_hash()
            assert not np.array_equal(relay.params, p0)
            assert relay.running
            with pytest.raises(GradshareError, match="closed relay"):
                relay.take_params()  # still serving: it would pull the array from under the I/O thread
            relay.close()
            assert not relay.running
            final = relay.take_params()  # the fit's end: the array itself, bit-identical, no copy kept
            assert param_hash(final) == param_hash(params[0])
            assert relay.take_params().size == 0
        finally:
            for p in peers:
                p.close()


def test_silent_peer_is_declared_gone_over_sockets():
    key = new_job_key()
    with Relay(
        np.zeros(N, np.float32),
        2,
        key,
        4,
        port=0,
        bind="127.0.0.1",
        tuning=RelayTuning(liveness_timeout=0.5, on_rank_loss="continue"),
        **TOY,
    ) as relay:
        a = Peer(relay.address, 0, 2, 0, key, 4, N, timeout=10)
        b = Peer(relay.address, 1, 2, 0, key, 4, N, timeout=10)
        try:
            a.join(5)
            b.join(5)
            a.send_update(0, random_update(np.random.default_rng(0), N, 4))
            b.send_update(0, random_update(np.random.default_rng(1), N, 4))
            assert [(u.step, u.sender) for u in a.receive(until_step=0, timeout=5)] == [(0, 0), (0, 1)]
            b.close(leave=False)  # rank 1's process hangs: no heartbeat, no FINISHED
            a.send_update(1, random_update(np.random.default_rng(2), N, 4))
            t0 = time.monotonic()
            got = a.receive(until_step=1, timeout=5)  # completes once rank 1 is cut at step 0
            assert [(u.step, u.sender) for u in got] == [(1, 0)]
            assert 0.4 < time.monotonic() - t0 < 3.0
            ended = relay.progress()["ranks"][1]["ended"]
            assert ended == {"last_step": 0, "gone": True}
            a.finish(1)
            relay.wait_finished(5)
            assert relay.complete_through == 1 and relay.counters()["gone"] == 1
        finally:
            a.close()
            b.close()


def test_receive_timeout_names_the_missing_update_and_wait():
    key = new_job_key()
    with Relay(np.zeros(N, np.float32), 2, key, 4, port=0, bind="127.0.0.1", **TOY) as relay:
        with (
            Peer(relay.address, 0, 2, 0, key, 4, N, timeout=10) as a,
            Peer(relay.address, 1, 2, 0, key, 4, N, timeout=10) as b,
        ):
            a.join(5)
            b.join(5)
            a.send_update(0, random_update(np.random.default_rng(0), N, 4))
            with pytest.raises(TransportTimeout, match=r"step 0, sender 1"):
                a.receive(until_step=0, timeout=0.3)
            assert b.wait(2)  # (0, 0) is first in canonical order: deliverable at b
            assert [(u.step, u.sender) for u in b.receive()] == [(0, 0)]
            assert not b.wait(0.05)
            b.send_update(0, random_update(np.random.default_rng(1), N, 4))
            assert b.wait(2)  # its own update is next
            assert [(u.step, u.sender) for u in b.receive()] == [(0, 1)]


def test_relay_command_line(tmp_path, capsys):
    from gradshare.cli import main

    key_path = tmp_path / "job.key"
    assert (
        main(
            [
                "relay",
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--world-size",
                "2",
                "--n-params",
                "10",
                "--new-key",
                str(key_path),
                "--duration",
                "0.3",
            ]
        )
        == 0
    )
    assert len(bytes.fromhex(key_path.read_text())) == 32
    assert (key_path.stat().st_mode & 0o777) == 0o600
    out = capsys.readouterr().out
    assert "relay listening on 127.0.0.1:" in out
    with pytest.raises(SystemExit, match="key"):
        main(["relay", "--port", "0", "--bind", "127.0.0.1", "--world-size", "2", "--n-params", "10"])


def test_fetch_snapshot_again_in_one_session():
    """Each fetch gets the parameters through the step the relay holds now (the second one used to wait
    for its timeout at "0/N chunks": the first download's SNAP_DONE reached the relay after it)."""
    key = new_job_key()
    rng = np.random.default_rng(6)
    n = 200_000  # several hundred chunks: the last one is the race
    with Relay(rng.standard_normal(n).astype(np.float32), 1, key, 8, port=0, bind="127.0.0.1", **TOY) as relay:
        with Peer(relay.address, 0, 1, 0, key, 8, n, timeout=10) as p:
            p.join(5)
            for t in (-1, -1, 0, 1):  # back to back first: the closest race
                if t >= 0:
                    p.send_update(t, random_update(rng, n, 30))
                    p.receive(until_step=t, timeout=5)
                step, snap = p.fetch_snapshot(5)
                assert step == t and param_hash(snap) == relay.param_hash()


def test_retried_stage_resumes_from_snapshot_over_sockets():
    """Attempt 0 dies after step 3 (rank 1 never sends step 4); attempt 1 cuts (4, 0) and resumes at 4
    from a snapshot of the parameters through step 3."""
    key = new_job_key()
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(N).astype(np.float32)
    with Relay(p0, 2, key, 8, port=0, bind="127.0.0.1", **TOY) as relay:
        old = [Peer(relay.address, r, 2, 0, key, 8, N, timeout=10) for r in range(2)]
        try:
            for p in old:
                p.join(5)
            for t in range(4):
                for p in old:
                    p.send_update(t, random_update(rng, N, 30))
            old[0].send_update(4, random_update(rng, N, 30))
            old[0].receive(until_step=3, timeout=5)
            # (4, 0) received and held: rank 0 has step 4, the log is complete through 3
            wait_until(
                lambda: relay.complete_through == 3 and relay.progress()["ranks"][0]["have"] == 4,
                5,
                "steps 0..3 applied and (4, 0) pending",
            )
        finally:
            for p in old:
                p.close(leave=False)  # killed tasks: no FINISHED, no LEAVE
        new = [Peer(relay.address, r, 2, 1, key, 8, N, timeout=10) for r in range(2)]
        try:
            params = []
            for p in new:
                assert p.join(5).start_step == 4
                step, snap = p.fetch_snapshot(10)
                assert step == 3 and param_hash(snap) == relay.param_hash()
                params.append(snap)
            for t in range(4, 7):
                for p in new:
                    p.send_update(t, random_update(rng, N, 30))
            for p in new:
                p.finish(6)
            for r, p in enumerate(new):
                got = p.receive(until_step=6, timeout=10)
                assert [(u.step, u.sender) for u in got] == [(t, s) for t in range(4, 7) for s in range(2)]
                for u in got:
                    toy_apply_payload(u.payload, params[r])
            relay.wait_finished(10)
            assert param_hash(params[0]) == param_hash(params[1]) == relay.param_hash()
            assert relay.counters()["attempt"] == 1 and relay.complete_through == 6
        finally:
            for p in new:
                p.close()
