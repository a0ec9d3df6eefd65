"""Per-phase step timers of the worker, on with worker_options={"profile": True} (benchmarks).

A benchmark target that is missed is explained from a profile, not guessed. The worker stamps the end of
each phase of a step (`lap`); the phases add up to the step's wall time except for the few statements
between two stamps, which show up as "other" in the lab's summary (benchmarks/lab/profile.py). When
profiling is off the worker holds `OFF`, whose methods do nothing (one call per phase, no clock read).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

# In step order. wait: blocked in peer.receive; apply: decoding and applying the log's messages;
# batch: building the batch; lookahead: k >= 1, adding own pending messages to P (and the checks);
# compute: forward + backward; snapshot: the in-place-change check (general path: keeping the twin
# equal to P if forward changed it); optimizer: optimizer.step() (direct path: writing into the
# residual); encode: accumulate + threshold (general path: u = P_after - P_before and restoring P in
# the same pass), to_bytes (+ the loss's float); send: handing the payload to the peer.
PHASES = ("wait", "apply", "batch", "lookahead", "compute", "snapshot", "optimizer", "encode", "send")


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


def threads_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far of every live thread of this process, by thread name (Linux
    /proc; empty elsewhere); the caller's own thread is "(calling thread)". Shows what competes with
    the training thread for the task's core."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = {}
    me = threading.current_thread()
    out["(calling thread)"] = time.thread_time()  # its native_id can be stale in a forked Spark worker
    for t in threading.enumerate():
        if t is me:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError, TypeError):
            continue
        out[t.name] = out.get(t.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


class StepProfile:
    """Seconds per step of every phase, the step's wall time, rank 0's metric against training time.

    `steps[phase][i]` is step i's time in that phase (steps counted from the run's first step);
    `curve` holds (training seconds so far, validation metric) at the end of every epoch, training
    seconds being the sum of step walls (evaluation excluded); `lo_tx_bytes` counts the loopback bytes
    sent over the steps (every process of the namespace included). `steps["cpu"]` is the training
    thread's own CPU time per step: wall − cpu − wait is time the thread was runnable but off its core
    (another process or thread had it). `threads_cpu` is every thread's CPU seconds over the steps.
    """

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {p: [] for p in (*PHASES, "wall", "cpu")}
        self.curve: list[tuple[float, float | None]] = []
        self._cur = dict.fromkeys(PHASES, 0.0)
        self._t0 = self._mark = self._cpu0 = 0.0
        self._threads0: dict[str, float] | None = None
        self._threads: dict[str, float] = {}
        self._clock = 0.0
        self._lo0: int | None = None
        self._lo1: int | None = None

    def begin(self) -> None:
        """A step starts now."""
        if self._lo0 is None:
            self._lo0 = lo_tx_bytes()
            self._threads0 = threads_cpu()
        self._cpu0 = time.thread_time()
        self._cur = dict.fromkeys(PHASES, 0.0)  # laps between steps (scoring an epoch) are no step's
        self._t0 = self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """`phase` ended now; it began at the previous stamp."""
        now = time.perf_counter()
        self._cur[phase] += now - self._mark
        self._mark = now

    def end(self) -> None:
        """The step ends now (what ran since the last stamp is in the wall time only: "other")."""
        wall = time.perf_counter() - self._t0
        self.steps["cpu"].append(time.thread_time() - self._cpu0)
        self._clock += wall
        for p in PHASES:
            self.steps[p].append(self._cur[p])
            self._cur[p] = 0.0
        self.steps["wall"].append(wall)

    def finish(self) -> None:
        """The last step is over (what follows, waiting for the others' last messages, is not counted)."""
        self._lo1 = lo_tx_bytes()
        now, before = threads_cpu(), self._threads0 or {}
        self._threads = {k: v - before.get(k, 0.0) for k, v in now.items()}

    def epoch(self, metric: float | None) -> None:
        self.curve.append((self._clock, metric))

    def score(self, index: int, metric: float | None) -> None:
        """The metric of the `index`-th epoch, known after its end (scoring.py scores it later)."""
        self.curve[index] = (self.curve[index][0], metric)

    def report(self) -> dict[str, Any]:
        lo = None if self._lo0 is None or self._lo1 is None else self._lo1 - self._lo0
        return {"steps": self.steps, "curve": self.curve, "lo_tx_bytes": lo, "threads_cpu": self._threads}


class Off:
    """The profile of a worker that is not profiled: every stamp is a no-op."""

    def begin(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def end(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def epoch(self, metric: float | None) -> None:
        pass

    def score(self, index: int, metric: float | None) -> None:
        pass


OFF = Off()
