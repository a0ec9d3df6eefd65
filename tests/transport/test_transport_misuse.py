"""Every call into the protocol cores, in every state they can reach, either works or raises the
documented error; nothing else (h2 ``tests/test_state_machines.py``).

A hypothesis state machine drives one RelayCore and up to three PeerCores with drawn sequences of
application calls (join, send_update, finish, leave, fail, snapshots, restarts with the same or a
higher attempt, at the right or the wrong moment), clock jumps past every timeout, and what the network
can do: lose, replay, corrupt or forge datagrams (forged ones sealed with the job key, as a buggy or
hostile task or relay could send them). After every call the cores' invariants hold, and, while nobody
has forged a message, every delivered update is exactly what its sender sent, in canonical order, and
the relay's parameters are exactly its log applied through ``complete_through``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gradshare.errors import LocalProtocolError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.relay.liveness import MAX_INCIDENTS
from gradshare.transport.protocol.states import PeerState
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import ON_RANK_LOSS, PeerTuning, RelayTuning
from gradshare.transport.protocol.wire import Kind
from transport_util import TOY, random_update, toy_apply_payload

KEY, JOB, N, DATAGRAM = b"k" * 32, 42, 200, 400
RELAY = "relay"
MAX_WORLD = 3
RECENT = 64  # datagrams kept to replay or corrupt later

ranks = st.integers(0, MAX_WORLD - 1)
steps = st.integers(-1, 12)
small = st.integers(0, 12)

# What an authenticated rank could say to the relay, and the relay to a rank: any valid message, with
# fields near the ones in play (steps 0..12, ranks 0..3) so that they hit live state, not only bounds.
to_relay = st.one_of(
    st.builds(ev.Join, st.sampled_from([N, N + 1]), st.integers(1, MAX_WORLD + 1)),
    st.builds(ev.Heartbeat, steps, steps, steps),
    st.builds(
        ev.Nak,
        st.lists(
            st.builds(ev.NakItem, small, st.integers(0, MAX_WORLD), st.lists(st.integers(0, 4), max_size=3).map(tuple)),
            min_size=1,
            max_size=3,
        ).map(tuple),
    ),
    st.builds(ev.Finished, steps),
    st.builds(ev.Leave),
    st.builds(ev.Loading),
    st.builds(ev.SnapRequest),
    st.builds(ev.SnapNak, st.integers(0, 3), st.just(((0, 1),))),
    st.builds(ev.SnapDone, st.integers(0, 3)),
    st.builds(ev.Fail, ranks, st.integers(0, 2), st.just("ValueError"), st.text(max_size=40)),
)
to_peer = st.one_of(
    st.builds(ev.Welcome, st.sampled_from([N, N + 1]), st.integers(1, MAX_WORLD), small, steps),
    st.builds(ev.Reject, st.text(max_size=30)),
    st.builds(ev.Ack, st.lists(small, min_size=1, max_size=3).map(tuple)),
    st.builds(ev.Nak, st.lists(st.builds(ev.NakItem, small, ranks, st.just(())), min_size=1, max_size=3).map(tuple)),
    st.builds(ev.FailAck, ranks, st.integers(0, 2)),
    st.builds(
        ev.SnapInfo,
        st.integers(0, 3),
        steps.filter(lambda s: s >= 0),
        st.just(N),
        st.sampled_from([1, 3, 4]),
        st.sampled_from([4, 268, 800]),
        st.just("x"),
    ),
)


class CoreMisuse(RuleBasedStateMachine):
    @initialize(world=st.integers(1, MAX_WORLD), on_rank_loss=st.sampled_from(ON_RANK_LOSS), joined=st.booleans())
    def start(self, world, on_rank_loss, joined):
        self.now = 0.0
        self.world = world
        self.rng = np.random.default_rng(0)
        self.p0 = np.random.default_rng(1).standard_normal(N).astype(np.float32)
        tuning = RelayTuning(liveness_timeout=1.0, give_up_after=2.0, step_timeout=3.0, on_rank_loss=on_rank_loss)
        self.relay = RelayCore(self.p0, world, KEY, JOB, now=0.0, datagram_size=DATAGRAM, tuning=tuning, **TOY)
        self.peers: dict[int, PeerCore] = {}
        self.delivered: dict[int, list[ev.Update]] = {}  # per live core, everything it delivered
        self.sent: dict[tuple[int, int, int], bytes] = {}  # (attempt, step, rank) -> payload
        self.in_flight: list[tuple[bytes, object]] = []  # (datagram, destination), not yet delivered
        self.recent: list[tuple[bytes, object]] = []
        self.recent_updates: list[tuple[bytes, object]] = []
        self.forged = False
        self.failures_heard: set[tuple[int, int]] = set()  # (rank, attempt) of every FAIL the relay took
        for r in range(world):
            self._new_peer(r, 0)
            if joined:  # half the runs start from a joined job
                self.peers[r].join(0.0)
        self.pump(2, 0)

    # --- helpers -----------------------------------------------------------------------------------
    def _new_peer(self, rank: int, attempt: int) -> PeerCore:
        p = PeerCore(
            rank, self.world, attempt, KEY, JOB, N, now=self.now, datagram_size=DATAGRAM, tuning=PeerTuning(rto=0.05)
        )
        self.peers[rank] = p
        self.delivered[rank] = []
        return p

    def _peer(self, rank: int) -> PeerCore:
        return self.peers[rank % self.world]

    def _collect(self) -> None:
        """Everything the cores want to send goes in flight; every event is of a known kind."""
        for data, addr in self.relay.datagrams_to_send():
            assert isinstance(data, bytes) and len(data) <= wire.MAX_DATAGRAM_SIZE
            self.in_flight.append((data, addr))
        for r, p in self.peers.items():
            for data in p.datagrams_to_send():
                assert isinstance(data, bytes) and len(data) <= DATAGRAM  # a peer never sends oversized
                self.in_flight.append((data, (RELAY, r)))
        while (e := self.relay.next_event()) is not None:
            assert type(e).__module__ == ev.__name__, e
            if isinstance(e, ev.PeerFailed):
                self.failures_heard.add((e.rank, e.attempt))
        for r, p in self.peers.items():
            while (e := p.next_event()) is not None:
                assert type(e).__module__ == ev.__name__, e
            self.delivered[r].extend(p.pop_ready())

    def _deliver(self, data: bytes, dst) -> None:
        if isinstance(dst, tuple):  # (RELAY, from rank): into the relay, from that address
            self.relay.receive_datagram(data, dst[1], self.now)
        elif dst in self.peers:
            self.peers[dst].receive_datagram(data, RELAY, self.now)

    def _remember(self, data: bytes, dst) -> None:
        # update chunks apart: between them flow many more heartbeats and STATUS pages
        kept = self.recent_updates if wire.HEADER.unpack_from(data)[2] == Kind.UPDATE else self.recent
        kept.append((data, dst))
        del kept[:-RECENT]

    # --- application calls on the peers -----------------------------------------------------------
    @rule(rank=ranks)
    def loading(self, rank):
        try:
            self._peer(rank).loading(self.now)
        except LocalProtocolError:
            assert self._peer(rank).state != PeerState.NEW

    @rule(rank=ranks)
    def join(self, rank):
        p = self._peer(rank)
        was = p.state
        try:
            p.join(self.now)
        except LocalProtocolError:
            assert was not in (PeerState.NEW, PeerState.LOADING)
        else:
            assert was in (PeerState.NEW, PeerState.LOADING) and p.state == PeerState.JOINING

    @rule(
        rank=ranks,
        offset=st.sampled_from([0, 0, 0, 1, -1, 5]),
        entries=st.sampled_from([0, 3, 150]),
        meta=st.sampled_from([None, StepMeta(loss=1.0, epoch=0)]),
    )
    def send_update(self, rank, offset, entries, meta):
        p = self._peer(rank)
        step = (p.own.next_step if p.own.next_step is not None else 0) + offset
        payload = random_update(self.rng, N, entries)  # 150 entries: several chunks
        try:
            p.send_update(step, payload, meta, self.now)
        except LocalProtocolError:
            assert (
                offset != 0
                or p.state != PeerState.JOINED
                or p.io.error
                or p.own.finish_step is not None
                or len(p.own.unacked) >= p.tuning.max_unacked
            )
        else:
            assert offset == 0 and p.own.next_step == step + 1
            self.sent[(p.attempt, step, p.rank)] = payload

    @rule(rank=ranks, offset=st.sampled_from([0, 0, 1, -1]))
    def finish(self, rank, offset):
        p = self._peer(rank)
        last = (p.own.next_step if p.own.next_step is not None else 0) - 1 + offset
        try:
            p.finish(last, self.now)
        except LocalProtocolError:
            assert offset != 0 or p.state != PeerState.JOINED or p.io.error
        else:
            assert p.own.finish_step is not None and p.own.finish_step <= last

    @rule(rank=ranks)
    def leave(self, rank):
        p = self._peer(rank)
        p.leave()
        assert p.state == PeerState.CLOSED

    @rule(rank=ranks, into=st.sampled_from(["new", "given", "short", "float64", "read-only"]))
    def request_snapshot(self, rank, into):
        p = self._peer(rank)
        buffers = {
            "new": None,
            "given": np.zeros(N, np.float32),
            "short": np.zeros(N - 1, np.float32),
            "float64": np.zeros(N),
            "read-only": np.zeros(N, np.float32),
        }
        buffers["read-only"].flags.writeable = False
        before = p.snaps.into
        try:
            p.snapshot_destination(buffers[into])
        except ValueError as e:  # a wrong buffer is refused at once, not when the chunks arrive
            assert into in ("short", "float64", "read-only") and "into must be" in str(e)
            assert p.snaps.into is before
        else:
            assert into in ("new", "given")
        try:
            p.request_snapshot(self.now)
        except LocalProtocolError:
            assert p.state != PeerState.JOINED or p.io.error

    @rule(rank=ranks, error_type=st.from_regex(r"[a-z][a-z.]{0,99}", fullmatch=True), message=st.text(max_size=400))
    def fail(self, rank, error_type, message):
        self._peer(rank).fail(error_type, message, self.now)  # joined or not: never refused

    @rule(rank=ranks, step=steps)
    def begin_step(self, rank, step):
        self._peer(rank).begin_step(step)

    @rule(rank=ranks, higher=st.booleans())
    def restart(self, rank, higher):
        """The task is replaced (a retried Spark task): a new core, same attempt or the next one."""
        old = self._peer(rank)
        old.leave()
        self._new_peer(old.rank, min(old.attempt + int(higher), 2)).join(self.now)

    @rule(rounds=st.integers(1, 6), entries=st.sampled_from([3, 150]), dup_every=st.sampled_from([0, 3]))
    def progress(self, rounds, entries, dup_every):
        """What a healthy fit does between the misuses: every usable peer sends its next step, time
        moves a little, the network delivers. Valid calls only, so nothing may raise here."""
        for _ in range(rounds):
            for p in self.peers.values():
                if (
                    p.state == PeerState.JOINED
                    and not p.io.error
                    and p.own.finish_step is None
                    and len(p.own.unacked) < 32
                ):
                    payload = random_update(self.rng, N, entries)
                    p.send_update(p.own.next_step, payload, StepMeta(loss=1.0, epoch=0), self.now)
                    self.sent[(p.attempt, p.own.next_step - 1, p.rank)] = payload
            self.tick(0.003)
            self.pump(1, 0, dup_every)

    # --- time and the network --------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.0, 0.001, 0.01, 0.06, 0.3, 1.5, 4.0]))
    def tick(self, dt):
        """Time passes; every core's timer runs (due or not: an early call must be harmless too)."""
        self.now += dt
        self.relay.handle_timer(self.now)
        for p in self.peers.values():
            p.handle_timer(self.now)
        self._collect()

    @rule(rounds=st.integers(1, 4), lose_every=st.sampled_from([0, 0, 3, 7]), dup_every=st.sampled_from([0, 2, 5]))
    def pump(self, rounds, lose_every, dup_every=0):
        """Deliver what is in flight for a few round trips: every ``lose_every``-th datagram is lost, every
        ``dup_every``-th arrives again one round later (after the original was handled)."""
        for _ in range(rounds):
            self._collect()
            batch, self.in_flight = self.in_flight, []
            for i, (data, dst) in enumerate(batch):
                self._remember(data, dst)
                if dup_every and i % dup_every == 0:
                    self.in_flight.append((data, dst))
                if lose_every and i % lose_every == lose_every - 1:
                    continue
                self._deliver(data, dst)
            self.relay.apply_pending()
        self._collect()

    @rule(pick=st.integers(0, RECENT - 1), flip=st.none() | st.integers(0, 1 << 16), update=st.booleans())
    @precondition(lambda self: self.recent)
    def replay_or_corrupt(self, pick, flip, update):
        """A datagram seen before arrives again, intact (a duplicate or a replay) or with one byte changed."""
        kept = self.recent_updates if update and self.recent_updates else self.recent
        data, dst = kept[-1 - pick % len(kept)]
        if flip is not None:
            b = bytearray(data)
            b[flip % len(b)] ^= 1 + flip % 255
            data = bytes(b)
        self._deliver(data, dst)
        self._collect()

    @rule(data=st.binary(max_size=64), rank=ranks, to_relay=st.booleans())
    def garbage(self, data, rank, to_relay):
        self._deliver(data, (RELAY, rank % self.world) if to_relay else rank % self.world)
        self._collect()

    # --- invariants ----------------------------------------------------------------------------------
    @invariant()
    def peers_hold_together(self):
        for r, p in self.peers.items():
            assert p.state in set(PeerState)
            assert p.inbound.inbox_nbytes == sum(len(u.payload) for u in (*p.inbound.inbox.values(), *p.inbound.ready))
            assert len(p.own.unacked) <= p.tuning.max_unacked
            assert (p.welcome is None) == (p.inbound.cursor is None) == (p.own.next_step is None)
            c = p.counters()
            assert all(type(v) is int for k, v in c.items() if k != "drops")
            assert c["bytes_out"] >= 0 and c["unacked"] == len(p.own.unacked)
            assert isinstance(p.next_timer(), float) and p.next_timer() == p.next_timer()
            key = p.blocking_key()
            assert key is None or key[0] > p.complete_through
            p.idle(), p.finished(), p.snapshot_progress(), p.last_heard, p.has_ready()
            # nothing waits in the inbox that the log is already past (it would never leave: a leak)
            assert p.inbound.cursor is None or not any(p.inbound.cursor.done_before(*k) for k in p.inbound.inbox)
            log = [(u.step, u.sender) for u in self.delivered[r]]
            assert log == sorted(set(log)), "delivered out of canonical order, or twice"
            if p.welcome is not None:
                assert all(s >= p.welcome.start_step for s, _ in log)
                assert not log or log[-1][0] <= p.complete_through + 1

    @invariant()
    def relay_holds_together(self):
        relay = self.relay
        assert all(step > relay.complete_through for step, _ in relay.att.pending)
        assert relay.complete_through >= relay.att.cursor.start_step - 1
        assert len(relay.liveness.incidents) <= MAX_INCIDENTS
        assert len(relay.att.history) <= relay.att.history.max_entries
        c = relay.counters()
        assert c["complete_through"] == relay.complete_through and c["attempt"] == relay.att.number
        assert set(relay.progress()["ranks"]) == set(range(self.world))
        (
            relay.next_timer(),
            relay.finished(),
            relay.epoch_tallies(),
            relay.liveness.first_cause(),
            relay.liveness.fatal_incident(),
        )

    @invariant()
    def nothing_corrupted(self):
        """While every datagram is one a core made, the log is exactly what was sent, and the relay's
        parameters are exactly the log applied (the bits: the toy codec adds in log order, as the real
        one does)."""
        if self.forged:
            return
        for p in self.peers.values():  # a FAIL counts as acknowledged only once the relay took that very one
            assert not p.fail_acked or (p.failed is not None and (p.rank, p.attempt) in self.failures_heard)
        for r, p in self.peers.items():
            for u in self.delivered[r]:
                assert self.sent.get((p.attempt, u.step, u.sender)) == u.payload, (r, u.step, u.sender)
        relay = self.relay
        if relay.att.number != 0:
            return  # a retried attempt starts from a cut, not from p0
        for r, p in self.peers.items():
            if p.attempt == 0 and p.complete_through >= relay.complete_through and p.welcome is not None:
                params = self.p0.copy()
                for u in self.delivered[r]:
                    if u.step <= relay.complete_through:
                        toy_apply_payload(u.payload, params)
                assert params.tobytes() == relay.params.tobytes(), f"rank {r}'s log differs from the relay's"


