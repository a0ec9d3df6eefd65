"""A peer's snapshot download, sans I/O: SNAP_REQUEST, the chunks of SNAP_INFO's transfer into a buffer
(the caller's own, or a new one), NAKs of the gaps, the hash check and SNAP_DONE (relay side:
relay/snapshots.py)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from gradshare.hashing import param_hash
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.peer.outbox import PeerOutbox
from gradshare.transport.protocol.rangeset import RangeSet
from gradshare.transport.protocol.tuning import PeerTuning


class SnapshotDownload:
    __slots__ = ("info", "buf", "into", "got", "last_chunk", "total")

    def __init__(self, info: ev.SnapInfo, now: float, into: NDArray[np.float32] | None = None) -> None:
        self.info = info
        self.total = info.n_params * 4
        # into: chunks land straight in the caller's parameter buffer (no second copy of the
        # model in a worker that takes its initial weights from the relay)
        self.into = into
        # into.data is memoryview(into) (numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only)
        self.buf = bytearray(self.total) if into is None else into.data.cast("B")
        self.got = RangeSet()
        self.last_chunk = now


class SnapshotFetch:
    """A peer's downloads, one at a time; ``result`` is the last one completed."""

    def __init__(self, n_params: int, tuning: PeerTuning, io: PeerOutbox) -> None:
        self.n_params = n_params
        self.rto, self.nak_interval = tuning.rto, tuning.nak_interval
        self.io = io
        self.requested = False
        self.download: SnapshotDownload | None = None
        self.result: tuple[int, NDArray[np.float32]] | None = None
        self.into: NDArray[np.float32] | None = None  # fetch_snapshot(into=...): the download's destination
        self.done_id: int | None = None  # the last completed download's snap_id (ask)
        self.last_request = -1e18

    def request(self, now: float) -> None:
        self.requested = True
        self.download = None
        self.result = None
        self.ask(now)

    def ask(self, now: float) -> None:
        """SNAP_REQUEST, after SNAP_DONE of the previous download again. The relay answers a rank's request
        with that rank's transfer in flight, and a finished one stays in flight until its SNAP_DONE: lost,
        the next fetch got the old step's snapshot; sent late (the shell sends it from the receiver thread,
        a fetch after it can overtake it), it removed the transfer the relay had just named to us."""
        self.last_request = now
        if self.done_id is not None:
            self.io.send(ev.SnapDone(self.done_id))
        self.io.send(ev.SnapRequest())

    def progress(self) -> tuple[int, int] | None:
        s = self.download
        return None if s is None else (s.got.count(), s.info.n_chunks)

    def on_info(self, msg: ev.SnapInfo, now: float) -> None:
        if not self.requested or (self.download is not None and self.download.info.snap_id == msg.snap_id):
            return
        n_params = self.n_params
        total = n_params * 4
        if (
            msg.n_params != n_params
            or msg.n_chunks * msg.chunk_bytes < total
            or (msg.n_chunks - 1) * msg.chunk_bytes >= total
        ):
            self.io.chan.drops["bad_snapshot_info"] += 1
            return
        self.download = SnapshotDownload(msg, now, self.into)

    def on_chunk(self, h: wire.Header, body: bytes, now: float) -> None:
        drops = self.io.chan.drops
        s = self.download
        if s is None or h.step != s.info.snap_id or h.count != s.info.n_chunks:
            drops["stale_snapshot"] += 1
            return
        start = h.index * s.info.chunk_bytes
        expected = min(s.info.chunk_bytes, s.total - start)
        if len(body) != expected:
            drops["bad_snapshot_chunk"] += 1
            return
        s.last_chunk = now
        if not s.got.add(h.index):
            drops["duplicate"] += 1
            return
        s.buf[start : start + expected] = body
        if s.got.covers(0, s.info.n_chunks):
            self._complete(s)

    def _complete(self, s: SnapshotDownload) -> None:
        io = self.io
        params = np.frombuffer(s.buf, dtype=np.float32).copy() if s.into is None else s.into
        io.send(ev.SnapDone(s.info.snap_id))
        if param_hash(params) != s.info.digest:
            io.fail_with(f"snapshot {s.info.snap_id} (step {s.info.step}) failed its hash check", ev.SnapshotFailed)
            return
        self.result = (s.info.step, params)
        self.done_id = s.info.snap_id
        self.download = None
        self.requested = False
        self.into = None
        io.emit(ev.SnapshotReady(s.info.step, params))

    def on_timer(self, now: float) -> None:
        if not self.requested:
            return
        io, s = self.io, self.download
        if s is None:
            if now - self.last_request >= self.rto:
                self.ask(now)
            return
        if now - s.last_chunk < 2 * self.nak_interval:
            return
        s.last_chunk = now
        if now - self.last_request >= self.rto:
            # no chunk came: the relay may have dropped the transfer (idle, or a late SNAP_DONE of
            # ours named its id), and it drops NAKs of a transfer it does not hold. A request gets
            # a new one, or the same SNAP_INFO again, which is ignored.
            self.last_request = now
            io.send(ev.SnapRequest())
        gaps = s.got.gaps(0, s.info.n_chunks, 8 * ev.MAX_NAK_ITEMS)
        for i in range(0, len(gaps), ev.MAX_NAK_ITEMS):
            io.send(ev.SnapNak(s.info.snap_id, tuple(gaps[i : i + ev.MAX_NAK_ITEMS])))
        io.counts["snapshot_naks"] += 1


__all__ = ["SnapshotDownload", "SnapshotFetch"]
