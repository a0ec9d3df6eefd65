"""The relay's protocol state machine, sans I/O (bytes in, datagrams and events out; as aioquic's
``quic/connection.py`` and h11).

``receive_datagram(data, addr, now)`` consumes one datagram; ``datagrams_to_send()`` returns
``[(bytes, addr)]``; ``next_event()`` returns events; ``next_timer()``/``handle_timer(now)`` drive time.
No sockets, threads or clocks here: the shell in ``sockets/relay.py`` moves bytes and passes ``now``, and
learns what happened from ``next_event()``. The core dispatches each datagram and composes its parts,
each owning its state in its own module; the current ``Attempt`` is handed to them in each call:

- the attempt (``attempt.py Attempt``): the rank table and each rank's lifecycle (``ranks.py``,
  ``states.py``), the log cursor, the bounded history trimmed in step order (``history.py``), reassembly;
- admission (``admission.py Admission``): JOIN → WELCOME with n_params/world_size/start_step for ranks
  0..W-1 of the current attempt; a higher attempt cuts the log at ``complete_through`` (or where the
  training observer's rollback says) and restarts it after the cut, from a fresh Attempt; FAIL;
- the update log (``log.py RelayLog``): intake, forwarding, NAK repair, ends, apply, aggregation;
- liveness (``liveness.py Liveness``): suspicion, the ``on_rank_loss`` policy, the incidents;
- the STATUS pages (``status.py StatusPages``);
- snapshot serving (``snapshots.py``): parameters + step as a paced, NAK-repaired chunk stream;
- what they all hand the shell (``outbox.py RelayOutbox``): datagrams, events, counters;
- the training bookkeeping (``observer.LogObserver``, the trainer's; ``observer.NullObserver`` by
  default, which keeps nothing): per-(rank, epoch) tallies, rank 0's stop notes, the rollback to
  checkpoints;

Its tunables are one frozen ``RelayTuning`` (tuning.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gradshare.hashing import param_hash
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.relay.admission import Admission
from gradshare.transport.protocol.relay.attempt import Attempt, Decoded
from gradshare.transport.protocol.relay.liveness import Liveness
from gradshare.transport.protocol.relay.log import Chunk, Codec, RelayLog
from gradshare.transport.protocol.relay.observer import LogObserver, Notes, NullObserver
from gradshare.transport.protocol.relay.outbox import RelayOutbox
from gradshare.transport.protocol.relay.ranks import RankState
from gradshare.transport.protocol.relay.snapshots import SnapshotServer
from gradshare.transport.protocol.relay.status import StatusPages
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import RELAY_ID, Kind

# The transport's one seam to the encoding package: imported where used (the default codec, the
# aggregator), as importing gradshare.encoding loads Numba, +0.6 s on `import gradshare.transport`, which
# `gradshare --help` pays (the CLI imports relay_main to build its parser): 0.38 s -> 0.94 s measured.
if TYPE_CHECKING:
    from gradshare.encoding.aggregate import AggregateState
    from gradshare.encoding.update import StepUpdate


def default_decode_update(payload: bytes, n_params: int) -> StepUpdate:
    """Decode with the encoding package: a step update of exactly ``n_params`` parameters and no
    buffers (every index is validated there)."""
    from gradshare.encoding import decode_update

    return decode_update(payload, n_params, n_params=n_params)


def default_apply_update(decoded: StepUpdate, params: NDArray[np.float32], scale: float = 1.0) -> None:
    from gradshare.encoding import apply_update

    apply_update(decoded, params, scale)


class RelayCore:
    def __init__(
        self,
        params: np.ndarray,
        world_size: int,
        key: bytes | None,
        job_id: int | str,
        *,
        now: float,
        datagram_size: int = wire.DEFAULT_DATAGRAM_SIZE,
        insecure: bool = False,
        tuning: RelayTuning = RelayTuning(),
        decode_update: Callable[[bytes, int], Decoded] = default_decode_update,
        apply_update: Callable[[Decoded, NDArray[np.float32]], None] = default_apply_update,
        apply_step: Callable[[list[Decoded], NDArray[np.float32]], None] | None = None,
        observer: LogObserver | None = None,
        aggregator: AggregateState | None = None,
        defer_apply: bool = False,
    ) -> None:
        """observer: the training bookkeeping (observer.LogObserver; None: a NullObserver, which keeps
        nothing and restarts a new attempt's log right after complete_through).
        apply_step: applies one whole step's decoded messages (rank order) at once, in place of
        apply_update per message (a step cap scales by the step's sum: encoding/step_cap.py).
        aggregator: forwarding="aggregate"'s state (None: a default one). defer_apply: receive_datagram
        only forwards; apply_pending() applies (the shell calls it after sending, so applying to the
        authoritative copy never delays a forward)."""
        params = np.asarray(params)
        if params.dtype != np.float32 or params.ndim != 1 or params.size < 1:
            raise ValueError(
                f"initial_params must be a non-empty 1-D float32 array (got {params.dtype}, shape {params.shape})"
            )
        if type(world_size) is not int or not 1 <= world_size <= ev.MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in [1, {ev.MAX_WORLD_SIZE}] (got {world_size!r})")
        if not isinstance(tuning, RelayTuning):
            raise ValueError(f"tuning must be a RelayTuning (got {type(tuning).__name__})")
        self.tuning = tuning
        # "aggregate": ranks' messages are not forwarded; once a step's row is complete the relay sends ONE
        # message re-encoded from its own residual (encoding/aggregate.py) to every peer, under origin
        # AGGREGATE_ORIGIN, and applies only that one itself
        if tuning.forwarding == "aggregate" and aggregator is None:
            from gradshare.encoding.aggregate import AggregateState

            aggregator = AggregateState(int(params.size))
        self.observer: LogObserver = observer if observer is not None else NullObserver()
        self.params: NDArray[np.float32] = np.array(params, dtype=np.float32, copy=True)
        self.n_params = int(params.size)
        self.world_size = world_size
        # the largest message an update can be: a dense float32 vector plus framing (encoder forms are smaller)
        self.max_message = 8 * self.n_params + 65536
        self.chan = Channel(
            key=key,
            insecure=insecure,
            job=wire.job_id_to_int(job_id),
            sender=RELAY_ID,
            attempt=0,
            datagram_size=datagram_size,
            max_chunks=max(16, -(-self.max_message // 64)),
            max_windows=4 * world_size + 8,
        )
        self.io = RelayOutbox(self.chan)
        self.counts: Counter[str] = self.io.counts  # counters (drops live in chan.drops)
        self.pages = StatusPages(world_size, self.chan.chunk_bytes)
        # snapshot chunks may travel in larger datagrams than updates (loopback: one per 64 kB instead of
        # one per 1.4 kB, so sealing and opening them is not what a worker waits for); peers accept any
        # datagram from the relay up to wire.MAX_DATAGRAM_SIZE
        snap_size = wire.check_datagram_size(tuning.snapshot_datagram_size or datagram_size)
        snap_chunk = self.chan.chunk_bytes + snap_size - datagram_size
        # snapshot serving (snapshots.py): paced at snapshot_rate, at most snapshot_burst bytes a tick
        # however late the tick (a burst must fit the receivers' socket buffers: the shell caps it from its
        # own, sockets/relay.py); a transfer idle for max(10 s, liveness_timeout) is dropped
        self.snaps = SnapshotServer(
            snap_chunk - snap_chunk % 4,
            tuning.snapshot_rate,
            tuning.snapshot_burst,
            tuning.max_snapshots,
            max(10.0, float(tuning.liveness_timeout)),
        )
        self.liveness = Liveness(tuning, self.io)
        self.log = RelayLog(
            tuning,
            self.params,
            Codec(decode_update, apply_update, apply_step),
            aggregator if tuning.forwarding == "aggregate" else None,
            self.observer,
            self.io,
            self.pages,
            self.liveness,
            -(-self.max_message // self.chan.chunk_bytes),
            snap_chunk,
            defer_apply,
        )
        self.log.last_now = now
        self.admission = Admission(
            world_size,
            self.n_params,
            self.log.aggregator is not None,
            self.max_message,
            tuning,
            self.observer,
            self.io,
            self.pages,
            self.liveness,
        )
        self.att = Attempt(-1, None, 0, (), world_size, tuning, self.max_message, now)  # no attempt yet
        self._trim_due = False
        self._last_tick = now

    # --- public surface of the core ----------------------------------------------------------------
    @property
    def complete_through(self) -> int:
        return self.att.cursor.complete_through

    def datagrams_to_send(self) -> list[tuple[bytes, ev.Address]]:
        if self.att.acks:
            self.log.flush_acks(self.att)
        return self.io.take()

    def next_event(self) -> ev.RelayEvent | None:
        return self.io.events.popleft() if self.io.events else None

    def next_timer(self) -> float:
        # tick only while something may need a NAK or pacing; otherwise 10 Hz is enough for liveness and
        # housekeeping (a fixed 2 ms tick cost the driver ~4 % of a core for the whole fit)
        busy = self.snaps.transfers or len(self.att.reasm)
        return self._last_tick + (self.tuning.tick if busy else 0.1)

    def finished(self) -> bool:
        return self.att.cursor.finished() and not self.log.apply_due

    @property
    def apply_due(self) -> bool:
        """An update completed since the last apply_pending() (with defer_apply: the shell's cue)."""
        return self.log.apply_due

    def counters(self) -> ev.Counters:
        d: ev.Counters = dict.fromkeys(
            (
                "datagrams_in",
                "datagrams_out",
                "bytes_in",
                "bytes_out",
                "retransmits",
                "forwarded",
                "forwarded_bytes",
                "updates_in",
                "update_datagrams",
                "applied",
                "naks_sent",
                "aggregates",
            ),
            0,
        )
        d.update(self.counts)
        d.update(self.observer.counters())
        d["drops"] = dict(self.chan.drops)
        ranks = self.att.ranks
        d["peers"] = len(ranks.connected())
        d["ended"] = sum(1 for r in ranks if r.ended is not None)
        d["last_step"] = max(ranks.have(self.att.cursor.start_step), default=-1)
        d["complete_through"] = self.complete_through
        d["attempt"] = self.att.number
        d["history_entries"] = len(self.att.history)
        d["history_bytes"] = self.att.history.nbytes
        return d

    def param_hash(self) -> str:
        """param_hash of the authoritative parameters."""
        return param_hash(self.params)

    def copy_params(self) -> NDArray[np.float32]:
        return self.params.copy()

    def take_params(self) -> NDArray[np.float32]:
        """The parameters themselves, handed over: the core keeps an empty array in their place."""
        params, self.params = self.params, np.empty(0, np.float32)
        return params

    def notes_at(self, step: int) -> Notes:
        """Rank 0's epoch-end state through `step`, as the observer keeps it (() by default)."""
        return self.observer.notes_at(step)

    def inherit_notes(self, notes: Notes) -> None:
        """Before the first attempt: `notes` as if the log held them before its first step (WELCOME's)."""
        self.observer.inherit(notes)

    def epoch_tallies(self) -> dict[tuple[int, int], dict[str, float | None]]:
        """(rank, epoch) -> what the applied log says about it, as the observer keeps it ({} by default)."""
        return self.observer.epoch_tallies()

    def cap_snapshot_burst(self, nbytes: int) -> None:
        """A pacing tick sends at most ``nbytes`` of snapshot (the shell knows the socket buffers)."""
        self.snaps.cap_burst(nbytes)

    def progress(self) -> dict[str, object]:
        start = self.att.cursor.start_step
        return {
            "complete_through": self.complete_through,
            "attempt": self.att.number,
            "start_step": start,
            "ranks": {
                r.rank: {
                    "joined": r.joined,
                    "have": r.received.contiguous_from(start) - 1,
                    "ended": None if r.ended is None else {"last_step": r.ended.last_step, "gone": r.ended.gone},
                    "updates_in": r.updates_in,
                    "bytes_in": r.bytes_in,
                    "meta": None if r.meta is None else r.meta.to_wire(),
                }
                for r in self.att.ranks
            },
        }

    def status_page(self, page: int) -> ev.Status:
        """STATUS page ``page`` as the relay would send it now (relay/status.py)."""
        return self.pages.page(page, self.att)

    def all_left(self) -> bool:
        """Every rank said LEAVE (after FINISHED, its last acknowledgements received)."""
        return all(r.left for r in self.att.ranks)

    # --- input ---------------------------------------------------------------------------------------
    def receive_run(self, run: list[bytes], i: int, addr: ev.Address, now: float) -> int:
        """Feed ``run[i:]``, the datagrams of one read (all from ``addr``), up to the first that leaves work
        for the shell (``has_work``); the index after it.

        Why (N = 32 latency): with GRO a read holds the ~12 chunks of one rank's update. A chunk
        whose header equals the one before it but for its counter and chunk index skips the checks that one
        passed (`RelayLog.next_chunk`): between the two only a partial update gained a chunk, which none of them
        reads. Each chunk is still authenticated and replay-checked on its own."""
        last: Chunk | None = None
        while i < len(run):
            data = run[i]
            i += 1
            if last is None or not self.log.next_chunk(self.att, last, data, now):
                last = self._receive(data, addr, now)
            # the datagram left something for the shell: datagrams to send, an apply, an event
            if self.io.datagrams or self.att.acks or self.log.apply_due or self.io.events:
                break
        return i

    def receive_datagram(self, data: bytes, addr: ev.Address, now: float) -> None:
        self._receive(data, addr, now)

    def _receive(self, data: bytes, addr: ev.Address, now: float) -> Chunk | None:
        """One datagram; the update chunk it stored (the next chunk of the same update may follow it
        through `RelayLog.next_chunk`), or None."""
        self.counts["datagrams_in"] += 1
        self.counts["bytes_in"] += len(data)
        h = self.chan.parse(data)
        if h is None:
            return None
        if h.sender >= self.world_size:
            self.chan.drops["bad_sender"] += 1
            return None
        att = self.att
        if h.attempt < att.number:
            self.chan.drops["old_attempt"] += 1
            return None
        if h.kind == Kind.FAIL:  # accepted unjoined: a rank may fail before it could join
            body = self.chan.open(h, data)
            if body is not None:
                self.admission.on_fail(h, body, addr)
            return None
        if h.kind not in (Kind.JOIN, Kind.LOADING) and h.attempt != att.number:
            self.chan.drops["unknown_attempt"] += 1
            return None
        body = self.chan.open(h, data)
        if body is None:
            return None
        rs = att.ranks[h.sender] if h.attempt == att.number else None
        if h.kind == Kind.JOIN:
            self.admission.on_join(att, h, body, addr, now, self._start_attempt)
            return None
        if h.kind == Kind.LOADING:
            self.admission.on_loading(att, h, body, now, self._start_attempt)
            return None
        if rs is None or not rs.joined or rs.session != h.session:
            self.chan.drops["not_joined"] += 1
            return None
        if rs.left:
            self.chan.drops["after_leave"] += 1
            return None
        self.liveness.heard(att, rs, now)
        rs.addr = addr  # authenticated: follow a NAT rebinding
        if h.kind == Kind.UPDATE:
            if self.log.on_update_chunk(att, rs, h, body, data, now):
                return Chunk(wire.header_key(data), rs, h.session, h.step, h.count)
            return None
        msg = self.chan.control(h.kind, body)
        if msg is not None:
            self._on_control(rs, msg, now)
        return None

    def _on_control(self, rs: RankState, msg: ev.ControlMessage, now: float) -> None:
        if isinstance(msg, ev.Heartbeat):
            rs.delivered_through = max(rs.delivered_through, msg.delivered_through)
            rs.sent_through = max(rs.sent_through, msg.sent_through)
            presence = rs.presence
            if msg.computing != presence.computing:
                presence.computing, presence.computing_since = msg.computing, now
            # one STATUS page per heartbeat, the pages in turn (relay/status.py)
            self.io.send(rs, self.status_page(self.pages.next_turn(rs.rank)))
            # trim on the next timer, not per heartbeat: a trim scans every rank, and N ranks each
            # heartbeating made that O(N²) per second
            self._trim_due = True
        elif isinstance(msg, ev.Nak):
            self.log.on_nak(self.att, rs, msg, now)
        elif isinstance(msg, ev.Finished):
            self.log.on_finished(self.att, rs, msg.last_step)
        elif isinstance(msg, ev.Leave):
            self.log.on_leave(self.att, rs)
        elif isinstance(msg, ev.SnapRequest):
            self.apply_pending()  # a snapshot is the log applied through complete_through
            new = rs.rank not in self.snaps.transfers
            t = self.snaps.request(rs.rank, self.complete_through, self.params, now)
            if t is None:
                self.chan.drops["snapshot_busy"] += 1
                return
            if new:
                self.counts["snapshots"] += 1
            self.io.send(rs, t.info())
        elif isinstance(msg, ev.SnapNak):
            if not self.snaps.nak(rs.rank, msg.snap_id, msg.ranges, now):
                self.chan.drops["stale_snapshot"] += 1
        elif isinstance(msg, ev.SnapDone):
            self.snaps.done(rs.rank, msg.snap_id)
        else:
            self.chan.drops["unexpected_kind"] += 1

    def _start_attempt(self, number: int, now: float) -> Attempt:
        """A retried stage: cut the log at complete_through (admission.py) and start attempt ``number``."""
        self.apply_pending()  # complete_through must be current before it becomes the cut
        self.att = self.admission.new_attempt(number, now, self.complete_through, self.params)
        self.chan.attempt = number
        self.snaps.clear()
        return self.att

    # --- snapshots and timers ------------------------------------------------------------------------
    def _pace(self, now: float) -> None:
        ranks = self.att.ranks

        def abandoned(rank: int) -> bool:
            return ranks[rank].left or ranks[rank].ended is not None

        for rank, t, i in self.snaps.pace(now, self._last_tick, abandoned):
            sealed = self.chan.seal(Kind.SNAP_CHUNK, t.chunk(i), 0, t.snap.snap_id, i, t.n_chunks)
            self.io.datagrams.append((sealed, ranks[rank].addr))
            self.counts["snapshot_chunks"] += 1
            self.counts["snapshot_bytes_out"] += len(sealed)  # model distribution, not training traffic

    def apply_pending(self) -> None:
        """Apply every update whose turn has come (called inline unless ``defer_apply``)."""
        self.log.apply_pending(self.att)

    def handle_timer(self, now: float) -> None:
        att = self.att
        self.log.last_now = now
        self.apply_pending()
        if self._trim_due:
            self._trim_due = False
            self.log.trim(att)
        self._pace(now)
        self._last_tick = now
        self.log.forget_recent(att, now)
        self.log.nak_partials(att, now)
        att.reasm.expire(now, max(30.0, self.liveness.liveness_timeout))
        self.liveness.check(att, now, self.log.declare_gone)


__all__ = ["RelayCore", "RelayTuning", "default_apply_update", "default_decode_update"]
