"""In-memory harness: one RelayCore and W PeerCores on a seeded lossy, duplicating, reordering Link with a
simulated clock (the shape of aioquic's tests ``client_and_server``/``transfer``/``drop``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from gradshare.hashing import param_hash
from gradshare.task.tallies import TrainingLog
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import RelayTuning
from transport_util import TOY, Link, random_update, toy_apply_payload

RELAY = "relay"
TUNABLES = {f.name for f in dataclasses.fields(RelayTuning)}


class Sim:
    def __init__(
        self,
        world_size: int = 3,
        n_params: int = 500,
        seed: int = 0,
        loss: float = 0.0,
        dup: float = 0.0,
        max_delay: float = 0.0,
        key: bytes = b"k" * 32,
        datagram_size: int = 400,
        staleness: int = 1,
        liveness_timeout: float = 5.0,
        **relay_options,
    ) -> None:
        self.now = 0.0
        self.W, self.N, self.staleness = world_size, n_params, staleness
        self.key = key
        self.datagram_size = datagram_size
        self.link = Link(seed, loss, dup, max_delay)
        self.rng = np.random.default_rng(seed)
        self.p0 = self.rng.standard_normal(n_params).astype(np.float32)
        # relay_options: RelayTuning's fields and RelayCore's plug-ins (the toy codec unless given)
        tunables = {k: relay_options.pop(k) for k in list(relay_options) if k in TUNABLES}
        # the trainer's bookkeeping, as the driver hands it to its relay (a test's `rollback` goes to it)
        self.training = TrainingLog(relay_options.pop("rollback", None))
        relay_options.setdefault("observer", self.training)
        self.relay = RelayCore(
            self.p0,
            world_size,
            key,
            42,
            now=0.0,
            datagram_size=datagram_size,
            tuning=RelayTuning(liveness_timeout=liveness_timeout, **tunables),
            **{**TOY, **relay_options},
        )
        self.peers: dict[int, PeerCore] = {}
        self.params: dict[int, np.ndarray] = {}
        self.delivered: dict[int, list] = {}
        self.sent: dict[tuple[int, int], bytes] = {}
        self.silent: set[int] = set()
        # what a rank sends and how a delivered payload is applied (the toy codec unless a test sets the
        # real one, e.g. for the relay's aggregate, which decodes and re-encodes)
        self.make_payload = lambda n_entries: random_update(self.rng, self.N, n_entries)
        self.apply_payload = toy_apply_payload

    def add_peer(self, rank: int, attempt: int = 0) -> PeerCore:
        p = PeerCore(rank, self.W, attempt, self.key, 42, self.N, now=self.now, datagram_size=self.datagram_size)
        self.peers[rank] = p
        self.params[rank] = self.p0.copy()
        self.delivered[rank] = []
        p.join(self.now)
        return p

    def pump(self) -> None:
        """Move every queued datagram into the link, every due datagram into its endpoint."""
        for data, addr in self.relay.datagrams_to_send():
            self.link.send(data, addr, RELAY, self.now)
        for r, p in self.peers.items():
            for data in p.datagrams_to_send():
                if r not in self.silent:
                    self.link.send(data, RELAY, r, self.now)
        for data, dst, src in list(self.link.due(self.now)):
            if dst == RELAY:
                self.relay.receive_datagram(data, src, self.now)
            elif dst in self.peers and dst not in self.silent:
                self.peers[dst].receive_datagram(data, RELAY, self.now)
        for r, p in self.peers.items():
            for u in p.pop_ready():
                self.delivered[r].append(u)
                self.apply_payload(u.payload, self.params[r])

    def step_time(self, max_dt: float = 0.01) -> None:
        cands = [self.relay.next_timer()] + [p.next_timer() for p in self.peers.values()]
        nt = self.link.next_time()
        if nt is not None:
            cands.append(nt)
        self.now = max(self.now, min(min(cands), self.now + max_dt))
        if self.now >= self.relay.next_timer():
            self.relay.handle_timer(self.now)
        for p in self.peers.values():
            if self.now >= p.next_timer():
                p.handle_timer(self.now)
        self.pump()

    def run(self, steps: int, entries=(3, 300), max_iters: int = 200_000, last_step: dict | None = None) -> int:
        """Every joined peer sends ``steps`` updates (or up to last_step[r]) with bounded staleness, then
        FINISHED; returns the iterations used. Sizes alternate between small and multi-chunk."""
        last_step = last_step or {}
        for _ in range(max_iters):
            self.pump()
            for r, p in self.peers.items():
                if p.state != "joined" or r in self.silent:
                    continue
                end = last_step.get(r, p.welcome.start_step + steps - 1)
                t = p.own.next_step
                if t <= end and p.complete_through >= t - 1 - self.staleness:
                    payload = self.make_payload(int(self.rng.choice(entries)))
                    self.sent[(t, r)] = payload
                    p.send_update(t, payload, StepMeta(loss=float(t)), self.now)
                elif t > end and p.own.finish_step is None:
                    p.finish(end, self.now)
            if self.relay.finished() and all(
                p.inbound.cursor is not None and p.inbound.cursor.finished()
                for r, p in self.peers.items()
                if r not in self.silent
            ):
                self.pump()
                return _
            self.step_time()
        raise AssertionError(
            f"simulation did not finish in {max_iters} iterations: relay through "
            f"{self.relay.complete_through}, peers "
            f"{[(r, p.complete_through, p.blocking_key()) for r, p in self.peers.items()]}"
        )


def drive(sim: Sim, until, max_iters: int = 50_000) -> None:
    """Advance the simulation until ``until()`` holds."""
    for _ in range(max_iters):
        if until():
            return
        sim.step_time()
    raise AssertionError("condition not reached")


def check_consistent(sim: Sim) -> None:
    expected = sorted(sim.sent)  # canonical (step, sender) order
    for r in sim.peers:
        if r in sim.silent:
            continue
        got = [(u.step, u.sender) for u in sim.delivered[r]]
        assert got == expected, f"rank {r} delivered {len(got)} of {len(expected)} (or out of order)"
        for u in sim.delivered[r]:
            assert u.payload == sim.sent[(u.step, u.sender)]
        assert param_hash(sim.params[r]) == param_hash(sim.relay.params), f"rank {r} differs from relay"
    assert sim.relay.counts["applied"] == len(expected)
