"""The relay's snapshot serving: the authoritative parameters and their step as a paced, NAK-repaired
chunk stream, one transfer per asking rank (out of the relay core, with its own tests).

Sans I/O like the cores: it says which chunks go to which rank; the relay seals and sends them. Memory
is bounded by ``max_snapshots`` copies of the parameters: ranks asking at the same step share one, and a
rank asking while every copy serves another step is told nothing (it asks again).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradshare.hashing import param_hash
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.rangeset import RangeSet

MAX_TICK = 0.05  # a late pacing tick sends what 50 ms allow, not the whole delay's worth


class Snapshot:
    __slots__ = ("snap_id", "step", "data", "digest", "n_params")

    def __init__(self, snap_id: int, step: int, params: np.ndarray) -> None:
        self.snap_id = snap_id
        self.step = step
        self.n_params = params.size
        self.data = np.ascontiguousarray(params, dtype=np.float32).tobytes()  # one copy of the parameters
        self.digest = param_hash(params)


class Transfer:
    """One paced snapshot transfer to one rank: a first pass in order, then NAKed ranges."""

    __slots__ = ("snap", "next_index", "n_chunks", "resend", "last_activity", "chunk_bytes")

    def __init__(self, snap: Snapshot, chunk_bytes: int, now: float) -> None:
        self.snap = snap
        self.chunk_bytes = chunk_bytes
        self.n_chunks = max(1, -(-len(snap.data) // chunk_bytes))
        self.next_index = 0
        self.resend = RangeSet()
        self.last_activity = now

    def info(self) -> ev.SnapInfo:
        return ev.SnapInfo(
            self.snap.snap_id, self.snap.step, self.snap.n_params, self.n_chunks, self.chunk_bytes, self.snap.digest
        )

    def take(self, budget: int) -> list[int]:
        out: list[int] = []
        for a, b in list(self.resend):
            for i in range(a, min(b, a + budget - len(out))):
                out.append(i)
            if len(out) >= budget:
                break
        if out:
            # remove what we took from the resend set (it is sorted; we took a prefix of it)
            self.resend.discard_below(out[-1] + 1)
        while len(out) < budget and self.next_index < self.n_chunks:
            out.append(self.next_index)
            self.next_index += 1
        return out

    def chunk(self, i: int) -> bytes:
        return self.snap.data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]


class SnapshotServer:
    """``rate`` bytes/s shared by every transfer, at most ``burst`` bytes per tick (a burst must fit the
    receivers' socket buffers: the relay's shell caps it from its own, ``cap_burst``); a transfer that
    heard nothing for ``idle_timeout`` s is dropped."""

    def __init__(self, chunk_bytes: int, rate: float, burst: int, max_snapshots: int, idle_timeout: float) -> None:
        self.chunk_bytes = chunk_bytes
        self.rate = rate
        self.burst = burst
        self.max_snapshots = max_snapshots
        self.idle_timeout = idle_timeout
        self.snapshots: dict[int, Snapshot] = {}
        self.transfers: dict[int, Transfer] = {}  # rank -> transfer
        self._seq = 0

    def request(self, rank: int, step: int, params: np.ndarray, now: float) -> Transfer | None:
        """Rank ``rank`` asks (again) for the parameters, which hold the log through ``step``: its
        transfer (new or in flight), or None when every snapshot copy serves another step."""
        t = self.transfers.get(rank)
        if t is None:
            snap = next((s for s in self.snapshots.values() if s.step == step), None)
            if snap is None:
                if len(self.snapshots) >= self.max_snapshots:
                    self._free()
                if len(self.snapshots) >= self.max_snapshots:
                    return None  # the peer asks again; an in-flight transfer finishes first
                self._seq += 1
                snap = self.snapshots[self._seq] = Snapshot(self._seq, step, params)
            t = self.transfers[rank] = Transfer(snap, self.chunk_bytes, now)
        t.last_activity = now
        return t

    def nak(self, rank: int, snap_id: int, ranges: tuple[tuple[int, int], ...], now: float) -> bool:
        """Chunks the rank is missing; False if it names no transfer of ours (a stale SNAP_NAK)."""
        t = self.transfers.get(rank)
        if t is None or t.snap.snap_id != snap_id:
            return False
        for a, b in ranges:
            if b <= t.n_chunks:
                t.resend.add(a, b)
        t.last_activity = now
        return True

    def done(self, rank: int, snap_id: int) -> None:
        t = self.transfers.get(rank)
        if t is not None and t.snap.snap_id == snap_id:
            del self.transfers[rank]
            self._free()

    def pace(self, now: float, last_tick: float, abandoned: Callable[[int], bool]) -> list[tuple[int, Transfer, int]]:
        """(rank, transfer, chunk index) to send now; drops the transfers of ranks ``abandoned`` says left
        or ended, and of those idle past ``idle_timeout``."""
        if not self.transfers:
            return []
        dt = min(max(now - last_tick, 0.0), MAX_TICK)
        burst = min(self.rate * dt, self.burst)
        budget = max(1, int(burst / self.chunk_bytes / len(self.transfers)))
        out: list[tuple[int, Transfer, int]] = []
        for rank, t in list(self.transfers.items()):
            if now - t.last_activity > self.idle_timeout or abandoned(rank):
                del self.transfers[rank]
                self._free()
                continue
            out.extend((rank, t, i) for i in t.take(budget))
        return out

    def cap_burst(self, nbytes: int) -> None:
        self.burst = min(self.burst, nbytes)

    def clear(self) -> None:
        self.transfers.clear()
        self.snapshots.clear()

    def _free(self) -> None:
        used = {t.snap.snap_id for t in self.transfers.values()}
        for sid in [s for s in self.snapshots if s not in used]:
            del self.snapshots[sid]
