"""A peer's protocol state machine, sans I/O (bytes in, datagrams and events out). The shell in ``sockets/peer.py``
moves bytes and time, and learns what happened from ``next_event()``. Its lifecycle is ``states.PEER_TRANSITIONS``. It
composes its parts, each owning its state: its own updates until acknowledged (``own.py``), the inbound
log and its NAKs (``inbound.py``), a snapshot download (``snapshot.py``), and what all of them hand the
shell (``outbox.py``). Its tunables are one frozen ``PeerTuning`` (tuning.py).

A peer joins the relay, sends its own updates (kept until acknowledged, retransmitted after ``rto``, and
re-sent chunk by chunk when the relay NAKs), receives forwarded updates, NAKs what it knows exists but is
missing (from STATUS ``have`` and from later steps it already saw), and releases the apply log in canonical
(step, rank) order, its own updates included (docs/design.md, Consistency). It can also fetch a snapshot.
With aggregated forwarding (the relay's WELCOME says so) its own messages are not in its log: they reach
it inside the relay's aggregate (inbound.py).
"""

from __future__ import annotations

import numpy as np

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.peer.inbound import Inbound
from gradshare.transport.protocol.peer.outbox import PeerOutbox
from gradshare.transport.protocol.peer.own import OwnLog
from gradshare.transport.protocol.peer.snapshot import SnapshotFetch
from gradshare.transport.protocol.states import PEER_TRANSITIONS, PeerState, PeerTrigger, transition
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import PeerTuning
from gradshare.transport.protocol.wire import AGGREGATE_ORIGIN, RELAY_ID, Kind


