"""10^5 random and forged datagrams at the relay's port during a real exchange: nothing forged is applied,
nothing crashes, and every genuine update is still delivered exactly once."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import numpy as np

from gradshare.transport import Peer, Relay, new_job_key, param_hash
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from test_transport_sockets import N, exchange
from transport_util import TOY, toy_encode, wait_until

FLOOD = 100_000
RATE = 8_000           # datagrams/s: the whole flood takes ~12 s on the shared 2-core machine


def channel(key, sender, job=9, attempt=0, insecure=False):
    return Channel(key=key, insecure=insecure, job=job, sender=sender, attempt=attempt, datagram_size=1400,
                   max_chunks=1 << 20, max_windows=1)


def make_flood(key: bytes, captured: list, rng: random.Random, job: int = 9, n: int = N):
    """FLOOD forged datagrams for a job ``job`` of ``n`` parameters (``captured``: genuine ones to replay)."""
    wrong_key = channel(new_job_key(), 0, job=job)
    wrong_job = channel(key, 1, job=job + 1)
    stranger = channel(key, 2, job=job)                # right key, a session that never joined
    body = wire.encode_update_body(toy_encode(1.0, [1, 2]), None)
    kinds = ["random", "wrong_key", "wrong_job", "truncated", "oversized", "replayed", "stranger",
             "bad_indices"]
    for i in range(FLOOD):
        k = kinds[i % len(kinds)]
        if k == "random":
            yield os.urandom(rng.randrange(0, 1500))
        elif k == "wrong_key":
            yield wrong_key.seal(wire.Kind.UPDATE, body, 0, rng.randrange(50), 0, 1)
        elif k == "wrong_job":
            yield wrong_job.seal(wire.Kind.UPDATE, body, 1, rng.randrange(50), 0, 1)
        elif k == "truncated" and captured:
            d = rng.choice(captured)
            yield d[:rng.randrange(len(d))]
        elif k == "oversized":
            yield wrong_key.seal(wire.Kind.UPDATE, os.urandom(1500), 0, 0, 0, 1)
        elif k == "replayed" and captured:
            yield rng.choice(captured)
        elif k == "stranger":
            yield stranger.seal(wire.Kind.UPDATE, body, 2, rng.randrange(50), rng.randrange(3), 3)
        else:
            idx = [rng.randrange(-2 * n, 2 * n) or 1 for _ in range(5)]
            yield stranger.seal(wire.Kind.UPDATE, wire.encode_update_body(toy_encode(1.0, idx), None),
                                2, rng.randrange(50), 0, 1)


def flooded(relay, key: bytes, run_exchange):
    """Run ``run_exchange()`` while a thread sends the FLOOD of forged datagrams (make_flood, with
    genuine ones the peers sent to replay) to the relay at RATE; returns its result and how many were sent."""
    captured: list[bytes] = []
    original = Peer._send

    def tap(self, out):
        if len(captured) < 2000:
            captured.extend(out[:4])
        original(self, out)

    Peer._send = tap
    sent = [0]
    stop = threading.Event()

    def flood():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            rng = random.Random(4)
            t0 = time.monotonic()
            for i, d in enumerate(make_flood(key, captured, rng)):
                if stop.is_set():
                    break
                s.sendto(d, relay.address)
                sent[0] += 1
                if i % 100 == 0:
                    ahead = (i / RATE) - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        finally:
            s.close()

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        time.sleep(0.2)
        result = run_exchange()
    finally:
        Peer._send = original
        flooder.join(60)
        stop.set()
    return result, sent[0]


def test_flood_of_forged_datagrams_during_exchange():
    key = new_job_key()
    W = 3
    with Relay(np.zeros(N, np.float32), W + 1, key, 9, port=0, bind="127.0.0.1", **TOY) as relay:
        # rank W holds the key but sends an update with out-of-range indices: refused, never applied,
        # and the rank is cut so that the genuine ranks' log goes on
        with Peer(relay.address, W, W + 1, 0, key, 9, N, timeout=10) as insider:
            insider.join(5)
            insider.send_update(0, toy_encode(1.0, [N + 5, -(N + 9)]))
            wait_until(lambda: relay.progress()["ranks"][W]["ended"] is not None, 5, "insider declared gone")

        (params, logs, expected, _), sent = flooded(
            relay, key, lambda: exchange(relay, key, W, 150, np.random.default_rng(7), world_size=W + 1))
        assert sent == FLOOD
        c = relay.counters()
        assert c["applied"] == len(expected) and c["updates_in"] == len(expected)
        for r in range(W):
            assert logs[r] == expected
            assert param_hash(params[r]) == relay.param_hash()
        drops = c["drops"]
        for reason in ("malformed", "auth_failed", "wrong_job", "oversized", "replayed", "not_joined"):
            assert drops.get(reason, 0) > 0, (reason, drops)
        assert drops.get("bad_update", 0) == 1          # the insider's one update
        assert sum(drops.values()) > FLOOD * 0.5        # the rest may be lost in a full socket buffer

