"""The relay's protocol state machine, sans I/O (STYLE 1; aioquic ``quic/connection.py``, h11).

``receive_datagram(data, addr, now)`` consumes one datagram; ``datagrams_to_send()`` returns
``[(bytes, addr)]``; ``next_event()`` returns events; ``next_timer()``/``handle_timer(now)`` drive time.
No sockets, threads or clocks here: the shell in ``relay.py`` moves bytes and passes ``now``, and learns
what happened from ``next_event()``. Its parts: the rank table and each rank's lifecycle (``ranks.py``,
``states.py``), the bounded history trimmed in step order (``history.py``), snapshot serving
(``snapshots.py``).

What the relay does (docs/design.md Transport + Consistency):
- admits ranks 0..W-1 of the current attempt (JOIN → WELCOME with n_params/world_size/start_step);
  a higher attempt cuts the log at ``complete_through`` and restarts it at ``complete_through + 1``;
- reassembles updates, validates them (``decode_update``) BEFORE they enter the log, acknowledges them,
  and forwards each complete update once to every other joined peer: the origin's own sealed datagrams,
  unchanged (no AEAD per chunk at the relay; retransmissions from history are the same bytes);
- learns per rank how late chunks may be before it NAKs them (``LateAllowance``): fast repair on a lossy
  link, no spurious retransmits on a loaded machine;
- applies the log in canonical (step, rank) order to its authoritative parameters (``apply_update``);
- or, with ``forwarding="aggregate"``, forwards nothing per rank: once a step's row is
  complete it adds the row into its own residual (``aggregator``, encoding/aggregate.py), seals ONE
  re-encoded message of origin AGGREGATE_ORIGIN, applies only that, sends it to every peer and keeps it
  in the history for NAK repair; WELCOME tells the peers;
- answers NAKs from a bounded history; NAKs its own partial inbound updates;
- liveness: a rank silent for ``liveness_timeout`` is *suspected*; what follows is the
  ``on_rank_loss`` policy: "wait" (the log waits; after ``give_up_after`` s of silence a fatal
  incident), "continue" (declared gone, cut at the last step it holds contiguously) or "restart" (every
  live rank of the attempt is rejected, so Spark retries the stage, which resumes with nothing skipped).
  A rank not heard at all in an attempt has ``join_window`` s from the attempt's start instead; a task
  still materialising its partition says LOADING. A heartbeat naming the same ``computing`` step for
  ``step_timeout`` s is a fatal "stuck" incident. Every suspicion, cut and give-up is an ``Incident``
  in ``incidents`` (bounded), the first cause the driver reports;
- accounts every applied update's meta per (rank, epoch) in ``epochs`` (bounded), so the history of a
  retried stage includes the steps of the attempts before it (rank 0's validation score of an epoch
  too, from the message after it scored it);
- keeps what a new attempt inherits besides the parameters (``AttemptNotes``): rank 0's early-stopping
  state and stop decision as of the cut, handed over in WELCOME's notes; and, given a ``rollback``
  (checkpoints), restarts a retried stage's log at the last checkpoint instead of at
  ``complete_through + 1``: the parameters, tallies and notes go back to that step;
- serves snapshots (parameters + step) as a paced, NAK-repaired chunk stream (``snapshots.py``);
- records FAIL (a rank's deterministic error, joined or not) and acknowledges it: the driver stops the
  job on it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from gradshare.errors import DecodeError
from gradshare.hashing import param_hash
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.history import History, StepKeys
from gradshare.transport.protocol.ranks import RankState, RankTable
from gradshare.transport.protocol.reassembly import Reassembler
from gradshare.transport.protocol.snapshots import SnapshotServer, Transfer
from gradshare.transport.protocol.tallies import MAX_EPOCH_ROWS, AttemptNotes, EpochTally
from gradshare.transport.protocol.states import RankTrigger
from gradshare.transport.protocol.wire import AGGREGATE_ORIGIN, RELAY_ID, Kind

# The transport's one seam to the encoding package: imported where used (the default codec, the
# aggregator), as importing gradshare.encoding loads Numba, +0.6 s on `import gradshare.transport`, which
# `gradshare --help` pays (the CLI imports relay_main to build its parser): 0.38 s -> 0.94 s measured.
if TYPE_CHECKING:
    from gradshare.encoding.aggregate import AggregateState
    from gradshare.encoding.update import StepUpdate

# Any, for a decoded update: the core only holds it between decode_update and apply_update, which come as
# a pair (the encoding package's StepUpdate by default; tests plug in a toy codec)
Decoded = Any
# what `rollback` answers: (through, params, epochs_done, note); see RelayCore.__init__
RollbackPoint = tuple[int, NDArray[np.float32], int, float]


def _total_len(datagrams: tuple[bytes, ...]) -> int:
    return sum(len(d) for d in datagrams)


def default_decode_update(payload: bytes, n_params: int) -> StepUpdate:
    """Decode with the encoding package: a step update of exactly ``n_params`` parameters and no
    buffers (every index is validated there)."""
    from gradshare.encoding import decode_update

    return decode_update(payload, n_params, n_params=n_params)


def default_apply_update(decoded: StepUpdate, params: NDArray[np.float32], scale: float = 1.0) -> None:
    from gradshare.encoding import apply_update

    apply_update(decoded, params, scale)


ON_RANK_LOSS = ("wait", "continue", "restart")
FORWARDING = ("per-rank", "aggregate")
MAX_INCIDENTS = 256


class _Chunk(NamedTuple):
    """An update chunk the relay stored (`RelayCore.receive_run`): its header but for counter and index
    (wire.header_key), its rank, session, step and chunk count."""

    key: tuple[bytes, bytes, bytes]
    rank: RankState
    session: int
    step: int
    chunks: int


class RelayCore:
    def __init__(self, params: np.ndarray, world_size: int, key: bytes | None, job_id: int | str, *,
                 now: float, datagram_size: int = wire.DEFAULT_DATAGRAM_SIZE, liveness_timeout: float = 30.0,
                 insecure: bool = False,
                 decode_update: Callable[[bytes, int], Decoded] = default_decode_update,
                 apply_update: Callable[[Decoded, NDArray[np.float32]], None] = default_apply_update,
                 history_entries: int = 1 << 16, history_bytes: int = 1 << 29,
                 reassembly_messages: int = 4096, reassembly_bytes: int = 1 << 28,
                 max_ahead: int = 4096, nak_delay: float = 0.004, tick: float = 0.002,
                 snapshot_rate: float = 50e6, snapshot_burst: int = 1 << 20,
                 snapshot_datagram_size: int | None = None, max_snapshots: int = 2,
                 defer_apply: bool = False, on_rank_loss: str = "wait", give_up_after: float = 60.0,
                 join_window: float | None = None, step_timeout: float | None = None,
                 rollback: Callable[[int], RollbackPoint | None] | None = None,
                 forwarding: str = "per-rank", aggregator: AggregateState | None = None) -> None:
        """rollback: None, or ``rollback(complete_through) -> None | (through, params, epochs_done, note)``,
        asked when a new attempt starts: the log restarts after step `through` (<= complete_through) from
        `params` (the state the log holds through it), per-(rank, epoch) tallies of epochs >= epochs_done
        (counted in the log's epochs) are dropped, and WELCOME's notes add ``("checkpoint", note)``.
        The trainer's reads the last checkpoint (checkpoint.py); it is called under the relay's lock."""
        params = np.asarray(params)
        if params.dtype != np.float32 or params.ndim != 1 or params.size < 1:
            raise ValueError(f"initial_params must be a non-empty 1-D float32 array (got {params.dtype}, "
                             f"shape {params.shape})")
        if type(world_size) is not int or not 1 <= world_size <= ev.MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in [1, {ev.MAX_WORLD_SIZE}] (got {world_size!r})")
        if not liveness_timeout > 0:
            raise ValueError(f"liveness_timeout must be > 0 (got {liveness_timeout})")
        if on_rank_loss not in ON_RANK_LOSS:
            raise ValueError(f"on_rank_loss must be one of {ON_RANK_LOSS} (got {on_rank_loss!r})")
        if forwarding not in FORWARDING:
            raise ValueError(f"forwarding must be one of {FORWARDING} (got {forwarding!r})")
        for name, value in (("give_up_after", give_up_after), ("join_window", join_window),
                            ("step_timeout", step_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (got {value!r})")
        self.on_rank_loss = on_rank_loss
        # "aggregate": ranks' messages are not forwarded; once a step's row is complete
        # the relay sends ONE message re-encoded from its own residual (encoding/aggregate.py) to every
        # peer, under origin AGGREGATE_ORIGIN, and applies only that one itself
        self.forwarding = forwarding
        if forwarding == "aggregate" and aggregator is None:
            from gradshare.encoding.aggregate import AggregateState

            aggregator = AggregateState(int(np.asarray(params).size))
        self.aggregator = aggregator if forwarding == "aggregate" else None
        self.give_up_after = float(give_up_after)
        self.join_window = float(join_window if join_window is not None else liveness_timeout)
        self.step_timeout = step_timeout
        self.rollback = rollback
        self.notes = AttemptNotes()                      # rank 0's epoch-end state, in log order
        self.attempt_notes: tuple[tuple[str, float], ...] = ()  # what this attempt's WELCOME hands over
        self.rolled_back: list[dict[str, int]] = []      # one entry per rollback: the attempt and the step
        self.params: NDArray[np.float32] = np.array(params, dtype=np.float32, copy=True)
        self.n_params = int(params.size)
        self.world_size = world_size
        self.liveness_timeout = float(liveness_timeout)
        self.decode_update = decode_update
        self.apply_update = apply_update
        # the largest message an update can be: a dense float32 vector plus framing (encoder forms are smaller)
        max_message = 8 * self.n_params + 65536
        self.chan = Channel(key=key, insecure=insecure, job=wire.job_id_to_int(job_id), sender=RELAY_ID,
                            attempt=0, datagram_size=datagram_size,
                            max_chunks=max(16, -(-max_message // 64)), max_windows=4 * world_size + 8)
        self.max_chunks_update = -(-max_message // self.chan.chunk_bytes)
        # STATUS pages: a page's worst case is ~16 bytes per rank + 32 of framing (events.STATUS_PAGE_RANKS)
        self.status_ranks = max(1, min(ev.STATUS_PAGE_RANKS, (self.chan.chunk_bytes - 32) // 16))
        self.status_pages = -(-world_size // self.status_ranks)
        self._status_turn = [0] * world_size       # per rank: which page its next heartbeat gets
        # the pages as last built: every peer's heartbeat (20/s each) is answered with one, so at N = 32
        # a page is asked for ~640 times a second and changes far less often. A page is rebuilt when
        # its key moves: the attempt (a new cursor and rank table), complete_through, or the page's
        # change count, bumped where one of its ranks gets an update (_on_update_chunk) or ends (_end)
        self._pages: dict[int, tuple[tuple[int, int, int], ev.Status]] = {}
        self._page_changes = [0] * self.status_pages
        # snapshot chunks may travel in larger datagrams than updates (loopback: one per 64 kB instead of
        # one per 1.4 kB, so sealing and opening them is not what a worker waits for); peers accept any
        # datagram from the relay up to wire.MAX_DATAGRAM_SIZE
        snap_size = wire.check_datagram_size(snapshot_datagram_size or datagram_size)
        snap_chunk = self.chan.chunk_bytes + snap_size - datagram_size
        self.snap_chunk_bytes = snap_chunk - snap_chunk % 4
        # snapshot serving (snapshots.py): paced at snapshot_rate, at most snapshot_burst bytes a tick
        # however late the tick (a burst must fit the receivers' socket buffers: the shell caps it from its
        # own, relay.py); a transfer idle for max(10 s, liveness_timeout) is dropped
        self.snaps = SnapshotServer(self.snap_chunk_bytes, snapshot_rate, snapshot_burst, max_snapshots,
                                    max(10.0, float(liveness_timeout)))
        # the relay's own aggregates (forwarding="aggregate") travel in datagrams of the same size: the
        # relay seals them, so unlike a rank's forwarded datagrams their size is its choice, and one
        # sendto per peer instead of ~16 is most of what an aggregate costs the relay on loopback
        self.aggregate_chunk_bytes = snap_chunk
        # the origin's sealed datagrams are kept and forwarded unchanged: every peer holds the job key, so
        # re-sealing each chunk would cost an AEAD operation per chunk and buy nothing (the origin's
        # authentication covers the header, origin and step included)
        self.reasm: Reassembler[tuple[int, int]] = Reassembler(reassembly_messages, reassembly_bytes, max_message,
                                                               keep_raw=True)
        self.history: History[tuple[int, int], tuple[bytes, ...]] = History(history_entries, history_bytes,
                                                                             size=_total_len, by_step=True)
        self.max_ahead = max_ahead
        self.nak_delay = nak_delay
        self.tick = tick
        # defer_apply: receive_datagram only forwards; apply_pending() applies (the shell calls it after
        # sending, so applying to the authoritative copy never delays a forward)
        self.defer_apply = defer_apply
        self._apply_due = False
        self._trim_due = False
        self.attempt = -1                      # no attempt yet; the first JOIN starts one
        self.attempt_started: float | None = None
        self.cursor = LogCursor(world_size, 0)
        self.ranks = RankTable(world_size, now, nak_delay)
        self.pending: dict[tuple[int, int], Decoded] = {}    # (step, rank) -> decoded, validated, not applied
        self.pending_meta: dict[tuple[int, int], ev.Meta] = {}  # their meta, accounted when applied
        self.epochs: dict[tuple[int, int], EpochTally] = {}  # (rank, epoch) -> the applied steps' meta
        self.incidents: list[ev.Incident] = []           # the first MAX_INCIDENTS, in order
        self._restart_reason: str | None = None          # on_rank_loss="restart" fired in this attempt
        self.evicted = StepKeys()                        # history entries lost to the caps (NAK → error)
        self._trim_floor = -2                            # the floor the last trim dropped through
        self.failures: dict[int, ev.Fail] = {}           # rank -> its latest FAIL (any attempt)
        self._out: list[tuple[bytes, ev.Address]] = []
        self._events: deque[ev.RelayEvent] = deque()
        self._acks: dict[int, list[int]] = {}
        self._last_tick = now
        self._last_now = now                  # the latest datagram's time: aggregates are sent "now"
        self._log_complete_sent = False
        self.c: Counter[str] = Counter()                # counters (drops live in chan.drops)
        self.recent: dict[tuple[int, int], float] = {}  # (step, origin) -> forwarded at, the last nak_delay

    # --- public surface of the core ----------------------------------------------------------------
    @property
    def complete_through(self) -> int:
        return self.cursor.complete_through

    @property
    def transfers(self) -> dict[int, Transfer]:
        """rank -> its snapshot transfer in flight."""
        return self.snaps.transfers

    @property
    def drops(self) -> Counter[str]:
        return self.chan.drops

    def datagrams_to_send(self) -> list[tuple[bytes, ev.Address]]:
        if self._acks:
            self._flush_acks()
        if not self._out:
            return []                  # the common case: the shell asks after every datagram it feeds in
        out, self._out = self._out, []
        self.c["datagrams_out"] += len(out)
        self.c["bytes_out"] += sum(len(data) for data, _ in out)
        return out

    def next_event(self) -> ev.RelayEvent | None:
        return self._events.popleft() if self._events else None

    def next_timer(self) -> float:
        # tick only while something may need a NAK or pacing; otherwise 10 Hz is enough for liveness and
        # housekeeping (a fixed 2 ms tick cost the driver ~4 % of a core for the whole fit)
        busy = self.transfers or len(self.reasm)
        return self._last_tick + (self.tick if busy else 0.1)

    def finished(self) -> bool:
        return self.cursor.finished() and not self._apply_due

    @property
    def has_work(self) -> bool:
        """The last datagram left something for the shell: datagrams to send, an apply, an event."""
        return bool(self._out or self._acks or self._apply_due or self._events)

    @property
    def apply_due(self) -> bool:
        """An update completed since the last apply_pending() (with defer_apply: the shell's cue)."""
        return self._apply_due

    def counters(self) -> ev.Counters:
        d: ev.Counters = dict.fromkeys(
                          ("datagrams_in", "datagrams_out", "bytes_in", "bytes_out", "retransmits", "forwarded",
                           "updates_in", "update_datagrams", "applied", "naks_sent", "aggregates"), 0)
        d.update(self.c)
        d["drops"] = dict(self.chan.drops)
        d["peers"] = len(self.ranks.connected())
        d["ended"] = sum(1 for r in self.ranks if r.ended is not None)
        d["last_step"] = max(self.ranks.have(self.cursor.start_step), default=-1)
        d["complete_through"] = self.complete_through
        d["attempt"] = self.attempt
        d["history_entries"] = len(self.history)
        d["history_bytes"] = self.history.nbytes
        return d

    def param_hash(self) -> str:
        """param_hash of the authoritative parameters."""
        return param_hash(self.params)

    def copy_params(self) -> NDArray[np.float32]:
        return self.params.copy()

    def epoch_tallies(self) -> dict[tuple[int, int], dict[str, float | None]]:
        """(rank, epoch) -> what the applied log says about it (EpochTally.as_dict)."""
        return {k: t.as_dict() for k, t in self.epochs.items()}

    def cap_snapshot_burst(self, nbytes: int) -> None:
        """A pacing tick sends at most ``nbytes`` of snapshot (the shell knows the socket buffers)."""
        self.snaps.cap_burst(nbytes)

    def progress(self) -> dict[str, object]:
        return {
            "complete_through": self.complete_through,
            "attempt": self.attempt,
            "start_step": self.cursor.start_step,
            "ranks": {r.rank: {"joined": r.joined, "have": r.received.contiguous_from(self.cursor.start_step) - 1,
                               "ended": None if r.ended is None else
                               {"last_step": r.ended.last_step, "gone": r.ended.gone},
                               "updates_in": r.updates_in, "bytes_in": r.bytes_in,
                               "meta": dict(r.meta) if r.meta else None}
                      for r in self.ranks},
        }

    # --- input ---------------------------------------------------------------------------------------
    def receive_run(self, run: list[bytes], i: int, addr: ev.Address, now: float) -> int:
        """Feed ``run[i:]``, the datagrams of one read (all from ``addr``), up to the first that leaves work
        for the shell (``has_work``); the index after it.

        Why (N = 32 latency): with GRO a read holds the ~12 chunks of one rank's update. A chunk
        whose header equals the one before it but for its counter and chunk index skips the checks that one
        passed (`_next_chunk`): between the two only a partial update gained a chunk, which none of them
        reads. Each chunk is still authenticated and replay-checked on its own."""
        last: _Chunk | None = None
        while i < len(run):
            data = run[i]
            i += 1
            if last is None or not self._next_chunk(last, data, now):
                last = self._receive(data, addr, now)
            if self.has_work:
                break
        return i

    def receive_datagram(self, data: bytes, addr: ev.Address, now: float) -> None:
        self._receive(data, addr, now)

    def _receive(self, data: bytes, addr: ev.Address, now: float) -> _Chunk | None:
        """One datagram; the update chunk it stored (the next chunk of the same update may follow it
        through `_next_chunk`), or None."""
        self.c["datagrams_in"] += 1
        self.c["bytes_in"] += len(data)
        h = self.chan.parse(data)
        if h is None:
            return None
        if h.sender >= self.world_size:
            self.chan.drops["bad_sender"] += 1
            return None
        if h.attempt < self.attempt:
            self.chan.drops["old_attempt"] += 1
            return None
        if h.kind == Kind.FAIL:              # accepted unjoined: a rank may fail before it could join
            body = self.chan.open(h, data)
            if body is not None:
                self._on_fail(h, body, addr)
            return None
        if h.kind not in (Kind.JOIN, Kind.LOADING) and h.attempt != self.attempt:
            self.chan.drops["unknown_attempt"] += 1
            return None
        body = self.chan.open(h, data)
        if body is None:
            return None
        rs = self.ranks[h.sender] if h.attempt == self.attempt else None
        if h.kind == Kind.JOIN:
            self._on_join(h, body, addr, now)
            return None
        if h.kind == Kind.LOADING:
            self._on_loading(h, body, now)
            return None
        if rs is None or not rs.joined or rs.session != h.session:
            self.chan.drops["not_joined"] += 1
            return None
        if rs.left:
            self.chan.drops["after_leave"] += 1
            return None
        self._heard(rs, now)
        rs.addr = addr                         # authenticated: follow a NAT rebinding
        if h.kind == Kind.UPDATE:
            if self._on_update_chunk(rs, h, body, data, now):
                return _Chunk(wire.header_key(data), rs, h.session, h.step, h.count)
            return None
        msg = self.chan.control(h.kind, body)
        if msg is None:
            return None
        if isinstance(msg, ev.Heartbeat):
            rs.delivered_through = max(rs.delivered_through, msg.delivered_through)
            rs.sent_through = max(rs.sent_through, msg.sent_through)
            if msg.computing != rs.computing:
                rs.computing, rs.computing_since = msg.computing, now
            # one STATUS page per heartbeat, the pages in turn: a heartbeat's answer stays one datagram
            # at any world size, and each peer still sees every rank every `pages` heartbeats
            turn = self._status_turn[rs.rank]
            self._status_turn[rs.rank] = turn + 1
            self._send(rs, self._status(turn % self.status_pages))
            # trim on the next timer, not per heartbeat: a trim scans every rank, and N ranks each
            # heartbeating made that O(N²) per second
            self._trim_due = True
        elif isinstance(msg, ev.Nak):
            self._on_nak(rs, msg, now)
        elif isinstance(msg, ev.Finished):
            self._on_finished(rs, msg.last_step)
        elif isinstance(msg, ev.Leave):
            self._on_leave(rs)
        elif isinstance(msg, ev.SnapRequest):
            self._on_snap_request(rs, now)
        elif isinstance(msg, ev.SnapNak):
            if not self.snaps.nak(rs.rank, msg.snap_id, msg.ranges, now):
                self.chan.drops["stale_snapshot"] += 1
        elif isinstance(msg, ev.SnapDone):
            self.snaps.done(rs.rank, msg.snap_id)
        else:
            self.chan.drops["unexpected_kind"] += 1
        return None

    def _on_fail(self, h: wire.Header, body: bytes, addr: ev.Address) -> None:
        """Record a rank's failure, fatal or not (one per rank: ``failures`` stays bounded) and
        acknowledge it; the FAIL is retransmitted until acknowledged, so duplicates are normal."""
        msg = self.chan.control(Kind.FAIL, body)
        if msg is None:
            return
        if msg.rank != h.sender or msg.attempt != h.attempt:
            self.chan.drops["bad_fail"] += 1
            return
        known = self.failures.get(msg.rank)
        if known is None or known.attempt != msg.attempt:
            self.failures[msg.rank] = msg
            self.c["failures"] += 1
            self._events.append(ev.PeerFailed(msg.rank, msg.attempt, msg.error_type, msg.message, msg.step,
                                              msg.fatal, msg.error_class, msg.cause))
        self._send_to(addr, ev.FailAck(msg.rank, msg.attempt))

    # --- liveness ------------------------------------------------------------------------------------
    def _heard(self, rs: RankState, now: float) -> None:
        if rs.suspected_since is not None:
            self._incident("back", rs, now - rs.suspected_since, now)
            rs.suspected_since = None
        rs.heard = True
        rs.last_heard = now

    def _on_loading(self, h: wire.Header, body: bytes, now: float) -> None:
        if self.chan.control(Kind.LOADING, body) is None:
            return
        if h.attempt > self.attempt:
            self._start_attempt(h.attempt, now)    # a stage's first task to speak starts its attempt
        self._heard(self.ranks[h.sender], now)

    def owed_step(self, rs: RankState) -> int:
        """The step of this rank the log waits for next."""
        return rs.received.contiguous_from(self.cursor.start_step)

    def _incident(self, kind: str, rs: RankState, seconds: float, now: float, detail: str = "",
                  step: int | None = None) -> ev.Incident:
        step = self.owed_step(rs) if step is None else step
        inc = ev.Incident(kind, rs.rank, max(self.attempt, 0), min(step, ev.MAX_STEP), max(seconds, 0.0), now,
                          detail)
        if len(self.incidents) < MAX_INCIDENTS:
            self.incidents.append(inc)
        else:
            self.c["incidents_dropped"] += 1
        self.c[f"incident_{kind}"] += 1
        self._events.append(inc)
        return inc

    def first_cause(self) -> ev.Incident | None:
        return ev.first_cause(self.incidents)

    def fatal_incident(self) -> ev.Incident | None:
        return ev.first_fatal(self.incidents)

    def _check_liveness(self, now: float) -> None:
        if self.attempt_started is None:
            return
        if self._restart_reason is not None:      # resent every tick: a REJECT is one datagram, and may be lost
            for r in self.ranks:
                if r.connected and r.ended is None and r.suspected_since is None:
                    self._send(r, ev.Reject(self._restart_reason))
        for rs in self.ranks:
            if rs.ended is not None:
                continue
            # progress, not presence: a process that answers but whose training thread has been in the
            # same step for step_timeout (a paused process is the silence rule's, below)
            if (self.step_timeout is not None and rs.computing >= 0 and not rs.given_up
                    and now - rs.computing_since > self.step_timeout and now - rs.last_heard < self.liveness_timeout):
                rs.given_up = True
                self._incident("stuck", rs, now - rs.computing_since, now,
                               f"step_timeout={self.step_timeout:g} s; its process still answers", rs.computing)
            if rs.heard:
                silent, bound, what = now - rs.last_heard, self.liveness_timeout, "liveness_timeout"
            else:   # never heard in this attempt: the join window runs from the attempt's start
                silent, bound, what = now - self.attempt_started, self.join_window, "join_window"
            if silent <= bound:
                continue
            if rs.suspected_since is None:
                rs.suspected_since = rs.last_heard if rs.heard else self.attempt_started
                self._incident("suspected", rs, silent, now, f"{what}={bound:g} s")
                if self.on_rank_loss == "continue":
                    self._declare_gone(rs, f"silent for more than {bound:g} s ({what}); on_rank_loss='continue'",
                                       now, silent)
                    continue
                if self.on_rank_loss == "restart" and self._restart_reason is None:
                    self._restart(rs, silent, now)
            if self.on_rank_loss == "wait" and silent > max(bound, self.give_up_after) and not rs.given_up:
                rs.given_up = True        # one fatal incident per rank
                self._incident("silent", rs, silent, now, f"on_rank_loss='wait' waits at most {self.give_up_after:g} s")

    def _restart(self, rs: RankState, silent: float, now: float) -> None:
        """on_rank_loss="restart": reject every live rank of the attempt, so their tasks fail and Spark
        retries the barrier stage; the new attempt resumes after complete_through (nothing skipped)."""
        self._incident("restart", rs, silent, now, "on_rank_loss='restart'")
        self._restart_reason = (f"stage restart: rank {rs.rank} silent for {silent:.1f} s at step "
                                f"{self.owed_step(rs)} (on_rank_loss='restart')")

    # --- join / attempts -----------------------------------------------------------------------------
    def _on_join(self, h: wire.Header, body: bytes, addr: ev.Address, now: float) -> None:
        msg = self.chan.control(Kind.JOIN, body)
        if msg is None:
            return
        reject = None
        if msg.world_size != self.world_size:
            reject = f"world_size {msg.world_size} does not match the relay's {self.world_size}"
        elif msg.n_params != self.n_params:
            reject = f"n_params {msg.n_params} does not match the relay's {self.n_params}"
        if reject:
            self._send_to(addr, ev.Reject(f"rank {h.sender}: {reject}"))
            self.c["rejects"] += 1
            return
        if h.attempt > self.attempt:
            self._start_attempt(h.attempt, now)
        rs = self.ranks[h.sender]
        if rs.session is not None and rs.session != h.session:
            if rs.ended is not None or len(rs.received):
                self._send_to(addr, ev.Reject(
                    f"rank {h.sender} of attempt {h.attempt} already joined and sent updates; "
                    f"a restarted task must join with a higher attempt"))
                self.c["rejects"] += 1
                return
        if rs.ended is not None and rs.ended.gone:
            self._send_to(addr, ev.Reject(f"rank {h.sender} was declared gone at step {rs.ended.last_step}; "
                                          f"a retried stage must join with a higher attempt"))
            self.c["rejects"] += 1
            return
        first = not rs.joined or rs.session != h.session
        rs.session = h.session
        rs.addr = addr
        rs.to(RankTrigger.JOIN)
        self._heard(rs, now)
        self._send(rs, ev.Welcome(self.n_params, self.world_size, self.cursor.start_step,
                                  self.complete_through, self.attempt_notes, self.aggregator is not None))
        for page in range(self.status_pages):
            self._send(rs, self._status(page))
        if first:
            self._events.append(ev.PeerJoined(rs.rank, h.attempt, addr))

    def _start_attempt(self, attempt: int, now: float) -> None:
        """A retried stage: drop everything after complete_through (or after the checkpoint `rollback`
        names) and restart the log after it."""
        self.apply_pending()                   # complete_through must be current before it becomes the cut
        base = self.complete_through + 1
        extra: tuple[tuple[str, float], ...] = ()
        point = None if self.rollback is None else self.rollback(self.complete_through)
        if point is not None:
            through, params, epochs_done, note = point
            if not -1 <= through <= self.complete_through or np.shape(params) != self.params.shape:
                raise ValueError(f"rollback to step {through} with {np.shape(params)} values: the relay holds "
                                 f"the log through {self.complete_through} and {self.params.shape} values")
            np.copyto(self.params, params)
            base = through + 1
            self.notes.cut(through)
            for key in [k for k in self.epochs if k[1] >= epochs_done]:  # those epochs run again, whole
                del self.epochs[key]
            if self.c["attempts"]:             # a retried stage (the first attempt of a resumed fit is none)
                self.rolled_back.append({"attempt": attempt, "from": self.complete_through, "to": through})
                self._events.append(ev.RolledBack(attempt, self.complete_through, through))
            extra = (("checkpoint", float(note)),)
        self.attempt_notes = self.notes.at(base - 1) + extra
        self.attempt = attempt
        self.chan.attempt = attempt
        self.attempt_started = now
        self.cursor = LogCursor(self.world_size, base)
        self.ranks = RankTable(self.world_size, now, self.nak_delay)
        self.pending.clear()
        self.pending_meta.clear()
        self._restart_reason = None
        self.evicted.clear()
        self._trim_floor = -2
        self.history = History(self.history.max_entries, self.history.max_bytes, size=_total_len, by_step=True)
        self.reasm = Reassembler(self.reasm.max_messages, self.reasm.max_bytes, self.reasm.max_message_bytes,
                                 keep_raw=True)
        self.snaps.clear()
        self.recent.clear()
        self._acks.clear()
        self._log_complete_sent = False
        self.c["attempts"] += 1
        self._events.append(ev.AttemptStarted(attempt, base))

    # --- updates -------------------------------------------------------------------------------------
    def _on_update_chunk(self, rs: RankState, h: wire.Header, body: bytes, data: bytes, now: float) -> bool:
        """True if the chunk was stored and its update is not complete yet."""
        step = h.step
        if h.origin != rs.rank:
            self.chan.drops["bad_origin"] += 1
            return False
        if step in rs.received:
            if h.index == 0 or h.count == 1:
                self._acks.setdefault(rs.rank, []).append(step)
            self.chan.drops["duplicate"] += 1
            rs.late.arrived_twice(step)
            return False
        if rs.ended is not None and step > rs.ended.last_step:
            self.chan.drops["after_end"] += 1
            return False
        if step < self.cursor.start_step:
            self.chan.drops["before_start"] += 1
            return False
        if step > rs.received.contiguous_from(self.cursor.start_step) + self.max_ahead:
            self.chan.drops["too_far_ahead"] += 1
            return False
        if h.count > self.max_chunks_update:
            self.chan.drops["too_many_chunks"] += 1
            return False
        return self._store_chunk(rs, step, h.index, h.count, body, data, now)

    def _next_chunk(self, last: _Chunk, data: bytes, now: float) -> bool:
        """The fast path of `receive_run`: ``data`` if it is the next chunk of ``last``'s update (same header
        but for counter and index); False (nothing done) for any other datagram, which then takes the
        whole path. What this skips is what ``last`` passed and a stored chunk cannot change: the sender,
        attempt, job, kind and session, the rank's state, and the step's place in its log."""
        if not wire.HEADER_BYTES <= len(data) <= self.chan.datagram_size or wire.header_key(data) != last.key:
            return False
        counter, index = wire.counter_and_index(data)
        if counter >= wire.MAX_COUNTER or index >= last.chunks:
            return False                       # the whole path counts it (malformed)
        self.c["datagrams_in"] += 1
        self.c["bytes_in"] += len(data)
        rs = last.rank
        body = self.chan.open_fields(rs.rank, self.attempt, last.session, counter, data)
        if body is not None:
            self._heard(rs, now)
            self._store_chunk(rs, last.step, index, last.chunks, body, data, now)
        return True

    def _store_chunk(self, rs: RankState, step: int, index: int, count: int, body: bytes, data: bytes,
                     now: float) -> bool:
        """Into reassembly; a completed update is decoded and held for the log. True if the chunk was
        stored and its update is not complete yet."""
        whole, reason = self.reasm.add((rs.rank, step), index, count, body, now, raw=bytes(data))
        if reason is not None:
            self.chan.drops[reason] += 1
            if reason == "duplicate_chunk":
                rs.late.arrived_twice(step)
            return False
        if whole is None:
            return True
        rs.late.completed(step)
        sealed = self.reasm.last_raw
        try:
            payload, meta = wire.decode_update_body(whole)
            decoded = self.decode_update(payload, self.n_params)
        except DecodeError as exc:
            self._refuse_update(rs, step, str(exc))
            return False
        rs.received.add(step)
        self._page_changes[rs.rank // self.status_ranks] += 1
        rs.updates_in += 1
        rs.bytes_in += len(whole)
        if meta is not None:
            rs.meta = dict(meta, step=float(step))
            self.pending_meta[(step, rs.rank)] = meta
        self.pending[(step, rs.rank)] = decoded
        self.c["updates_in"] += 1
        # the datagrams the accepted updates came in (a per-rank forward sends each of them once): the
        # exact forwarding model; one from the mean payload under-counts updates whose sizes straddle
        # a datagram boundary
        self.c["update_datagrams"] += len(sealed)
        self._acks.setdefault(rs.rank, []).append(step)
        if self.aggregator is None:
            self._keep(step, rs.rank, sealed)
            self._forward(rs.rank, step, sealed, now)
        self._last_now = now
        self._request_apply()
        return False

    def _keep(self, step: int, origin: int, sealed: tuple[bytes, ...]) -> None:
        """Into the bounded history, for NAK repair (what the caps evict is remembered: NAK → error)."""
        for key in self.history.put((step, origin), sealed):
            self.evicted.add(key)
            self.c["history_evicted"] += 1

    def _refuse_update(self, rs: RankState, step: int, why: str) -> None:
        """An authenticated peer sent an update that does not decode: it must never enter the log.
        The rank is declared gone at its contiguous prefix so that the log can go on (and told why)."""
        self.chan.drops["bad_update"] += 1
        self._send(rs, ev.Reject(f"update (step {step}, rank {rs.rank}) refused: {why[:200]}"))
        self._declare_gone(rs, f"sent an invalid update at step {step}")

    def _forward(self, origin: int, step: int, sealed: tuple[bytes, ...], now: float) -> None:
        """Send the origin's own datagrams (or the relay's aggregate), unchanged, to every other live peer."""
        targets = self.ranks.forward_targets(origin)
        if not targets:
            return
        self.recent[(step, origin)] = now
        # a peer's datagrams one after another: the shell sends such a run as one GSO buffer (udp.py)
        for addr in targets:
            self._out.extend((dgram, addr) for dgram in sealed)
        self.c["forwarded"] += len(targets) * len(sealed)

    def _on_nak(self, rs: RankState, msg: ev.Nak, now: float) -> None:
        for item in msg.items:
            key = (item.step, item.origin)
            if not item.chunks and now - self.recent.get(key, -1e18) < self.nak_delay:
                # the peer had none of it when it asked, and we forwarded all of it a moment ago: the NAK
                # crossed the forward. Resending every chunk would double the traffic for nothing; if the
                # forward was really lost the peer asks again after its re-NAK interval.
                self.c["nak_crossed_forward"] += 1
                continue
            sealed = self.history.get(key)
            if sealed is None:
                if key in self.evicted:
                    self._send(rs, ev.Reject(f"update (step {item.step}, rank {item.origin}) was evicted "
                                             f"from the relay's bounded history before this peer had it"))
                    self.c["nak_evicted"] += 1
                continue
            n = len(sealed)
            dgrams = sealed if not item.chunks else [sealed[i] for i in item.chunks if i < n]
            for d in dgrams:
                self._out.append((d, rs.addr))
            self.c["retransmits"] += len(dgrams)

    def _on_finished(self, rs: RankState, last_step: int) -> None:
        if rs.ended is None:
            if last_step < self.cursor.start_step - 1:
                self._send(rs, ev.Reject(f"FINISHED({last_step}) is before this attempt's start step "
                                         f"{self.cursor.start_step}"))
                return
            self._end(rs, last_step, gone=False, reason="finished")
        self._send(rs, self._status(rs.rank // self.status_ranks))   # the page that confirms its end

    def _on_leave(self, rs: RankState) -> None:
        if rs.ended is None:
            self._declare_gone(rs, "left before FINISHED")
        rs.to(RankTrigger.LEAVE)
        self._trim_history()

    def _declare_gone(self, rs: RankState, reason: str, now: float | None = None, silent: float = 0.0) -> None:
        if rs.ended is not None:
            return
        self._incident("gone", rs, silent, rs.last_heard if now is None else now, reason[:200])
        cut = rs.received.contiguous_from(self.cursor.start_step) - 1
        self._end(rs, cut, gone=True, reason=reason)

    def _end(self, rs: RankState, last_step: int, gone: bool, reason: str) -> None:
        rs.to(RankTrigger.GONE if gone else RankTrigger.FINISH)
        rs.ended = ev.Ended(rs.rank, last_step, gone)
        self._page_changes[rs.rank // self.status_ranks] += 1
        self.cursor.end(rs.rank, last_step)
        # anything held beyond the end does not exist in the log (never applied: it is after the cut)
        for key in [k for k in self.pending if k[1] == rs.rank and k[0] > last_step]:
            del self.pending[key]
            self.pending_meta.pop(key, None)
        self.history.discard_where(lambda k: k[1] == rs.rank and k[0] > last_step)
        self.reasm.discard_where(lambda k: k[0] == rs.rank)
        self.c["gone" if gone else "finished"] += 1
        self._events.append(ev.PeerEnded(rs.rank, last_step, gone, reason))
        status = self._status(rs.rank // self.status_ranks)     # only the ended rank's page changed
        for r in self.ranks.connected():
            self._send(r, status)
        self._request_apply()

    def _request_apply(self) -> None:
        self._apply_due = True
        if not self.defer_apply:
            self.apply_pending()

    def apply_pending(self) -> None:
        """Apply every update whose turn has come (called inline unless ``defer_apply``)."""
        if self._apply_due:
            self._apply_due = False
            self._advance()

    def _advance(self) -> None:
        """Apply the log in canonical (step, rank) order, one whole step at a time.

        Whole steps only: the authoritative parameters then always equal "the log applied through
        complete_through", which is what a snapshot and a new attempt's cut promise."""
        cur = self.cursor
        while not cur.finished():
            t = cur.step
            row = [(t, r) for r in range(cur.rank, self.world_size) if cur.exists(t, r) is not False]
            if any(k not in self.pending for k in row):
                break
            if self.aggregator is not None:
                self._aggregate(t, [self.pending.pop(k) for k in row])
            for k in row:
                if self.aggregator is None:
                    self.apply_update(self.pending.pop(k), self.params)
                self.c["applied"] += 1
                meta = self.pending_meta.pop(k, None)
                if meta is not None and "epoch" in meta:
                    self._tally(k[1], int(meta["epoch"]), meta)
                if meta is not None and k[1] == 0:
                    self.notes.add(t, meta)
                    if "val_epoch" in meta and "val_metric" in meta:
                        self._tally_score(int(meta["val_epoch"]), meta["val_metric"])
            while cur.step == t:
                if cur.next_key() is None:
                    break
                if cur.step == t:
                    cur.advance()
        if cur.finished() and not self._log_complete_sent:
            self._log_complete_sent = True
            self._events.append(ev.LogComplete(cur.complete_through))

    def _aggregate(self, step: int, decoded: list[StepUpdate]) -> None:
        """Step ``step``'s row is complete: encode its one aggregated message (rank order), apply it to
        the authoritative parameters, send it to every live peer and keep it for NAK repair."""
        from gradshare.encoding.aggregate import aggregate_step

        assert self.aggregator is not None      # apply_pending calls this only with forwarding="aggregate"
        agg = aggregate_step(self.aggregator, decoded, step)
        self.apply_update(agg, self.params)
        meta = None
        stop = self.pending_meta.get((step, 0))
        if stop is not None and "stop_epoch" in stop:     # rank 0's early-stop decision rides along
            meta = {"stop_epoch": stop["stop_epoch"]}
        body = wire.encode_update_body(agg.to_bytes(self.aggregator.n_buffers), meta)
        sealed = tuple(self.chan.seal_chunks(Kind.UPDATE, body, AGGREGATE_ORIGIN, step,
                                             chunk_bytes=self.aggregate_chunk_bytes))
        self._keep(step, AGGREGATE_ORIGIN, sealed)
        self._forward(AGGREGATE_ORIGIN, step, sealed, self._last_now)
        self.c["aggregates"] += 1
        self.c["aggregate_wire_bytes"] += _total_len(sealed)      # one peer's copy
        self.c["aggregate_entries"] += agg.message.n_entries

    def _tally(self, rank: int, epoch: int, meta: ev.Meta) -> None:
        tally = self.epochs.get((rank, epoch))
        if tally is None:
            if len(self.epochs) >= MAX_EPOCH_ROWS:
                self.c["epoch_rows_dropped"] += 1
                return
            tally = self.epochs[(rank, epoch)] = EpochTally(self.attempt)
        tally.add(meta, self.attempt)

    def _tally_score(self, epoch: int, value: float) -> None:
        """Rank 0's validation score of `epoch`, from the message after it scored it (worker.py)."""
        tally = self.epochs.get((0, epoch))
        if tally is not None:
            tally.val_metric = value

    # --- snapshots -----------------------------------------------------------------------------------
    def _on_snap_request(self, rs: RankState, now: float) -> None:
        self.apply_pending()
        new = rs.rank not in self.snaps.transfers
        t = self.snaps.request(rs.rank, self.complete_through, self.params, now)
        if t is None:
            self.chan.drops["snapshot_busy"] += 1
            return
        if new:
            self.c["snapshots"] += 1
        self._send(rs, t.info())

    def _pace(self, now: float) -> None:
        def abandoned(rank: int) -> bool:
            return self.ranks[rank].left or self.ranks[rank].ended is not None

        for rank, t, i in self.snaps.pace(now, self._last_tick, abandoned):
            sealed = self.chan.seal(Kind.SNAP_CHUNK, t.chunk(i), 0, t.snap.snap_id, i, t.n_chunks)
            self._out.append((sealed, self.ranks[rank].addr))
            self.c["snapshot_chunks"] += 1
            self.c["snapshot_bytes_out"] += len(sealed)  # model distribution, not training traffic

    # --- timers --------------------------------------------------------------------------------------
    def handle_timer(self, now: float) -> None:
        self._last_now = now
        self.apply_pending()
        if self._trim_due:
            self._trim_due = False
            self._trim_history()
        self._pace(now)
        self._last_tick = now
        while self.recent:                   # insertion order is time order: drop from the front
            key = next(iter(self.recent))
            if now - self.recent[key] < self.nak_delay:
                break
            del self.recent[key]
        # NAK our own partial inbound updates (the peer resends just the missing chunks)
        naks: dict[int, list[ev.NakItem]] = {}
        for (rank, step), p in self.reasm.stale(now, self.nak_delay):
            late = self.ranks[rank].late
            if now - p.last_seen < late.value * (1 << min(p.naks, 1)):
                continue        # back off, at most 2x: a 5 % loss rate loses some NAKs and answers, and a
                                # long backoff then stalls the whole staleness window behind one chunk
            items = naks.setdefault(rank, [])
            if len(items) < ev.MAX_NAK_ITEMS:
                items.append(ev.NakItem(step, rank, p.missing(ev.MAX_NAK_ITEMS)))
                p.last_seen = now
                p.naks += 1
                late.nakked(step)
        for rank, items in naks.items():
            self._send(self.ranks[rank], ev.Nak(tuple(items)))
            self.c["naks_sent"] += 1
        self.reasm.expire(now, max(30.0, self.liveness_timeout))
        self._check_liveness(now)

    # --- helpers -------------------------------------------------------------------------------------
    def _status(self, page: int) -> ev.Status:
        """STATUS page ``page``: ranks page·status_ranks onwards, as many as fit one datagram."""
        key = (self.attempt, self.complete_through, self._page_changes[page])
        built = self._pages.get(page)
        if built is not None and built[0] == key:
            return built[1]
        start = self.cursor.start_step
        ranks = self.ranks[page * self.status_ranks:(page + 1) * self.status_ranks]
        status = ev.Status(start, self.complete_through, self.world_size, ranks[0].rank,
                           tuple(r.received.contiguous_from(start) - 1 for r in ranks),
                           tuple(r.ended for r in ranks if r.ended is not None))
        self._pages[page] = (key, status)
        return status

    def _send(self, rs: RankState, msg: ev.ControlMessage) -> None:
        if rs.addr is not None:
            self._out.append((self.chan.seal_control(msg), rs.addr))

    def _send_to(self, addr: ev.Address, msg: ev.ControlMessage) -> None:
        self._out.append((self.chan.seal_control(msg), addr))

    def _flush_acks(self) -> None:
        for rank, steps in self._acks.items():
            rs = self.ranks[rank]
            uniq = sorted(set(steps))
            for i in range(0, len(uniq), ev.MAX_NAK_ITEMS):
                self._send(rs, ev.Ack(tuple(uniq[i:i + ev.MAX_NAK_ITEMS])))
        self._acks.clear()

    def _trim_history(self) -> None:
        """Forget forwarded updates that every peer still in the job has delivered and the relay applied.

        Only when that floor rose, and only the entries at or below it, in step order: no entry at or
        below an earlier floor can arrive again (those steps are complete), so a trim costs what it drops
        and a heartbeat that moved nothing costs one pass over the ranks."""
        floor = self.ranks.delivered_floor(self.complete_through)
        if floor is None or floor <= self._trim_floor:
            return
        self._trim_floor = floor
        self.history.discard_through(floor)
        self.evicted.discard_through(floor)   # nobody can still NAK what every peer has delivered
