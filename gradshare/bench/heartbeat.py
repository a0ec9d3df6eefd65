"""An idle job's control traffic at the relay (heartbeats in, STATUS pages out) per second, for
`gradshare bench scale`: the protocol cores over an in-memory link with a simulated clock."""

from __future__ import annotations

import time
from typing import Any

from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE
from gradshare.transport.testing.memory import joined_cores


def heartbeat_traffic(
    n_peers: int, seconds: float = 1.0, tick: float = 0.005, datagram_size: int = DEFAULT_DATAGRAM_SIZE
) -> dict[str, Any]:
    """Idle-job control traffic at the relay: every peer's heartbeats in, STATUS pages out, per second.

    Runs the cores over a perfect in-memory link with a simulated clock (no sockets, so it measures the
    protocol, not the machine): ``seconds`` of simulated time in steps of ``tick``."""
    relay, peers = joined_cores(n_peers, 1000, b"\x02" * 32, 1, datagram_size=datagram_size)
    relay.datagrams_to_send()
    counts = {"in_datagrams": 0, "in_bytes": 0, "out_datagrams": 0, "out_bytes": 0}
    cpu = 0.0
    steps = int(round(seconds / tick))
    for i in range(1, steps + 1):
        now = i * tick
        for r, p in enumerate(peers):
            p.handle_timer(now)
            for d in p.datagrams_to_send():
                counts["in_datagrams"] += 1
                counts["in_bytes"] += len(d)
                c = time.thread_time()
                relay.receive_datagram(d, r, now)
                cpu += time.thread_time() - c
        c = time.thread_time()
        if now >= relay.next_timer():
            relay.handle_timer(now)
        out = relay.datagrams_to_send()
        cpu += time.thread_time() - c
        for d, to in out:
            counts["out_datagrams"] += 1
            counts["out_bytes"] += len(d)
            assert isinstance(to, int)  # joined_cores addresses each peer by its rank
            peers[to].receive_datagram(d, "relay", now)
    errors = [p.io.error for p in peers if p.io.error]
    if errors:
        raise RuntimeError(f"heartbeat run with {n_peers} peers: {errors[0]}")
    per_s = {k + "_per_s": v / seconds for k, v in counts.items()}
    return {
        "peers": n_peers,
        **per_s,
        "relay_cpu_per_s": cpu / seconds,
        "out_bytes_per_peer_per_s": counts["out_bytes"] / seconds / n_peers,
        "max_datagram": max(1, datagram_size),
    }


__all__ = ["heartbeat_traffic"]
