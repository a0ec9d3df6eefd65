"""Real sockets through the fault proxy: loss, duplication and reordering never lose or repeat an update."""

from __future__ import annotations

import numpy as np
import pytest

from gradshare.transport import Peer, Relay, RelayTuning, new_job_key, param_hash
from gradshare.transport.testing.fault_proxy import FaultProxy
from transport_util import TOY, N, exchange


@pytest.mark.parametrize("loss", [0.01, 0.05, 0.20])
def test_exchange_through_lossy_proxy_is_exactly_once(loss):
    key = new_job_key()
    with (
        Relay(np.zeros(N, np.float32), 3, key, 9, port=0, bind="127.0.0.1", **TOY) as relay,
        FaultProxy(relay.address, loss=loss, duplicate=0.02, reorder=0.05, delay=0.002, seed=int(loss * 100)) as proxy,
    ):
        params, logs, expected, counters = exchange(relay, key, 3, 20, np.random.default_rng(2), address=proxy.address)
        for r in range(3):
            assert logs[r] == expected
            assert param_hash(params[r]) == relay.param_hash()
        c = relay.counters()
        assert c["applied"] == 60 and c["updates_in"] == 60
        assert proxy.stats["dropped"] > 0
        if loss >= 0.05:
            assert c["retransmits"] + sum(pc["retransmits"] for pc in counters) > 0


def test_snapshot_of_25m_params_through_5_percent_loss():
    n = 25_000_000
    key = new_job_key()
    p0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    with (
        Relay(
            p0, 1, key, 5, port=0, bind="127.0.0.1", datagram_size=8192, tuning=RelayTuning(snapshot_rate=150e6)
        ) as relay,
        FaultProxy(relay.address, loss=0.05, duplicate=0.01, reorder=0.01, delay=0.001, seed=5) as proxy,
    ):
        with Peer(proxy.address, 0, 1, 0, key, 5, n, datagram_size=8192, timeout=60) as peer:
            peer.join(10)
            step, params = peer.fetch_snapshot(120)
            assert step == -1
            assert param_hash(params) == param_hash(p0)
        assert proxy.stats["dropped"] > 100
