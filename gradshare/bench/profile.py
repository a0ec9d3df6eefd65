"""Where a gradshare step goes: compute, encode, send, wait, apply (issue 5 asks misses to be explained
from such profiles, not guesses).

The worker (gradshare/worker.py) has no timing hooks, so the benchmark swaps in subclasses for the
duration of one `fit`, in the benchmark process only:

- on the driver, `profiled()` points `gradshare.worker.train_partition` at `profiled_train_partition`
  (SharedTrainer looks it up when it launches the job, and Spark pickles it by reference);
- in each task, `profiled_train_partition` runs the ordinary `train_partition` with `Worker` and
  `ApplyLog` replaced by `ProfiledWorker` / `TimedApplyLog`, which time the same code paths.

`ProfiledWorker._step` runs `Worker._step` unchanged; a wrapped `encode_step` and the peer proxy's
`send_update` stamp when the encode and the send begin (a timing hook in worker.py would make these
swaps unnecessary, see the issue-5 report). Each rank's report gets
a "profile" entry: per-step seconds of every phase, the step wall time (evaluation excluded), the
accuracy curve on rank 0 against training wall-clock, and the `lo` transmit counter over the steps.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from gradshare import encoding as _encoding
from gradshare import worker as _worker

PHASES = ("compute", "encode", "send", "wait", "apply")
_ORIGINAL_TRAIN_PARTITION = _worker.train_partition
_ORIGINAL_ENCODE_STEP = _encoding.encode_step


def lo_tx_bytes() -> int | None:
    """Bytes transmitted on `lo` in THIS process's network namespace (/proc/net/dev is per namespace;
    /sys/class/net shows the namespace that mounted sysfs). On loopback every byte sent is counted
    once in tx. None when the counter cannot be read."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])  # rx: 8 fields, then tx bytes
    except (OSError, ValueError, IndexError):
        return None
    return None


_MARKS: dict[str, float] = {}  # when the current step's encode / send began (one task per process)


def _timed_encode_step(*args, **kwargs):
    _MARKS["encode"] = time.perf_counter()
    return _ORIGINAL_ENCODE_STEP(*args, **kwargs)


class _TimingPeer:
    """Delegates to the real Peer; time blocked in `receive` is the step's "wait"; stamps the send."""

    def __init__(self, peer, current: dict):
        self._peer, self._current = peer, current

    def send_update(self, *args, **kwargs):
        _MARKS["send"] = time.perf_counter()
        return self._peer.send_update(*args, **kwargs)

    def receive(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._peer.receive(*args, **kwargs)
        finally:
            self._current["wait"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._peer, name)


class TimedApplyLog(_worker.ApplyLog):
    """ApplyLog whose `apply_through` time, minus the wait inside it, is the step's "apply"."""

    def apply_through(self, step: int) -> None:
        current = self.peer._current
        t0, wait0 = time.perf_counter(), current["wait"]
        super().apply_through(step)
        current["apply"] += (time.perf_counter() - t0) - (current["wait"] - wait0)


class ProfiledWorker(_worker.Worker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._current = dict.fromkeys(PHASES, 0.0)
        self._steps: dict[str, list[float]] = {p: [] for p in (*PHASES, "wall")}
        self._curve: list[tuple[float, float | None]] = []
        self._clock = 0.0  # training wall-clock: sum of step walls (evaluation excluded)
        self._mark = None
        self._lo = [None, None]

    def _fresh_epoch(self, peer) -> dict:
        self._mark = time.perf_counter()  # after an evaluation: its time is not a step's
        if self._lo[0] is None:
            self._lo[0] = lo_tx_bytes()
        return super()._fresh_epoch(peer)

    def _step(self, peer, t: int, epoch: int, b: int) -> tuple[float, int, int]:
        # Worker._step unchanged; the encode_step wrapper and _TimingPeer.send_update stamp when the
        # encode and the send begin, which splits the step into compute | encode | send.
        cur = self._current
        t0 = time.perf_counter()
        out = super()._step(peer, t, epoch, b)
        t3 = time.perf_counter()
        t1, t2 = _MARKS.pop("encode"), _MARKS.pop("send")
        cur["compute"] += t1 - t0  # batch, forward, backward, optimizer step, update extraction
        cur["encode"] += t2 - t1  # encode_step (τ rule, clipping) + to_bytes
        cur["send"] += t3 - t2
        wall = t3 - self._mark
        self._mark = t3
        self._clock += wall
        for p in PHASES:
            self._steps[p].append(cur[p])
            cur[p] = 0.0
        self._steps["wall"].append(wall)
        if t == self.cfg.total_steps(self.rank) - 1:
            self._lo[1] = lo_tx_bytes()
        return out

    def _close_epoch(self, peer, epoch: int, acc: dict) -> dict:
        row = super()._close_epoch(peer, epoch, acc)  # rank 0 evaluates here
        self._curve.append((self._clock, row["val_metric"]))
        return row

    def run(self, peer, start_step: int) -> dict:
        report = super().run(_TimingPeer(peer, self._current), start_step)
        lo0, lo1 = self._lo
        report["profile"] = {
            "steps": self._steps,
            "curve": self._curve,
            "lo_tx_bytes": None if lo0 is None or lo1 is None else lo1 - lo0,
        }
        return report


def profiled_train_partition(cfg, rows):
    """`train_partition` with the profiled Worker/ApplyLog/encode_step (runs inside the Spark task;
    Worker._step imports encode_step from gradshare.encoding when it runs)."""
    saved = _worker.Worker, _worker.ApplyLog, _encoding.encode_step
    _worker.Worker, _worker.ApplyLog, _encoding.encode_step = ProfiledWorker, TimedApplyLog, _timed_encode_step
    try:
        return _ORIGINAL_TRAIN_PARTITION(cfg, rows)
    finally:
        _worker.Worker, _worker.ApplyLog, _encoding.encode_step = saved


@contextlib.contextmanager
def profiled():
    """While active, SharedTrainer.fit launches `profiled_train_partition` (driver side)."""
    _worker.train_partition = profiled_train_partition
    try:
        yield
    finally:
        _worker.train_partition = _ORIGINAL_TRAIN_PARTITION


def summarise(steps: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """Mean seconds per step of each phase and of the wall time, skipping the first `warmup` steps
    (JIT compilation, allocator warm-up). "other" is the wall time no phase accounts for."""
    n = len(steps["wall"])
    skip = min(warmup, max(n - 1, 0))
    out = {k: float(np.mean(v[skip:])) if n else float("nan") for k, v in steps.items()}
    out["other"] = out["wall"] - sum(out[p] for p in PHASES)
    return out
