"""A peer's inbound log, sans I/O: forwarded chunks into reassembly and the inbox, and the NAKs of what
is missing (peer/core.py owns the state; these are its receive and repair rules)."""

from __future__ import annotations

from collections import Counter, deque
from typing import Protocol

from gradshare.errors import DecodeError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.peer.outstanding import Outstanding
from gradshare.transport.protocol.reassembly import Reassembler
from gradshare.transport.protocol.tuning import PeerTuning
from gradshare.transport.protocol.wire import AGGREGATE_ORIGIN


class InboundCore(Protocol):
    """What these rules use of the peer's state: peer/core.py PeerCore, which passes itself (a Protocol, so
    that this module need not import the core that imports it)."""

    rank: int
    world_size: int
    tuning: PeerTuning
    chan: Channel
    c: Counter[str]
    aggregate: bool
    cursor: LogCursor | None
    inbox: dict[tuple[int, int], ev.Update]
    inbox_nbytes: int
    ready: deque[ev.Update]
    reasm: Reassembler[tuple[int, int]]
    unacked: Outstanding
    known_high: list[int]
    status_high: list[int]
    missing: dict[tuple[int, int], list[float]]

    def store(self, u: ev.Update, slot: int | None = None) -> None: ...

    def advance(self) -> None: ...

    def send(self, msg: ev.ControlMessage) -> None: ...


def receive_update_chunk(core: InboundCore, h: wire.Header, body: bytes, now: float) -> None:
    """A chunk of a forwarded update (or of the relay's aggregate): into reassembly; a whole one into the
    inbox, and the log released as far as it goes."""
    cur = core.cursor
    if cur is None:
        core.chan.drops["before_welcome"] += 1
        return
    # origin: another rank of this job, or the aggregate (checked before authentication); the aggregate
    # has the cursor's one slot
    slot = 0 if core.aggregate else h.origin
    key = (h.step, slot)
    if key in core.inbox or h.step < cur.start_step or cur.done_before(*key):
        core.chan.drops["duplicate"] += 1
        return
    if cur.exists(*key) is False:
        core.chan.drops["after_end"] += 1
        return
    if h.step > cur.step + core.tuning.max_ahead:
        core.chan.drops["too_far_ahead"] += 1
        return
    if h.step > core.known_high[slot]:
        # the relay forwards only whole updates, so any chunk of (t, r) proves (t, r) exists: a partial
        # (t, r) can be NAKed at once, not only after r's next step shows up. Earlier steps of r may not
        # have reached the relay yet (per-rank forwarding is not in step order): nak_missing backs off
        # on those until STATUS says the relay has them
        core.known_high[slot] = h.step
    tuning = core.tuning
    if len(core.inbox) + len(core.ready) >= tuning.inbox_messages or core.inbox_nbytes >= tuning.inbox_bytes:
        core.chan.drops["inbox_full"] += 1         # safe: it is NAKed again once there is room
        return
    whole, reason = core.reasm.add(key, h.index, h.count, body, now)
    if reason is not None:
        core.chan.drops[reason] += 1
        return
    if whole is None:
        return
    try:
        payload, meta = wire.decode_update_body(whole)
    except DecodeError:
        core.chan.drops["bad_update"] += 1
        return
    core.known_high[slot] = max(core.known_high[slot], h.step)
    core.store(ev.Update(h.step, h.origin, payload, meta, now), slot)
    core.c["updates_received"] += 1
    core.advance()


def nak_missing(core: InboundCore, now: float) -> None:
    """NAK what the peer knows exists but is missing: from STATUS ``have`` and from later steps it saw."""
    cur = core.cursor
    if cur is None:
        return
    items: list[ev.NakItem] = []
    limit = cur.step + core.tuning.max_ahead
    # How long a chunk may be late before we call it lost: ``nak_delay`` (the reorder allowance), or
    # the smoothed RTT when that is longer: a loaded machine delays datagrams by about a round trip,
    # and NAKing them anyway doubles the traffic exactly when there is least room for it.
    # Re-NAK when the answer is overdue, after two of those: a lost NAK or retransmission then costs
    # a few ms, not a fixed 50 ms that stalls the whole staleness window (at 5 % loss nearly every
    # step needs a repair). Before the first RTT sample: ``nak_interval``.
    srtt = core.unacked.srtt
    delay = core.tuning.nak_delay if srtt is None else max(core.tuning.nak_delay, srtt)
    renak = 2 * delay if srtt is not None else core.tuning.nak_interval

    def unproven(r: int, step: int) -> bool:      # may the relay not have (step, r) yet?
        return not core.aggregate and step > core.status_high[r]

    slots = ((0, AGGREGATE_ORIGIN),) if core.aggregate else ((r, r) for r in range(core.world_size)
                                                             if r != core.rank)
    for r, origin in slots:
        end = cur.ends.get(r)
        hi = end if end is not None else core.known_high[r]
        t = cur.step if r >= cur.rank else cur.step + 1
        while t <= min(hi, limit) and len(items) < ev.MAX_NAK_ITEMS:
            key = (t, r)
            t += 1
            if key in core.inbox:
                continue
            m = core.missing.get(key)
            if m is None:
                core.missing[key] = [now, -1e18, 0]
                continue
            p = core.reasm.partials.get(key)
            if now - m[0] < delay:
                continue                        # maybe just reordered: give it a moment
            if p is not None:
                if now - p.last_seen < delay:
                    continue                    # chunks are still arriving
                if p.last_seen < m[1] and now - m[1] < renak:
                    continue                    # nothing new since our last NAK: its answer may be late
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
        core.send(ev.Nak(tuple(items)))
        core.c["naks_sent"] += 1


__all__ = ["InboundCore", "nak_missing", "receive_update_chunk"]
