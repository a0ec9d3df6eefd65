"""The relay's snapshot serving alone (transport/protocol/relay/snapshots.py): shared copies, bounded memory, pacing,
NAK repair, abandoned and idle transfers."""

from __future__ import annotations

import numpy as np

from gradshare.hashing import param_hash
from gradshare.transport.protocol.relay.snapshots import SnapshotServer


def _server(**kw) -> SnapshotServer:
    opts = dict(chunk_bytes=64, rate=64 * 100 / 0.01, burst=1 << 20, max_snapshots=2, idle_timeout=10.0)
    return SnapshotServer(**{**opts, **kw})


def test_ranks_at_one_step_share_a_copy_and_memory_is_bounded():
    params = np.arange(100, dtype=np.float32)  # 400 bytes: 7 chunks of 64
    s = _server()
    a = s.request(0, 5, params, now=0.0)
    b = s.request(1, 5, params + 1, now=0.0)  # same step: the copy taken for rank 0
    assert a.snap is b.snap and a.info().digest == param_hash(params) and a.n_chunks == 7
    assert s.request(0, 6, params, now=0.1) is a  # a rank's transfer in flight is answered again as is
    c = s.request(2, 6, params, now=0.0)
    assert c.snap is not a.snap and len(s.snapshots) == 2
    assert s.request(3, 7, params, now=0.0) is None  # every copy serves a transfer: busy, ask again
    s.done(2, c.snap.snap_id)
    assert s.request(3, 7, params, now=0.0) is not None and len(s.snapshots) == 2  # the free copy went


def test_pacing_sends_every_chunk_once_then_what_was_nakked():
    params = np.arange(100, dtype=np.float32)
    s = _server()
    t = s.request(0, 5, params, now=0.0)
    sent = []
    now = 0.0
    while len(sent) < 7:
        now += 0.001  # rate 640 kB/s: 10 chunks per 1 ms tick... at most
        got = s.pace(now, now - 0.001, lambda rank: False)
        assert len(got) <= max(1, int(64 * 100 / 0.01 * 0.001 / 64))
        sent += [i for _, _, i in got]
    assert sent == list(range(7))
    assert b"".join(t.chunk(i) for i in sent) == params.tobytes()
    assert not s.nak(0, t.snap.snap_id + 1, ((0, 1),), now)  # names another snapshot: stale
    assert s.nak(0, t.snap.snap_id, ((2, 4), (6, 99)), now)  # a range past the end is ignored
    assert [i for _, _, i in s.pace(now + 0.01, now, lambda rank: False)] == [2, 3]


def test_abandoned_and_idle_transfers_are_dropped_with_their_copies():
    params = np.zeros(10, dtype=np.float32)
    s = _server(idle_timeout=1.0)
    s.request(0, 1, params, now=0.0)
    s.request(1, 2, params, now=0.0)
    assert {r for r, _, _ in s.pace(0.5, 0.0, lambda rank: rank == 1)} == {0}
    assert set(s.transfers) == {0} and len(s.snapshots) == 1
    assert s.pace(2.0, 1.9, lambda rank: False) == [] and not s.transfers and not s.snapshots