class HostileCoreMisuse(CoreMisuse):
    """The same, and datagrams sealed with the job key that no core made: the cores must still only
    work or drop and count (the log may then differ from what was sent: a liar with the key can do that)."""

    @rule(rank=ranks, msg=to_relay)
    def forged_control_to_relay(self, rank, msg):
        """An authenticated rank says something it should not (at the wrong time, or false)."""
        self.forged = True
        self._deliver(self._peer(rank).chan.seal_control(msg), (RELAY, rank % self.world))
        self._collect()

    @rule(rank=ranks, origin=st.integers(0, MAX_WORLD), step=small, body=st.binary(max_size=40) | st.just(None))
    def forged_update_to_relay(self, rank, origin, step, body):
        """An update chunk with the job key: a valid toy payload or junk, any origin, any step."""
        self.forged = True
        p = self._peer(rank)
        body = wire.encode_update_body(random_update(self.rng, N, 2), None) if body is None else body
        for d in p.chan.seal_chunks(Kind.UPDATE, body, origin, step):
            self._deliver(d, (RELAY, rank % self.world))
        self._collect()

    @rule(rank=ranks, msg=to_peer)
    def forged_control_to_peer(self, rank, msg):
        """The relay (or someone with the key) says something false or untimely to a peer."""
        self.forged = True
        self._deliver(self.relay.chan.seal_control(msg), rank % self.world)
        self._collect()


SETTINGS = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
CoreMisuse.TestCase.settings = HostileCoreMisuse.TestCase.settings = SETTINGS
test_core_misuse = CoreMisuse.TestCase
test_core_misuse_with_forged_datagrams = HostileCoreMisuse.TestCase
