"""A peer's inbound log, sans I/O: forwarded chunks into reassembly and the inbox, the log released in
canonical (step, rank) order (its own updates included), the ends of the ranks, and the NAKs of what is
missing. ``Inbound`` owns that state; the core hands it what it learns (WELCOME, STATUS, its own updates).

With aggregated forwarding (WELCOME says so) the log is the relay's one aggregated message per step:
origin AGGREGATE_ORIGIN, one slot per step (a one-slot cursor). It ends at the last step of the last rank
to end (each rank's end still comes from STATUS, the peer's own from ``finish``)."""

from __future__ import annotations

from collections import deque

from gradshare.errors import DecodeError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.peer.outbox import PeerOutbox
from gradshare.transport.protocol.peer.own import OwnLog
from gradshare.transport.protocol.reassembly import Reassembler
from gradshare.transport.protocol.tuning import PeerTuning
from gradshare.transport.protocol.wire import AGGREGATE_ORIGIN


class Inbound:
    def __init__(self, rank: int, world_size: int, max_message: int, tuning: PeerTuning, io: PeerOutbox) -> None:
        self.rank, self.world_size = rank, world_size
        self.tuning = tuning
        self.io = io
        self.cursor: LogCursor | None = None  # WELCOME starts the log
        self.aggregate = False  # the log is the relay's aggregate (set from WELCOME)
        self.rank_ends: dict[int, int] = {}  # aggregate mode: rank -> last step (the cursor has one slot)
        self.reasm: Reassembler[tuple[int, int]] = Reassembler(4096, 1 << 28, max_message)
        self.inbox: dict[tuple[int, int], ev.Update] = {}
        self.inbox_nbytes = 0
        self.ready: deque[ev.Update] = deque()
        self.known_high = [-1] * world_size
        # per rank: what the relay's STATUS says it holds contiguously (per-rank forwarding); known_high can
        # be ahead of it, since the relay forwards (t, r) before it has (t-1, r)
        self.status_high = [-1] * world_size
        self.missing: dict[tuple[int, int], list[float]] = {}  # key -> [first noticed, last NAK, NAKs]

    def start(self, msg: ev.Welcome) -> None:
        self.aggregate = msg.aggregate
        self.cursor = LogCursor(1 if msg.aggregate else self.world_size, msg.start_step)
        if msg.aggregate:
            self.known_high[0] = msg.complete_through

    # --- the log as the application reads it --------------------------------------------------------
    @property
    def complete_through(self) -> int:
        return -1 if self.cursor is None else self.cursor.complete_through

    def finished(self) -> bool:
        """The whole log is delivered: every rank ended and nothing of it is missing."""
        return self.cursor is not None and self.cursor.finished()

    def has_ready(self) -> bool:
        """An update is deliverable (``pop_ready`` returns it)."""
        return bool(self.ready)

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

    # --- what comes in -------------------------------------------------------------------------------
    def receive_chunk(self, h: wire.Header, body: bytes, now: float) -> None:
        """A chunk of a forwarded update (or of the relay's aggregate): into reassembly; a whole one into the
        inbox, and the log released as far as it goes."""
        cur = self.cursor
        if cur is None:
            self.io.chan.drops["before_welcome"] += 1
            return
        # origin: another rank of this job, or the aggregate (checked before authentication); the aggregate
        # has the cursor's one slot
        slot = 0 if self.aggregate else h.origin
        key = (h.step, slot)
        if key in self.inbox or h.step < cur.start_step or cur.done_before(*key):
            self.io.chan.drops["duplicate"] += 1
            return
        if cur.exists(*key) is False:
            self.io.chan.drops["after_end"] += 1
            return
        if h.step > cur.step + self.tuning.max_ahead:
            self.io.chan.drops["too_far_ahead"] += 1
            return
        if h.step > self.known_high[slot]:
            # the relay forwards only whole updates, so any chunk of (t, r) proves (t, r) exists: a partial
            # (t, r) can be NAKed at once, not only after r's next step shows up. Earlier steps of r may not
            # have reached the relay yet (per-rank forwarding is not in step order): nak_missing backs off
            # on those until STATUS says the relay has them
            self.known_high[slot] = h.step
        tuning = self.tuning
        if len(self.inbox) + len(self.ready) >= tuning.inbox_messages or self.inbox_nbytes >= tuning.inbox_bytes:
            self.io.chan.drops["inbox_full"] += 1  # safe: it is NAKed again once there is room
            return
        whole, reason = self.reasm.add(key, h.index, h.count, body, now)
        if reason is not None:
            self.io.chan.drops[reason] += 1
            return
        if whole is None:
            return
        try:
            payload, meta = wire.decode_update_body(whole)
        except DecodeError:
            self.io.chan.drops["bad_update"] += 1
            return
        self.known_high[slot] = max(self.known_high[slot], h.step)
        self.store(ev.Update(h.step, h.origin, payload, meta, now), slot)
        self.io.counts["updates_received"] += 1
        self.advance()

    def on_status(self, msg: ev.Status, own: OwnLog) -> None:
        """A STATUS page: what the relay holds of each rank on it, ours included (``own``), and the ranks
        that ended; then the log released as far as it goes."""
        cur = self.cursor
        assert cur is not None  # the core drops a STATUS before WELCOME
        if msg.start_step != cur.start_step or msg.world_size != self.world_size:
            self.io.chan.drops["stale_status"] += 1
            return
        first = msg.first_rank  # one page of ranks: the others come in other pages
        if self.aggregate:  # the relay made (and sent) every aggregate it has applied
            self.known_high[0] = max(self.known_high[0], msg.complete_through)
        else:
            for r, h in enumerate(msg.have, first):
                if h > self.known_high[r]:
                    self.known_high[r] = h
                if h > self.status_high[r]:
                    self.status_high[r] = h
        if first <= self.rank < first + len(msg.have):
            own.unacked.acked_through(msg.have[self.rank - first])
        for e in msg.ended:
            if e.rank == self.rank:
                own.on_end(e)
            elif e.rank not in (self.rank_ends if self.aggregate else cur.ends):
                self.rank_end(e.rank, e.last_step)
                self.io.emit(ev.PeerEnded(e.rank, e.last_step, e.gone, "declared gone" if e.gone else "finished"))
        self.advance()

    def store(self, u: ev.Update, slot: int | None = None) -> None:
        key = (u.step, u.sender if slot is None else slot)
        self.inbox[key] = u
        self.inbox_nbytes += len(u.payload)
        self.missing.pop(key, None)

    def rank_end(self, rank: int, last_step: int) -> None:
        """Rank ``rank`` has no step after ``last_step``. Aggregated, the log (one slot) ends once every
        rank has ended, at the latest of their ends: each step up to it has a message of some rank."""
        assert self.cursor is not None  # WELCOME set it: joined states come after it
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
        """Release the log in canonical order as far as the inbox holds it."""
        cur = self.cursor
        assert cur is not None  # WELCOME set it: joined states come after it
        while True:
            key = cur.next_key()
            if key is None:
                return
            u = self.inbox.pop(key, None)
            if u is None:
                return
            self.ready.append(u)
            self.io.counts["delivered"] += 1
            cur.advance()

    # --- repair --------------------------------------------------------------------------------------
    def nak_missing(self, now: float, srtt: float | None) -> None:
        """NAK what the peer knows exists but is missing: from STATUS ``have`` and from later steps it saw."""
        cur = self.cursor
        if cur is None:
            return
        items: list[ev.NakItem] = []
        limit = cur.step + self.tuning.max_ahead
        # How long a chunk may be late before we call it lost: ``nak_delay`` (the reorder allowance), or
        # the smoothed RTT when that is longer: a loaded machine delays datagrams by about a round trip,
        # and NAKing them anyway doubles the traffic exactly when there is least room for it.
        # Re-NAK when the answer is overdue, after two of those: a lost NAK or retransmission then costs
        # a few ms, not a fixed 50 ms that stalls the whole staleness window (at 5 % loss nearly every
        # step needs a repair). Before the first RTT sample: ``nak_interval``.
        delay = self.tuning.nak_delay if srtt is None else max(self.tuning.nak_delay, srtt)
        renak = 2 * delay if srtt is not None else self.tuning.nak_interval

        def unproven(r: int, step: int) -> bool:  # may the relay not have (step, r) yet?
            return not self.aggregate and step > self.status_high[r]

        slots = (
            ((0, AGGREGATE_ORIGIN),) if self.aggregate else ((r, r) for r in range(self.world_size) if r != self.rank)
        )
        for r, origin in slots:
            end = cur.ends.get(r)
            hi = end if end is not None else self.known_high[r]
            t = cur.step if r >= cur.rank else cur.step + 1
            while t <= min(hi, limit) and len(items) < ev.MAX_NAK_ITEMS:
                key = (t, r)
                t += 1
                if key in self.inbox:
                    continue
                m = self.missing.get(key)
                if m is None:
                    self.missing[key] = [now, -1e18, 0]
                    continue
                p = self.reasm.partials.get(key)
                if now - m[0] < delay:
                    continue  # maybe just reordered: give it a moment
                if p is not None:
                    if now - p.last_seen < delay:
                        continue  # chunks are still arriving
                    if p.last_seen < m[1] and now - m[1] < renak:
                        continue  # nothing new since our last NAK: its answer may be late
                elif now - m[1] < renak * (1 << min(max(int(m[2]) - 1, 0), 4) if unproven(r, key[0]) else 1):
                    # the relay may not have it yet: per-rank forwarding is not in step order, so a later
                    # step of r seen here does not prove it reached the relay. Asking at the flat rate
                    # meanwhile made W - 1 peers flood a relay that could not keep up with NAKs it could
                    # not answer, crowding out the origin's own retransmission (a slowed relay at
                    # N = 32): back off, at most 16x, until STATUS says the relay holds it
                    continue
                m[1] = now
                m[2] += 1
                items.append(ev.NakItem(key[0], origin, p.missing(ev.MAX_NAK_ITEMS) if p else ()))
        if items:
            self.io.send(ev.Nak(tuple(items)))
            self.io.counts["naks_sent"] += 1


__all__ = ["Inbound"]
