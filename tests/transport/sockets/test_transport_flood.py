"""10^5 random and forged datagrams at the relay's port during a real exchange: nothing forged is applied,
nothing crashes, and every genuine update is still delivered exactly once."""

from __future__ import annotations

import numpy as np

from flood import FLOOD, flooded
from gradshare.transport import Peer, Relay, new_job_key, param_hash
from transport_util import TOY, N, exchange, toy_encode, wait_until


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

        (params, logs, expected, _), sent, overflowed = flooded(
            relay, key, lambda: exchange(relay, key, W, 150, np.random.default_rng(7), world_size=W + 1)
        )
        assert sent == FLOOD
        c = relay.counters()
        assert c["applied"] == len(expected) and c["updates_in"] == len(expected)
        for r in range(W):
            assert logs[r] == expected
            assert param_hash(params[r]) == relay.param_hash()
        drops = c["drops"]
        for reason in ("malformed", "auth_failed", "wrong_job", "oversized", "replayed", "not_joined"):
            assert drops.get(reason, 0) > 0, (reason, drops)
        assert drops.get("bad_update", 0) == 1  # the insider's one update
        # each forged datagram dropped by the relay with its reason, or by the kernel in a full receive buffer
        # when the relay reads more slowly than the flood comes (a loaded host: how the two split is its speed)
        assert sum(drops.values()) + overflowed >= FLOOD * 0.9, (drops, overflowed)
