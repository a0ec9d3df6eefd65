"""The flood of forged datagrams the transport tests aim at a relay: random bytes, wrong keys and jobs,
truncated, oversized, replayed and out-of-range updates (in memory and over sockets)."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

from gradshare.transport import new_job_key
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.sockets import udp
from transport_util import N, toy_encode

FLOOD = 100_000
RATE = 8_000  # datagrams/s: the whole flood takes ~12 s on the shared 2-core machine


def channel(key, sender, job=9, attempt=0, insecure=False):
    return Channel(
        key=key,
        insecure=insecure,
        job=job,
        sender=sender,
        attempt=attempt,
        datagram_size=1400,
        max_chunks=1 << 20,
        max_windows=1,
    )


def make_flood(key: bytes, captured: list, rng: random.Random, job: int = 9, n: int = N):
    """FLOOD forged datagrams for a job ``job`` of ``n`` parameters (``captured``: genuine ones to replay)."""
    wrong_key = channel(new_job_key(), 0, job=job)
    wrong_job = channel(key, 1, job=job + 1)
    stranger = channel(key, 2, job=job)  # right key, a session that never joined
    body = wire.encode_update_body(toy_encode(1.0, [1, 2]), None)
    kinds = ["random", "wrong_key", "wrong_job", "truncated", "oversized", "replayed", "stranger", "bad_indices"]
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
            yield d[: rng.randrange(len(d))]
        elif k == "oversized":
            yield wrong_key.seal(wire.Kind.UPDATE, os.urandom(1500), 0, 0, 0, 1)
        elif k == "replayed" and captured:
            yield rng.choice(captured)
        elif k == "stranger":
            yield stranger.seal(wire.Kind.UPDATE, body, 2, rng.randrange(50), rng.randrange(3), 3)
        else:
            idx = [rng.randrange(-2 * n, 2 * n) or 1 for _ in range(5)]
            yield stranger.seal(
                wire.Kind.UPDATE, wire.encode_update_body(toy_encode(1.0, idx), None), 2, rng.randrange(50), 0, 1
            )


def udp_overflows() -> int:
    """The host's UDP datagrams dropped so far because a socket's receive buffer was full (Linux's
    RcvbufErrors, /proc/net/snmp), every socket's: a relay that reads more slowly than the flood arrives
    loses the rest there, and how the flood splits between the two depends on the host's speed."""
    with open("/proc/net/snmp") as f:
        names, values = [line.split() for line in f if line.startswith("Udp:")][:2]
    return int(values[names.index("RcvbufErrors")])


def flooded(relay, key: bytes, run_exchange):
    """Run ``run_exchange()`` while a thread sends the FLOOD of forged datagrams (make_flood, with
    genuine ones the peers sent to replay) to the relay at RATE; returns its result, how many were sent,
    and how many datagrams the host dropped meanwhile in full receive buffers (`udp_overflows`)."""
    overflows = udp_overflows()
    captured: list[bytes] = []
    original = udp.send_all
    target = tuple(relay.address)

    def tap(sock, datagrams, drops):
        # what a peer sends the relay: each batch's first four, as the replays of the flood
        datagrams = list(datagrams)
        if len(captured) < 2000:
            captured.extend([d for d, addr in datagrams if tuple(addr) == target][:4])
        original(sock, datagrams, drops)

    udp.send_all = tap
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
        udp.send_all = original
        flooder.join(10 * FLOOD / RATE)  # ~12 s paced; a loaded host sends more slowly
        stop.set()
    return result, sent[0], udp_overflows() - overflows