class PeerCore:
    def __init__(
        self,
        rank: int,
        world_size: int,
        attempt: int,
        key: bytes | None,
        job_id: int | str,
        n_params: int,
        *,
        now: float,
        datagram_size: int = wire.DEFAULT_DATAGRAM_SIZE,
        insecure: bool = False,
        tuning: PeerTuning = PeerTuning(),
    ) -> None:
        """tuning: the tunables (tuning.PeerTuning)."""
        if type(world_size) is not int or not 1 <= world_size <= ev.MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in [1, {ev.MAX_WORLD_SIZE}] (got {world_size!r})")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}) (got {rank!r})")
        if type(attempt) is not int or not 0 <= attempt < 1 << 16:
            raise ValueError(f"attempt must be an int in [0, 65535] (got {attempt!r})")
        if type(n_params) is not int or n_params < 1:
            raise ValueError(f"n_params must be a positive int (got {n_params!r})")
        if not isinstance(tuning, PeerTuning):
            raise ValueError(f"tuning must be a PeerTuning (got {type(tuning).__name__})")
        self.rank, self.world_size, self.attempt, self.n_params = rank, world_size, attempt, n_params
        self.tuning = tuning
        max_message = 8 * n_params + 65536
        self.chan = Channel(
            key=key,
            insecure=insecure,
            job=wire.job_id_to_int(job_id),
            sender=rank,
            attempt=attempt,
            datagram_size=datagram_size,
            max_chunks=max(16, -(-max_message // 64)),
            max_windows=4,
        )
        self.io = PeerOutbox(self.chan)  # datagrams, events, counters and the error, for the shell
        self.state = PeerState.NEW  # states.PEER_TRANSITIONS: the only way it changes is _to()
        self.computing = -1  # the step the training thread computes (-1: none), in heartbeats
        self.welcome: ev.Welcome | None = None
        self.own = OwnLog(rank, tuning, self.io)  # ours, until the relay has them
        self.inbound = Inbound(rank, world_size, max_message, tuning, self.io)
        self.snaps = SnapshotFetch(n_params, tuning, self.io)
        self.failed: ev.Fail | None = None  # our FAIL, resent until the relay acknowledges it
        self.fail_acked = False
        self._last_fail = -1e18
        self.last_heard: float | None = None  # when an authenticated datagram last came from the relay
        self._last_join = self._last_hb = -1e18
        self._last_tick = now

    # --- application calls --------------------------------------------------------------------------
    def loading(self, now: float) -> None:
        """Tell the relay, every heartbeat interval until join(), that this task is alive and still
        materialising its partition (a slow partition is not a dead task)."""
        self._to(PeerTrigger.LOADING)
        self._last_hb = now
        self.io.send(ev.Loading())

    def join(self, now: float) -> None:
        self._to(PeerTrigger.JOIN)
        self._last_join = now
        self.io.send(ev.Join(self.n_params, self.world_size))

    def send_update(self, step: int, payload: bytes, meta: StepMeta | None, now: float) -> None:
        self.io.check_usable(self.state, "send_update")
        self.own.check_next(step)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes (got {type(payload).__name__})")
        payload = bytes(payload)
        body = wire.encode_update_body(payload, meta)
        if not self.inbound.aggregate:  # aggregated: it reaches our log inside the relay's aggregate
            self.inbound.store(ev.Update(step, self.rank, payload, meta, now))
        self.own.send(step, body, now)
        self.computing = -1
        self.inbound.advance()

    def finish(self, last_step: int, now: float) -> None:
        self.io.check_usable(self.state, "finish")
        if self.own.finish(last_step):
            self.inbound.rank_end(self.rank, last_step)
            self.inbound.advance()
        self.io.send(ev.Finished(last_step))

    def leave(self) -> None:
        if self.state in (PeerState.JOINED, PeerState.JOINING):
            self.io.send(ev.Leave())
        self._to(PeerTrigger.LEAVE)

    def request_snapshot(self, now: float) -> None:
        self.io.check_usable(self.state, "fetch_snapshot")
        self.snaps.request(now)

    def fail(
        self,
        error_type: str,
        message: str,
        now: float,
        step: int = -1,
        fatal: bool = True,
        error_class: str = "TrainingError",
        cause: str = "",
    ) -> None:
        """Report a failure (FAIL; `fatal`: a deterministic one, events.Fail), joined or not; resent every
        ``heartbeat_interval`` until FAIL_ACK. The message and the cause are cut to what fits one
        datagram: a FAIL is never chunked."""
        text, cause = message[: ev.MAX_ERROR_TEXT], cause[: ev.MAX_ERROR_TEXT]
        while True:
            msg = ev.Fail(
                self.rank,
                self.attempt,
                error_type[-ev.MAX_ERROR_TYPE :],
                text,
                step,
                fatal,
                error_class[-ev.MAX_ERROR_TYPE :],
                cause,
            )
            if len(wire.encode_control(msg)[1]) <= self.chan.chunk_bytes or not (text or cause):
                break
            text, cause = text[: len(text) * 3 // 4], cause[: len(cause) * 3 // 4]
        self.failed = msg
        self.fail_acked = False
        self._last_fail = now
        self.io.send(msg)

    def begin_step(self, step: int) -> None:
        """The training thread computes ``step`` now (until its send_update): heartbeats say so."""
        self.computing = step

    def snapshot_destination(self, into: np.ndarray | None) -> None:
        """Where the next snapshot download lands (None: a new array). Checked here, not when the chunks
        arrive: a wrong buffer would otherwise fail inside receive_datagram, in the shell's I/O thread."""
        if into is not None and (
            not isinstance(into, np.ndarray)
            or into.dtype != np.float32
            or into.shape != (self.n_params,)
            or not into.flags.c_contiguous
            or not into.flags.writeable
        ):
            raise ValueError(f"into must be a writable C-contiguous float32 array of shape ({self.n_params},)")
        self.snaps.into = into

    def has_ready(self) -> bool:
        """An update is deliverable (``pop_ready`` returns it)."""
        return self.inbound.has_ready()

    def pop_ready(self) -> list[ev.Update]:
        return self.inbound.pop_ready()

    def finished(self) -> bool:
        """The whole log is delivered: every rank ended and nothing of it is missing."""
        return self.inbound.finished()

    def blocking_key(self) -> tuple[int, int] | None:
        """The (step, rank) the log waits for (rank AGGREGATE_ORIGIN: the relay's aggregate), or None."""
        return self.inbound.blocking_key()

    @property
    def complete_through(self) -> int:
        return self.inbound.complete_through

    def heard_at(self) -> float | None:
        """When an authenticated datagram last came from the relay (None: never)."""
        return self.last_heard

    def snapshot_progress(self) -> tuple[int, int] | None:
        """(chunks received, chunks in all) of the snapshot being downloaded; None before its SNAP_INFO."""
        return self.snaps.progress()

    def idle(self) -> bool:
        """Nothing of ours is still unacknowledged (safe to leave)."""
        return not self.own.waiting()

    def datagrams_to_send(self) -> list[bytes]:
        return self.io.take()

    def next_event(self) -> ev.PeerEvent | None:
        return self.io.events.popleft() if self.io.events else None

    def next_timer(self) -> float:
        if self.failed is not None and not self.fail_acked:
            return self._last_fail + self.tuning.heartbeat_interval
        if self.state == PeerState.JOINING:
            return self._last_join + self.tuning.rto
        if self.state == PeerState.LOADING:
            return self._last_hb + self.tuning.heartbeat_interval
        if self.state != PeerState.JOINED:
            return self._last_tick + 1.0
        nxt = self._last_hb + self.tuning.heartbeat_interval
        if self.inbound.missing or len(self.inbound.reasm) or self.snaps.requested:
            nxt = min(nxt, self._last_tick + self.tuning.tick)  # NAK timing is in milliseconds
        elif self.own.waiting():
            # only retransmit timeouts are due (>= rto): a 2 ms tick here woke the receiver thread,
            # and took the GIL from training, ~30 times per training step for nothing
            nxt = min(nxt, self._last_tick + self.tuning.rto / 10)
        return nxt

    def counters(self) -> ev.Counters:
        d: ev.Counters = dict.fromkeys(
            (
                "datagrams_in",
                "datagrams_out",
                "bytes_in",
                "bytes_out",
                "snapshot_bytes_in",
                "retransmits",
                "updates_sent",
                "delivered",
                "naks_sent",
            ),
            0,
        )
        d.update(self.io.counts)
        d["drops"] = dict(self.chan.drops)
        d["unacked"] = len(self.own.unacked)
        d["complete_through"] = self.complete_through
        return d

    # --- input ---------------------------------------------------------------------------------------
    def receive_datagram(self, data: bytes, addr: ev.Address, now: float) -> None:
        self.io.counts["datagrams_in"] += 1
        self.io.counts["bytes_in"] += len(data)
        h = self.chan.parse(data, wire.MAX_DATAGRAM_SIZE)
        if h is None:
            return
        # the relay forwards an update chunk as its origin sealed it (sender = origin, another rank);
        # everything else comes from the relay itself
        forwarded = h.kind == Kind.UPDATE
        if forwarded and self.inbound.aggregate:  # the relay's own aggregate (retransmissions: the same bytes)
            genuine = h.sender == RELAY_ID and h.origin == AGGREGATE_ORIGIN
        elif forwarded:
            genuine = h.sender == h.origin and h.sender < self.world_size and h.sender != self.rank
        else:
            genuine = h.sender == RELAY_ID
        if not genuine:
            self.chan.drops["bad_sender"] += 1
            return
        if h.attempt != self.attempt and h.kind not in (Kind.REJECT, Kind.FAIL_ACK):
            self.chan.drops["other_attempt"] += 1
            return
        body = self.chan.open(h, data, replay_window=not forwarded)
        if body is None:
            return
        self.last_heard = now
        if h.kind == Kind.FAIL_ACK:  # whatever our state: a failed peer may never have joined
            ack = self.chan.control(Kind.FAIL_ACK, body)  # h.kind, named for the checker
            if ack is not None and (ack.rank, ack.attempt) == (self.rank, self.attempt) and self.failed:
                self.fail_acked = True
                self.io.emit(ack)
            return
        if self.state in (PeerState.CLOSED, PeerState.REJECTED):
            self.chan.drops["after_close"] += 1
            return
        if h.kind == Kind.UPDATE:
            self.inbound.receive_chunk(h, body, now)
            return
        if h.kind == Kind.SNAP_CHUNK:
            self.io.counts["snapshot_bytes_in"] += len(data)  # the model's download, not training traffic
            self.snaps.on_chunk(h, body, now)
            return
        msg = self.chan.control(h.kind, body)
        if msg is None:
            return
        if isinstance(msg, ev.Reject):
            self._to(PeerTrigger.REJECT)
            self.io.fail_with(f"relay rejected rank {self.rank} (attempt {self.attempt}): {msg.reason}")
        elif isinstance(msg, ev.Welcome):
            if self.state != PeerState.JOINING or self.welcome is not None:
                return  # a duplicate WELCOME (our JOIN was retransmitted)
            if msg.n_params != self.n_params or msg.world_size != self.world_size:
                self._to(PeerTrigger.REJECT)
                self.io.fail_with(
                    f"relay runs a job with n_params={msg.n_params}, world_size={msg.world_size}; "
                    f"rank {self.rank} has n_params={self.n_params}, world_size={self.world_size}"
                )
                return
            self.welcome = msg
            self._to(PeerTrigger.WELCOME)
            self.inbound.start(msg)
            self.own.next_step = msg.start_step
            self.io.emit(ev.Welcomed(msg))
        elif self.inbound.cursor is None:
            self.chan.drops["before_welcome"] += 1
        elif isinstance(msg, ev.Ack):
            for s in msg.steps:
                self.own.unacked.acked(s, now)
        elif isinstance(msg, ev.Nak):
            self.own.on_nak(msg.items)
        elif isinstance(msg, ev.Status):
            self.inbound.on_status(msg, self.own)
        elif isinstance(msg, ev.SnapInfo):
            self.snaps.on_info(msg, now)
        else:
            self.chan.drops["unexpected_kind"] += 1

    # --- timers --------------------------------------------------------------------------------------
    def handle_timer(self, now: float) -> None:
        self._last_tick = now
        if self.failed is not None and not self.fail_acked and now >= self._last_fail + self.tuning.heartbeat_interval:
            self._last_fail = now
            self.io.send(self.failed)  # sealed anew: the relay drops replays
        if self.state == PeerState.JOINING:
            if now >= self._last_join + self.tuning.rto:
                self._last_join = now
                self.io.send(ev.Join(self.n_params, self.world_size))
            return
        if self.state == PeerState.LOADING:
            if now >= self._last_hb + self.tuning.heartbeat_interval:
                self._last_hb = now
                self.io.send(ev.Loading())
            return
        if self.state != PeerState.JOINED:
            return
        own = self.own
        assert own.next_step is not None  # WELCOME set it: joined states come after it
        if now >= self._last_hb + self.tuning.heartbeat_interval:
            self._last_hb = now
            self.io.send(ev.Heartbeat(self.complete_through, own.next_step - 1, self.computing))
            if own.finish_step is not None and not own.finish_acked:
                self.io.send(ev.Finished(own.finish_step))
        own.retransmit_due(now)
        self.inbound.nak_missing(now, own.unacked.srtt)
        self.inbound.reasm.expire(now, 30.0)
        self.snaps.on_timer(now)

    # --- helpers -------------------------------------------------------------------------------------
    def _to(self, trigger: PeerTrigger) -> None:
        self.state = transition(PEER_TRANSITIONS, self.state, trigger, f"peer rank {self.rank}")
