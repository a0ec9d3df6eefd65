"""A peer's protocol state machine, sans I/O (bytes in, datagrams and events out). The shell in ``sockets/peer.py`` moves bytes and
time, and learns what happened from ``next_event()``. Its lifecycle is ``states.PEER_TRANSITIONS``; its own
updates wait for their acknowledgement in ``outstanding.py``; forwarded updates come in and missing ones
are NAKed in ``peer/inbound.py``; a snapshot download is ``peer/snapshot.py``'s. Its tunables are one
frozen ``PeerTuning`` (tuning.py).

A peer joins the relay, sends its own updates (kept until acknowledged, retransmitted after ``rto``, and
re-sent chunk by chunk when the relay NAKs), receives forwarded updates, NAKs what it knows exists but is
missing (from STATUS ``have`` and from later steps it already saw), and releases the apply log in canonical
(step, rank) order, its own updates included (docs/design.md, Consistency). It can also fetch a snapshot.

With aggregated forwarding (the relay's WELCOME says so) the log is the relay's one
aggregated message per step instead: origin AGGREGATE_ORIGIN, sealed by the relay, one slot per step (a
one-slot cursor), and the peer's own messages are not in it. It ends at the last step of the last rank
to end (each rank's end still comes from STATUS, its own from ``finish``).
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np
from numpy.typing import NDArray

from gradshare.errors import LocalProtocolError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.peer.outstanding import Outstanding
from gradshare.transport.protocol.peer.inbound import nak_missing, receive_update_chunk
from gradshare.transport.protocol.peer.snapshot import SnapshotDownload, SnapshotFetch
from gradshare.transport.protocol.reassembly import Reassembler
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.states import PEER_TRANSITIONS, PeerState, PeerTrigger, transition
from gradshare.transport.protocol.tuning import PeerTuning
from gradshare.transport.protocol.wire import AGGREGATE_ORIGIN, RELAY_ID, Kind


class PeerCore:
    def __init__(self, rank: int, world_size: int, attempt: int, key: bytes | None, job_id: int | str,
                 n_params: int, *, now: float, datagram_size: int = wire.DEFAULT_DATAGRAM_SIZE,
                 insecure: bool = False, tuning: PeerTuning = PeerTuning()) -> None:
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
        self.chan = Channel(key=key, insecure=insecure, job=wire.job_id_to_int(job_id), sender=rank,
                            attempt=attempt, datagram_size=datagram_size,
                            max_chunks=max(16, -(-max_message // 64)), max_windows=4)
        self.reasm: Reassembler[tuple[int, int]] = Reassembler(4096, 1 << 28, max_message)
        self.state = PeerState.NEW        # states.PEER_TRANSITIONS: the only way it changes is _to()
        self.computing = -1               # the step the training thread computes (-1: none), in heartbeats
        self.welcome: ev.Welcome | None = None
        self.aggregate = False            # the log is the relay's aggregate (set from WELCOME)
        self.rank_ends: dict[int, int] = {}   # aggregate mode: rank -> last step (the cursor has one slot)
        self.error: str | None = None
        self.cursor: LogCursor | None = None
        self.inbox: dict[tuple[int, int], ev.Update] = {}
        self.inbox_nbytes = 0
        self.ready: deque[ev.Update] = deque()
        # ours, until the relay has them
        self.unacked = Outstanding(tuning.max_unacked, tuning.max_unacked_bytes, tuning.rto)
        self.next_step: int | None = None
        self.finish_step: int | None = None
        self.finish_acked = False
        self.known_high = [-1] * world_size
        # per rank: what the relay's STATUS says it holds contiguously (per-rank forwarding); known_high can
        # be ahead of it, since the relay forwards (t, r) before it has (t-1, r)
        self.status_high = [-1] * world_size
        self.missing: dict[tuple[int, int], list[float]] = {}   # key -> [first noticed, last NAK, NAKs]
        self.snaps = SnapshotFetch(self)
        self.failed: ev.Fail | None = None        # our FAIL, resent until the relay acknowledges it
        self.fail_acked = False
        self._last_fail = -1e18
        self.last_heard: float | None = None
        self._last_join = self._last_hb = -1e18
        self._last_tick = now
        self._out: list[bytes] = []
        self._events: deque[ev.PeerEvent] = deque()
        self.c: Counter[str] = Counter()

    # --- the snapshot download's state (peer/snapshot.py) -------------------------------------------
    @property
    def snap(self) -> SnapshotDownload | None:
        """The download in progress (None before its SNAP_INFO)."""
        return self.snaps.download

    @property
    def snapshot(self) -> tuple[int, NDArray[np.float32]] | None:
        """(step, params) of the last completed download."""
        return self.snaps.result

    @property
    def snap_into(self) -> NDArray[np.float32] | None:
        return self.snaps.into

    @snap_into.setter
    def snap_into(self, into: NDArray[np.float32] | None) -> None:
        self.snaps.into = into

    # --- application calls --------------------------------------------------------------------------
    def loading(self, now: float) -> None:
        """Tell the relay, every heartbeat interval until join(), that this task is alive and still
        materialising its partition (a slow partition is not a dead task)."""
        self._to(PeerTrigger.LOADING)
        self._last_hb = now
        self._out.append(self.chan.seal_control(ev.Loading()))

    def join(self, now: float) -> None:
        self._to(PeerTrigger.JOIN)
        self._send_join(now)

    def send_update(self, step: int, payload: bytes, meta: StepMeta | None, now: float) -> None:
        self._check_usable("send_update")
        if self.finish_step is not None:
            raise LocalProtocolError(f"rank {self.rank} already sent FINISHED({self.finish_step})")
        if type(step) is not int or step != self.next_step:
            raise LocalProtocolError(f"rank {self.rank} must send step {self.next_step} next (got {step!r}): "
                                     f"every step produces exactly one message, in order")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes (got {type(payload).__name__})")
        if len(self.unacked) >= self.tuning.max_unacked:
            raise LocalProtocolError(f"the relay has not acknowledged {len(self.unacked)} updates of rank "
                                     f"{self.rank}; refusing to buffer more")
        payload = bytes(payload)
        body = wire.encode_update_body(payload, meta)
        if not self.aggregate:            # aggregated: it reaches our log inside the relay's aggregate
            self.store(ev.Update(step, self.rank, payload, meta, now))
        self.unacked.add(step, body, now)
        self._out.extend(self.chan.seal_chunks(Kind.UPDATE, body, self.rank, step))
        self.next_step = step + 1
        self.computing = -1
        self.c["updates_sent"] += 1
        self.advance()

    def finish(self, last_step: int, now: float) -> None:
        self._check_usable("finish")
        assert self.next_step is not None      # WELCOME set it: joined states come after it
        if last_step != self.next_step - 1:
            raise LocalProtocolError(f"FINISHED({last_step}) but rank {self.rank}'s last sent step is "
                                     f"{self.next_step - 1}")
        if self.finish_step is None:
            self.finish_step = last_step
            self._rank_end(self.rank, last_step)
            self.advance()
        self._out.append(self.chan.seal_control(ev.Finished(last_step)))

    def leave(self) -> None:
        if self.state in (PeerState.JOINED, PeerState.JOINING):
            self._out.append(self.chan.seal_control(ev.Leave()))
        self._to(PeerTrigger.LEAVE)

    def request_snapshot(self, now: float) -> None:
        self._check_usable("fetch_snapshot")
        self.snaps.request(now)

    def fail(self, error_type: str, message: str, now: float, step: int = -1, fatal: bool = True,
             error_class: str = "TrainingError", cause: str = "") -> None:
        """Report a failure (FAIL; `fatal`: a deterministic one, events.Fail), joined or not; resent every
        ``heartbeat_interval`` until FAIL_ACK. The message and the cause are cut to what fits one
        datagram: a FAIL is never chunked."""
        text, cause = message[:ev.MAX_ERROR_TEXT], cause[:ev.MAX_ERROR_TEXT]
        while True:
            msg = ev.Fail(self.rank, self.attempt, error_type[-ev.MAX_ERROR_TYPE:], text, step, fatal,
                          error_class[-ev.MAX_ERROR_TYPE:], cause)
            if len(wire.encode_control(msg)[1]) <= self.chan.chunk_bytes or not (text or cause):
                break
            text, cause = text[:len(text) * 3 // 4], cause[:len(cause) * 3 // 4]
        self.failed = msg
        self.fail_acked = False
        self._last_fail = now
        self._out.append(self.chan.seal_control(msg))

    def begin_step(self, step: int) -> None:
        """The training thread computes ``step`` now (until its send_update): heartbeats say so."""
        self.computing = step

    def snapshot_destination(self, into: np.ndarray | None) -> None:
        """Where the next snapshot download lands (None: a new array). Checked here, not when the chunks
        arrive: a wrong buffer would otherwise fail inside receive_datagram, in the shell's I/O thread."""
        if into is not None and (not isinstance(into, np.ndarray) or into.dtype != np.float32
                                 or into.shape != (self.n_params,) or not into.flags.c_contiguous
                                 or not into.flags.writeable):
            raise ValueError(f"into must be a writable C-contiguous float32 array of shape ({self.n_params},)")
        self.snaps.into = into

    def has_ready(self) -> bool:
        """An update is deliverable (``pop_ready`` returns it)."""
        return bool(self.ready)

    def finished(self) -> bool:
        """The whole log is delivered: every rank ended and nothing of it is missing."""
        return self.cursor is not None and self.cursor.finished()

    def heard_at(self) -> float | None:
        """When an authenticated datagram last came from the relay (None: never)."""
        return self.last_heard

    def snapshot_progress(self) -> tuple[int, int] | None:
        """(chunks received, chunks in all) of the snapshot being downloaded; None before its SNAP_INFO."""
        return self.snaps.progress()

    def pop_ready(self) -> list[ev.Update]:
        out = list(self.ready)
        self.ready.clear()
        for u in out:
            self.inbox_nbytes -= len(u.payload)
        return out

    def blocking_key(self) -> tuple[int, int] | None:
        """The (step, rank) the log waits for (rank AGGREGATE_ORIGIN: the relay's aggregate), or None."""
        key = None if self.cursor is None else self.cursor.next_key()
        return (key[0], AGGREGATE_ORIGIN) if key is not None and self.aggregate else key

    @property
    def complete_through(self) -> int:
        return -1 if self.cursor is None else self.cursor.complete_through

    def idle(self) -> bool:
        """Nothing of ours is still unacknowledged (safe to leave)."""
        return not len(self.unacked) and (self.finish_step is None or self.finish_acked)

    def datagrams_to_send(self) -> list[bytes]:
        out, self._out = self._out, []
        self.c["datagrams_out"] += len(out)
        self.c["bytes_out"] += sum(len(d) for d in out)
        return out

    def next_event(self) -> ev.PeerEvent | None:
        return self._events.popleft() if self._events else None

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
        if self.missing or len(self.reasm) or self.snaps.requested:
            nxt = min(nxt, self._last_tick + self.tuning.tick)          # NAK timing is in milliseconds
        elif len(self.unacked) or (self.finish_step is not None and not self.finish_acked):
            # only retransmit timeouts are due (>= rto): a 2 ms tick here woke the receiver thread,
            # and took the GIL from training, ~30 times per training step for nothing
            nxt = min(nxt, self._last_tick + self.tuning.rto / 10)
        return nxt

    def counters(self) -> ev.Counters:
        d: ev.Counters = dict.fromkeys(("datagrams_in", "datagrams_out", "bytes_in", "bytes_out", "snapshot_bytes_in",
                           "retransmits", "updates_sent", "delivered", "naks_sent"), 0)
        d.update(self.c)
        d["drops"] = dict(self.chan.drops)
        d["unacked"] = len(self.unacked)
        d["complete_through"] = self.complete_through
        return d

    # --- input ---------------------------------------------------------------------------------------
    def receive_datagram(self, data: bytes, addr: ev.Address, now: float) -> None:
        self.c["datagrams_in"] += 1
        self.c["bytes_in"] += len(data)
        h = self.chan.parse(data, wire.MAX_DATAGRAM_SIZE)
        if h is None:
            return
        # the relay forwards an update chunk as its origin sealed it (sender = origin, another rank);
        # everything else comes from the relay itself
        forwarded = h.kind == Kind.UPDATE
        if forwarded and self.aggregate:    # the relay's own aggregate (retransmissions: the same bytes)
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
        if h.kind == Kind.FAIL_ACK:         # whatever our state: a failed peer may never have joined
            ack = self.chan.control(Kind.FAIL_ACK, body)   # h.kind, named for the checker
            if ack is not None and (ack.rank, ack.attempt) == (self.rank, self.attempt) and self.failed:
                self.fail_acked = True
                self._events.append(ack)
            return
        if self.state in (PeerState.CLOSED, PeerState.REJECTED):
            self.chan.drops["after_close"] += 1
            return
        if h.kind == Kind.UPDATE:
            receive_update_chunk(self, h, body, now)
            return
        if h.kind == Kind.SNAP_CHUNK:
            self.c["snapshot_bytes_in"] += len(data)  # the model's download, not training traffic
            self.snaps.on_chunk(h, body, now)
            return
        msg = self.chan.control(h.kind, body)
        if msg is None:
            return
        if isinstance(msg, ev.Reject):
            self._to(PeerTrigger.REJECT)
            self.fail_with(f"relay rejected rank {self.rank} (attempt {self.attempt}): {msg.reason}")
        elif isinstance(msg, ev.Welcome):
            self._on_welcome(msg)
        elif self.cursor is None:
            self.chan.drops["before_welcome"] += 1
        elif isinstance(msg, ev.Ack):
            for s in msg.steps:
                self.unacked.acked(s, now)
        elif isinstance(msg, ev.Nak):
            for item in msg.items:
                body = self.unacked.get(item.step) if item.origin == self.rank else None
                if body is None:
                    continue
                ds = self.chan.seal_chunks(Kind.UPDATE, body, self.rank, item.step, item.chunks or None)
                self._out.extend(ds)
                self.unacked.repaired(item.step)       # Karn: no RTT sample from a repaired step
                self.c["retransmits"] += len(ds)
        elif isinstance(msg, ev.Status):
            self._on_status(msg)
        elif isinstance(msg, ev.SnapInfo):
            self.snaps.on_info(msg, now)
        else:
            self.chan.drops["unexpected_kind"] += 1

    def _on_welcome(self, msg: ev.Welcome) -> None:
        if self.state != PeerState.JOINING or self.welcome is not None:
            return                                     # a duplicate WELCOME (our JOIN was retransmitted)
        if msg.n_params != self.n_params or msg.world_size != self.world_size:
            self._to(PeerTrigger.REJECT)
            self.fail_with(f"relay runs a job with n_params={msg.n_params}, world_size={msg.world_size}; "
                            f"rank {self.rank} has n_params={self.n_params}, world_size={self.world_size}")
            return
        self.welcome = msg
        self._to(PeerTrigger.WELCOME)
        self.aggregate = msg.aggregate
        self.cursor = LogCursor(1 if msg.aggregate else self.world_size, msg.start_step)
        if msg.aggregate:
            self.known_high[0] = msg.complete_through
        self.next_step = msg.start_step
        self._events.append(ev.Welcomed(msg))

    def _on_status(self, msg: ev.Status) -> None:
        assert self.cursor is not None         # receive_datagram drops a STATUS before WELCOME
        if msg.start_step != self.cursor.start_step or msg.world_size != self.world_size:
            self.chan.drops["stale_status"] += 1
            return
        first = msg.first_rank           # one page of ranks: the others come in other pages
        if self.aggregate:               # the relay made (and sent) every aggregate it has applied
            self.known_high[0] = max(self.known_high[0], msg.complete_through)
        else:
            for r, h in enumerate(msg.have, first):
                if h > self.known_high[r]:
                    self.known_high[r] = h
                if h > self.status_high[r]:
                    self.status_high[r] = h
        if first <= self.rank < first + len(msg.have):
            own = msg.have[self.rank - first]
            self.unacked.acked_through(own)
        for e in msg.ended:
            if e.rank == self.rank:
                if e.gone:
                    self.fail_with(f"the relay declared rank {self.rank} gone at step {e.last_step}")
                elif self.finish_step == e.last_step:
                    self.finish_acked = True
                continue
            if e.rank not in (self.rank_ends if self.aggregate else self.cursor.ends):
                self._rank_end(e.rank, e.last_step)
                self._events.append(ev.PeerEnded(e.rank, e.last_step, e.gone,
                                                 "declared gone" if e.gone else "finished"))
        self.advance()

    def store(self, u: ev.Update, slot: int | None = None) -> None:
        key = (u.step, u.sender if slot is None else slot)
        self.inbox[key] = u
        self.inbox_nbytes += len(u.payload)
        self.missing.pop(key, None)

    def _rank_end(self, rank: int, last_step: int) -> None:
        """Rank ``rank`` has no step after ``last_step``. Aggregated, the log (one slot) ends once every
        rank has ended, at the latest of their ends: each step up to it has a message of some rank."""
        assert self.cursor is not None         # WELCOME set it: joined states come after it
        if not self.aggregate:
            self.cursor.end(rank, last_step)
            self._drop_after_end(rank, last_step)
            return
        self.rank_ends[rank] = last_step
        if len(self.rank_ends) == self.world_size:
            end = max(self.rank_ends.values())
            self.cursor.end(0, end)
            self._drop_after_end(0, end)

    def _drop_after_end(self, rank: int, last_step: int) -> None:
        for key in [k for k in self.inbox if k[1] == rank and k[0] > last_step]:
            self.inbox_nbytes -= len(self.inbox.pop(key).payload)
        self.reasm.discard_where(lambda k: k[1] == rank and k[0] > last_step)
        for key in [k for k in self.missing if k[1] == rank and k[0] > last_step]:
            del self.missing[key]

    def advance(self) -> None:
        cur = self.cursor
        assert cur is not None                 # WELCOME set it: joined states come after it
        while True:
            key = cur.next_key()
            if key is None:
                return
            u = self.inbox.pop(key, None)
            if u is None:
                return
            self.ready.append(u)
            self.c["delivered"] += 1
            cur.advance()

    def current_rto(self) -> float:
        """Retransmit timeout: RFC 6298 from ACK round trips, never below the configured ``rto``. Under
        load the round trip grows (queues); a fixed timeout would then retransmit what is merely late."""
        return self.unacked.rto()

    # --- timers --------------------------------------------------------------------------------------
    def handle_timer(self, now: float) -> None:
        self._last_tick = now
        if self.failed is not None and not self.fail_acked and now >= self._last_fail + self.tuning.heartbeat_interval:
            self._last_fail = now
            self._out.append(self.chan.seal_control(self.failed))   # sealed anew: the relay drops replays
        if self.state == PeerState.JOINING:
            if now >= self._last_join + self.tuning.rto:
                self._send_join(now)
            return
        if self.state == PeerState.LOADING:
            if now >= self._last_hb + self.tuning.heartbeat_interval:
                self._last_hb = now
                self._out.append(self.chan.seal_control(ev.Loading()))
            return
        if self.state != PeerState.JOINED:
            return
        assert self.next_step is not None      # WELCOME set it: joined states come after it
        if now >= self._last_hb + self.tuning.heartbeat_interval:
            self._last_hb = now
            self._out.append(self.chan.seal_control(ev.Heartbeat(self.complete_through, self.next_step - 1,
                                                                 self.computing)))
            if self.finish_step is not None and not self.finish_acked:
                self._out.append(self.chan.seal_control(ev.Finished(self.finish_step)))
        for step in self.unacked.due(now):           # exponential backoff
            body = self.unacked.get(step)
            assert body is not None            # due() names only the steps it holds
            ds = self.chan.seal_chunks(Kind.UPDATE, body, self.rank, step)
            self._out.extend(ds)
            self.c["retransmits"] += len(ds)
            self.c["timeouts"] += 1
        nak_missing(self, now)
        self.reasm.expire(now, 30.0)
        self.snaps.on_timer(now)

    # --- helpers -------------------------------------------------------------------------------------
    def fail_with(self, error: str, event: type[ev.Rejected | ev.SnapshotFailed] = ev.Rejected) -> None:
        """This peer cannot go on: every later call raises ``error``; the shell learns it from the event
        (a repeated cause, e.g. one STATUS page per heartbeat, is told once)."""
        if error != self.error:
            self.error = error
            self._events.append(event(error))

    def send(self, msg: ev.ControlMessage) -> None:
        self._out.append(self.chan.seal_control(msg))

    def emit(self, event: ev.PeerEvent) -> None:
        self._events.append(event)

    def _to(self, trigger: PeerTrigger) -> None:
        self.state = transition(PEER_TRANSITIONS, self.state, trigger, f"peer rank {self.rank}")

    def _send_join(self, now: float) -> None:
        self._last_join = now
        self._out.append(self.chan.seal_control(ev.Join(self.n_params, self.world_size)))

    def _check_usable(self, what: str) -> None:
        if self.error:
            raise LocalProtocolError(f"{what}: {self.error}")
        if self.state != PeerState.JOINED:
            raise LocalProtocolError(f"{what} needs a joined peer (state {self.state}); call join() first")
