"""32 peers over real loopback sockets: through the lossy,
duplicating, reordering fault proxy, in both forwarding modes, every update is delivered exactly once and
the replicas end bit-identical. The peers are threads of this process, several per core."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from aggregate_util import real_apply, real_payload
from flood import FLOOD, flooded
from gradshare.encoding import apply_update
from gradshare.transport import Relay, RelayTuning, new_job_key, param_hash
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN
from gradshare.transport.testing.fault_proxy import FaultProxy
from transport_util import TOY, N, exchange, random_update, toy_apply_payload

W = 32
STEPS = 5


def codec_for(mode: str) -> tuple[dict, dict]:
    """(relay options, exchange codec): aggregated, the relay re-encodes, so the real codec."""
    if mode == "aggregate":
        return dict(tuning=RelayTuning(forwarding=mode)), dict(make=real_payload, apply=real_apply)
    return dict(TOY), dict(make=random_update, apply=toy_apply_payload)


def check_replicas(relay, mode: str, steps: int, expected, logs, params) -> None:
    """Every rank delivered the log exactly once, in order (aggregated: one message a step), and its
    parameters equal the relay's bit for bit."""
    want = [(t, AGGREGATE_ORIGIN) for t in range(steps)] if mode == "aggregate" else expected
    for r in range(W):
        assert logs[r] == want, f"rank {r}"
        assert param_hash(params[r]) == relay.param_hash(), f"rank {r}"


# per rank the proxy (one Python thread) carries W·(W-1) forwards a step: 1 % loss keeps that case to
# ~10 s on the shared 2-core machine; the simulation (test_transport_n32.py) covers 1/5/20 % in both modes
@pytest.mark.parametrize("mode, loss", [("per-rank", 0.01), ("aggregate", 0.05)])
def test_32_peers_through_the_lossy_fault_proxy_are_exactly_once(mode, loss):
    key = new_job_key()
    options, codec = codec_for(mode)
    with (
        Relay(np.zeros(N, np.float32), W, key, 9, port=0, bind="127.0.0.1", **options) as relay,
        FaultProxy(relay.address, loss=loss, duplicate=0.02, reorder=0.05, delay=0.002, seed=32) as proxy,
    ):
        params, logs, expected, counters = exchange(
            relay, key, W, STEPS, np.random.default_rng(3), address=proxy.address, entries=(3, 100), wait=120.0, **codec
        )
        check_replicas(relay, mode, STEPS, expected, logs, params)
        c = relay.counters()
        assert c["updates_in"] == W * STEPS and c["applied"] == W * STEPS
        assert proxy.stats["dropped"] > 0
        assert c["retransmits"] + sum(pc["retransmits"] for pc in counters) > 0


@pytest.mark.parametrize("mode", ["per-rank", "aggregate"])
def test_a_flood_of_forged_datagrams_during_an_exchange_of_32_peers_over_sockets(mode):
    # the flood starts first and, paced at RATE, lasts ~12 s: longer than the whole exchange
    key = new_job_key()
    options, codec = codec_for(mode)
    with Relay(np.zeros(N, np.float32), W, key, 9, port=0, bind="127.0.0.1", **options) as relay:
        (params, logs, expected, _), sent, overflowed = flooded(
            relay,
            key,
            # wait: what a peer waits for a step before the exchange fails; a loaded host's relay, reading the
            # flood too, may take many seconds over a step, which this test does not time
            lambda: exchange(relay, key, W, 20, np.random.default_rng(7), entries=(3, 100), wait=120.0, **codec),
        )
        assert sent == FLOOD
        check_replicas(relay, mode, 20, expected, logs, params)
        c = relay.counters()
        assert c["updates_in"] == W * 20 and c["applied"] == W * 20
        drops = c["drops"]
        for reason in ("malformed", "auth_failed", "wrong_job", "oversized", "replayed", "not_joined"):
            assert drops.get(reason, 0) > 0, (reason, drops)
        assert drops.get("bad_update", 0) == 0
        # each forged datagram dropped by the relay with its reason, or by the kernel in a full receive buffer
        # when the relay reads more slowly than the flood comes (a loaded host: how the two split is its speed)
        assert sum(drops.values()) + overflowed >= FLOOD * 0.9, (drops, overflowed)


@pytest.mark.parametrize("mode", ["per-rank", "aggregate"])
def test_a_relay_whose_apply_is_slow_paces_32_peers_and_drops_nothing(mode):
    # every apply sleeps: 32 updates a step take the relay's thread ≥ 32 ms per rank, one aggregate 20 ms
    options, codec = codec_for(mode)
    apply = options.get("apply_update") or (lambda u, params: apply_update(u, params))
    pause = 0.001 if mode == "per-rank" else 0.02

    def slow_apply(decoded, params):
        time.sleep(pause)
        apply(decoded, params)

    key, steps, k = new_job_key(), 8, 1
    with Relay(
        np.zeros(N, np.float32), W, key, 9, port=0, bind="127.0.0.1", **{**options, "apply_update": slow_apply}
    ) as relay:
        worst = {"ahead": 0, "history": 0}
        done = threading.Event()

        def sample():
            while not done.wait(0.005):
                c = relay.counters()
                worst["ahead"] = max(worst["ahead"], c["last_step"] - c["complete_through"])
                worst["history"] = max(worst["history"], c["history_entries"])

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            params, logs, expected, _ = exchange(
                relay, key, W, steps, np.random.default_rng(5), entries=(3, 100), staleness=k, **codec
            )
        finally:
            done.set()
            sampler.join(5)
        check_replicas(relay, mode, steps, expected, logs, params)
        c = relay.counters()
        assert c["updates_in"] == W * steps and c["applied"] == W * steps
        # the bounds of test_transport_n32's slowed relay: no rank's updates run more than k+1 (aggregated)
        # or 2(k+1) (per rank) steps past the relay's applied log, and the history holds those steps plus
        # the few the heartbeats lag by
        ahead = k + 1 if mode == "aggregate" else 2 * (k + 1)
        assert worst["ahead"] <= ahead, worst
        assert worst["history"] <= (ahead + 4) * (1 if mode == "aggregate" else W), worst
