"""The relay's update log, sans I/O: intake, forwarding, NAK repair, ends, apply and aggregation.

- reassembles updates, validates them (``decode_update``) BEFORE they enter the log, acknowledges them,
  and forwards each complete update once to every other joined peer: the origin's own sealed datagrams,
  unchanged (no AEAD per chunk at the relay; retransmissions from history are the same bytes);
- learns per rank how late chunks may be before it NAKs them (``LateAllowance``): fast repair on a lossy
  link, no spurious retransmits on a loaded machine;
- applies the log in canonical (step, rank) order to its authoritative parameters (``apply_update``),
  telling the training observer each applied update's meta;
- or, with ``forwarding="aggregate"``, forwards nothing per rank: once a step's row is complete it adds
  the row into its own residual (``aggregator``, encoding/aggregate.py), seals ONE re-encoded message of
  origin AGGREGATE_ORIGIN, applies only that, sends it to every peer and keeps it in the history for NAK
  repair;
- answers NAKs from a bounded history, trimmed in step order once every peer has delivered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numpy.typing import NDArray

from gradshare.errors import DecodeError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.relay.attempt import Attempt, Decoded, total_len
from gradshare.transport.protocol.relay.liveness import Liveness
from gradshare.transport.protocol.relay.observer import LogObserver
from gradshare.transport.protocol.relay.outbox import RelayOutbox
from gradshare.transport.protocol.relay.ranks import RankState
from gradshare.transport.protocol.relay.status import StatusPages
from gradshare.transport.protocol.states import RankTrigger
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import AGGREGATE_ORIGIN, Kind

if TYPE_CHECKING:
    from gradshare.encoding.aggregate import AggregateState
    from gradshare.encoding.update import StepUpdate


class Codec(NamedTuple):
    """The update codec the relay applies its log with (relay/core.py: the encoding package's by default)."""

    decode_update: Callable[[bytes, int], Decoded]
    apply_update: Callable[[Decoded, NDArray[np.float32]], None]
    # one whole step's decoded messages (rank order) at once, in place of apply_update per message
    apply_step: Callable[[list[Decoded], NDArray[np.float32]], None] | None


class Chunk(NamedTuple):
    """An update chunk the relay stored (`RelayCore.receive_run`): its header but for counter and index
    (wire.header_key), its rank, session, step and chunk count."""

    key: tuple[bytes, bytes, bytes]
    rank: RankState
    session: int
    step: int
    chunks: int


class RelayLog:
    """The relay's log over the current attempt (handed in each call): it applies it to ``params`` (the
    authoritative copy, shared with the core, changed in place only) with ``codec``, tells ``observer``,
    and sends through ``io``.

    defer_apply: a completed update only marks the log due (``apply_due``); ``apply_pending`` applies (the
    shell calls it after sending, so applying to the authoritative copy never delays a forward)."""

    def __init__(
        self,
        tuning: RelayTuning,
        params: NDArray[np.float32],
        codec: Codec,
        aggregator: AggregateState | None,
        observer: LogObserver,
        io: RelayOutbox,
        pages: StatusPages,
        liveness: Liveness,
        max_chunks_update: int,
        aggregate_chunk_bytes: int,
        defer_apply: bool,
    ) -> None:
        self.max_ahead = tuning.max_ahead
        self.nak_delay = tuning.nak_delay
        self.params = params
        self.n_params = int(params.size)
        self.codec = codec
        self.aggregator = aggregator
        self.observer = observer
        self.io = io
        self.pages = pages
        self.liveness = liveness
        self.defer_apply = defer_apply
        self.apply_due = False
        self.last_now = 0.0  # the latest update's time: aggregates are sent "now"
        self.max_chunks_update = max_chunks_update
        # the relay's own aggregates (forwarding="aggregate") travel in datagrams as large as snapshot
        # chunks: the relay seals them, so unlike a rank's forwarded datagrams their size is its choice,
        # and one sendto per peer instead of ~16 is most of what an aggregate costs the relay on loopback
        self.aggregate_chunk_bytes = aggregate_chunk_bytes

    # --- intake --------------------------------------------------------------------------------------
    def on_update_chunk(
        self, att: Attempt, rs: RankState, h: wire.Header, body: bytes, data: bytes, now: float
    ) -> bool:
        """True if the chunk was stored and its update is not complete yet."""
        drops = self.io.chan.drops
        step = h.step
        if h.origin != rs.rank:
            drops["bad_origin"] += 1
            return False
        if step in rs.received:
            if h.index == 0 or h.count == 1:
                att.acks.setdefault(rs.rank, []).append(step)
            drops["duplicate"] += 1
            rs.late.arrived_twice(step)
            return False
        if rs.ended is not None and step > rs.ended.last_step:
            drops["after_end"] += 1
            return False
        if step < att.cursor.start_step:
            drops["before_start"] += 1
            return False
        if step > rs.received.contiguous_from(att.cursor.start_step) + self.max_ahead:
            drops["too_far_ahead"] += 1
            return False
        if h.count > self.max_chunks_update:
            drops["too_many_chunks"] += 1
            return False
        return self.store_chunk(att, rs, step, h.index, h.count, body, data, now)

    def next_chunk(self, att: Attempt, last: Chunk, data: bytes, now: float) -> bool:
        """The fast path of `RelayCore.receive_run`: ``data`` if it is the next chunk of ``last``'s update
        (same header but for counter and index); False (nothing done) for any other datagram, which then
        takes the whole path. What this skips is what ``last`` passed and a stored chunk cannot change: the
        sender, attempt, job, kind and session, the rank's state, and the step's place in its log."""
        io = self.io
        if not wire.HEADER_BYTES <= len(data) <= io.chan.datagram_size or wire.header_key(data) != last.key:
            return False
        counter, index = wire.counter_and_index(data)
        if counter >= wire.MAX_COUNTER or index >= last.chunks:
            return False  # the whole path counts it (malformed)
        io.counts["datagrams_in"] += 1
        io.counts["bytes_in"] += len(data)
        rs = last.rank
        body = io.chan.open_fields(rs.rank, att.number, last.session, counter, data)
        if body is not None:
            self.liveness.heard(att, rs, now)
            self.store_chunk(att, rs, last.step, index, last.chunks, body, data, now)
        return True

    def store_chunk(
        self, att: Attempt, rs: RankState, step: int, index: int, count: int, body: bytes, data: bytes, now: float
    ) -> bool:
        """Into reassembly; a completed update is decoded and held for the log. True if the chunk was
        stored and its update is not complete yet."""
        io = self.io
        whole, reason = att.reasm.add((rs.rank, step), index, count, body, now, raw=bytes(data))
        if reason is not None:
            io.chan.drops[reason] += 1
            if reason == "duplicate_chunk":
                rs.late.arrived_twice(step)
            return False
        if whole is None:
            return True
        rs.late.completed(step)
        sealed = att.reasm.last_raw
        try:
            payload, meta = wire.decode_update_body(whole)
            decoded = self.codec.decode_update(payload, self.n_params)
        except DecodeError as exc:
            self._refuse(att, rs, step, str(exc))
            return False
        rs.received.add(step)
        self.pages.changed(rs.rank)
        rs.updates_in += 1
        rs.bytes_in += len(whole)
        if meta is not None:
            rs.meta = meta
            att.pending_meta[(step, rs.rank)] = meta
        att.pending[(step, rs.rank)] = decoded
        io.counts["updates_in"] += 1
        # the datagrams the accepted updates came in (a per-rank forward sends each of them once): the
        # exact forwarding model; one from the mean payload under-counts updates whose sizes straddle
        # a datagram boundary
        io.counts["update_datagrams"] += len(sealed)
        att.acks.setdefault(rs.rank, []).append(step)
        if self.aggregator is None:
            self.keep(att, step, rs.rank, sealed)
            self.forward(att, rs.rank, step, sealed, now)
        self.last_now = now
        self.request_apply(att)
        return False

    def _refuse(self, att: Attempt, rs: RankState, step: int, why: str) -> None:
        """An authenticated peer sent an update that does not decode: it must never enter the log.
        The rank is declared gone at its contiguous prefix so that the log can go on (and told why)."""
        self.io.chan.drops["bad_update"] += 1
        self.io.send(rs, ev.Reject(f"update (step {step}, rank {rs.rank}) refused: {why[:200]}"))
        self.declare_gone(att, rs, f"sent an invalid update at step {step}")

    def nak_partials(self, att: Attempt, now: float) -> None:
        """NAK our own partial inbound updates (the peer resends just the missing chunks)."""
        naks: dict[int, list[ev.NakItem]] = {}
        for (rank, step), p in att.reasm.stale(now, self.nak_delay):
            late = att.ranks[rank].late
            if now - p.last_seen < late.value * (1 << min(p.naks, 1)):
                continue  # back off, at most 2x: a 5 % loss rate loses some NAKs and answers, and a
                # long backoff then stalls the whole staleness window behind one chunk
            items = naks.setdefault(rank, [])
            if len(items) < ev.MAX_NAK_ITEMS:
                items.append(ev.NakItem(step, rank, p.missing(ev.MAX_NAK_ITEMS)))
                p.last_seen = now
                p.naks += 1
                late.nakked(step)
        for rank, items in naks.items():
            self.io.send(att.ranks[rank], ev.Nak(tuple(items)))
            self.io.counts["naks_sent"] += 1

    # --- forward and repair --------------------------------------------------------------------------
    def flush_acks(self, att: Attempt) -> None:
        """Acknowledge the updates stored since the last flush, each rank's in as few ACKs as fit."""
        for rank, steps in att.acks.items():
            rs = att.ranks[rank]
            uniq = sorted(set(steps))
            for i in range(0, len(uniq), ev.MAX_NAK_ITEMS):
                self.io.send(rs, ev.Ack(tuple(uniq[i : i + ev.MAX_NAK_ITEMS])))
        att.acks.clear()

    def keep(self, att: Attempt, step: int, origin: int, sealed: tuple[bytes, ...]) -> None:
        """Into the bounded history, for NAK repair (what the caps evict is remembered: NAK → error)."""
        for key in att.history.put((step, origin), sealed):
            att.evicted.add(key)
            self.io.counts["history_evicted"] += 1

    def forward(self, att: Attempt, origin: int, step: int, sealed: tuple[bytes, ...], now: float) -> None:
        """Send the origin's own datagrams (or the relay's aggregate), unchanged, to every other live peer."""
        targets = att.ranks.forward_targets(origin)
        if not targets:
            return
        att.recent[(step, origin)] = now
        # a peer's datagrams one after another: the shell sends such a run as one GSO buffer (udp.py)
        for addr in targets:
            self.io.datagrams.extend((dgram, addr) for dgram in sealed)
        self.io.counts["forwarded"] += len(targets) * len(sealed)
        self.io.counts["forwarded_bytes"] += len(targets) * total_len(sealed)  # first sends; NAKs' resends apart

    def on_nak(self, att: Attempt, rs: RankState, msg: ev.Nak, now: float) -> None:
        io = self.io
        for item in msg.items:
            key = (item.step, item.origin)
            if not item.chunks and now - att.recent.get(key, -1e18) < self.nak_delay:
                # the peer had none of it when it asked, and we forwarded all of it a moment ago: the NAK
                # crossed the forward. Resending every chunk would double the traffic for nothing; if the
                # forward was really lost the peer asks again after its re-NAK interval.
                io.counts["nak_crossed_forward"] += 1
                continue
            sealed = att.history.get(key)
            if sealed is None:
                if key in att.evicted:
                    io.send(
                        rs,
                        ev.Reject(
                            f"update (step {item.step}, rank {item.origin}) was evicted "
                            f"from the relay's bounded history before this peer had it"
                        ),
                    )
                    io.counts["nak_evicted"] += 1
                continue
            n = len(sealed)
            dgrams = sealed if not item.chunks else [sealed[i] for i in item.chunks if i < n]
            for d in dgrams:
                io.datagrams.append((d, rs.addr))
            io.counts["retransmits"] += len(dgrams)

    def forget_recent(self, att: Attempt, now: float) -> None:
        """Drop the forwards older than nak_delay (a NAK after that is not one that crossed them)."""
        recent = att.recent
        while recent:  # insertion order is time order: drop from the front
            key = next(iter(recent))
            if now - recent[key] < self.nak_delay:
                break
            del recent[key]

    def trim(self, att: Attempt) -> None:
        """Forget forwarded updates that every peer still in the job has delivered and the relay applied.

        Only when that floor rose, and only the entries at or below it, in step order: no entry at or
        below an earlier floor can arrive again (those steps are complete), so a trim costs what it drops
        and a heartbeat that moved nothing costs one pass over the ranks."""
        floor = att.ranks.delivered_floor(att.cursor.complete_through)
        if floor is None or floor <= att.trim_floor:
            return
        att.trim_floor = floor
        att.history.discard_through(floor)
        att.evicted.discard_through(floor)  # nobody can still NAK what every peer has delivered

    # --- ends ----------------------------------------------------------------------------------------
    def on_finished(self, att: Attempt, rs: RankState, last_step: int) -> None:
        if rs.ended is None:
            start = att.cursor.start_step
            if last_step < start - 1:
                self.io.send(rs, ev.Reject(f"FINISHED({last_step}) is before this attempt's start step {start}"))
                return
            self._end(att, rs, last_step, gone=False, reason="finished")
        # the page that confirms its end
        self.io.send(rs, self.pages.page(self.pages.page_of(rs.rank), att))

    def on_leave(self, att: Attempt, rs: RankState) -> None:
        if rs.ended is None:
            self.declare_gone(att, rs, "left before FINISHED")
        rs.to(RankTrigger.LEAVE)
        self.trim(att)

    def declare_gone(
        self, att: Attempt, rs: RankState, reason: str, now: float | None = None, silent: float = 0.0
    ) -> None:
        if rs.ended is not None:
            return
        self.liveness.incident(att, "gone", rs, silent, rs.presence.last_heard if now is None else now, reason[:200])
        cut = rs.received.contiguous_from(att.cursor.start_step) - 1
        self._end(att, rs, cut, gone=True, reason=reason)

    def _end(self, att: Attempt, rs: RankState, last_step: int, gone: bool, reason: str) -> None:
        io = self.io
        rs.to(RankTrigger.GONE if gone else RankTrigger.FINISH)
        rs.ended = ev.Ended(rs.rank, last_step, gone)
        self.pages.changed(rs.rank)
        att.cursor.end(rs.rank, last_step)
        # anything held beyond the end does not exist in the log (never applied: it is after the cut)
        for key in [k for k in att.pending if k[1] == rs.rank and k[0] > last_step]:
            del att.pending[key]
            att.pending_meta.pop(key, None)
        att.history.discard_where(lambda k: k[1] == rs.rank and k[0] > last_step)
        att.reasm.discard_where(lambda k: k[0] == rs.rank)
        io.counts["gone" if gone else "finished"] += 1
        io.emit(ev.PeerEnded(rs.rank, last_step, gone, reason))
        # only the ended rank's page changed
        status = self.pages.page(self.pages.page_of(rs.rank), att)
        for r in att.ranks.connected():
            io.send(r, status)
        self.request_apply(att)

    # --- apply ---------------------------------------------------------------------------------------
    def request_apply(self, att: Attempt) -> None:
        self.apply_due = True
        if not self.defer_apply:
            self.apply_pending(att)

    def apply_pending(self, att: Attempt) -> None:
        """Apply every update whose turn has come (called inline unless ``defer_apply``)."""
        if self.apply_due:
            self.apply_due = False
            self.advance(att)

    def advance(self, att: Attempt) -> None:
        """Apply the log in canonical (step, rank) order, one whole step at a time.

        Whole steps only: the authoritative parameters then always equal "the log applied through
        complete_through", which is what a snapshot and a new attempt's cut promise."""
        cur, pending = att.cursor, att.pending
        while not cur.finished():
            t = cur.step
            row = [(t, r) for r in range(cur.rank, cur.world_size) if cur.exists(t, r) is not False]
            if any(k not in pending for k in row):
                break
            decoded = [pending.pop(k) for k in row]
            if self.aggregator is not None:
                self._aggregate(att, t, decoded)
            else:
                self._apply(decoded)
            for k in row:
                self.io.counts["applied"] += 1
                meta = att.pending_meta.pop(k, None)
                if meta is not None:
                    self.observer.applied(t, k[1], meta, att.number)
            while cur.step == t:
                if cur.next_key() is None:
                    break
                if cur.step == t:
                    cur.advance()
        if cur.finished() and not att.log_complete_sent:
            att.log_complete_sent = True
            self.io.emit(ev.LogComplete(cur.complete_through))

    def _apply(self, decoded: list[Decoded]) -> None:
        """One whole step's messages to the authoritative parameters, as every replica applies them."""
        if self.codec.apply_step is not None:
            self.codec.apply_step(decoded, self.params)
            return
        for d in decoded:
            self.codec.apply_update(d, self.params)

    def _aggregate(self, att: Attempt, step: int, decoded: list[StepUpdate]) -> None:
        """Step ``step``'s row is complete: encode its one aggregated message (rank order), apply it to
        the authoritative parameters, send it to every live peer and keep it for NAK repair."""
        from gradshare.encoding.aggregate import aggregate_step

        io, aggregator = self.io, self.aggregator
        assert aggregator is not None  # advance calls this only with forwarding="aggregate"
        agg = aggregate_step(aggregator, decoded, step)
        self._apply([agg])
        meta = None
        stop = att.pending_meta.get((step, 0))
        if stop is not None and stop.stop_epoch is not None:  # rank 0's early-stop decision rides along
            meta = StepMeta(stop_epoch=stop.stop_epoch)
        body = wire.encode_update_body(agg.to_bytes(aggregator.n_buffers), meta)
        sealed = tuple(
            io.chan.seal_chunks(Kind.UPDATE, body, AGGREGATE_ORIGIN, step, chunk_bytes=self.aggregate_chunk_bytes)
        )
        self.keep(att, step, AGGREGATE_ORIGIN, sealed)
        self.forward(att, AGGREGATE_ORIGIN, step, sealed, self.last_now)
        io.counts["aggregates"] += 1
        io.counts["aggregate_wire_bytes"] += total_len(sealed)  # one peer's copy
        io.counts["aggregate_entries"] += agg.message.n_entries


__all__ = ["Chunk", "Codec", "Decoded", "RelayLog"]
