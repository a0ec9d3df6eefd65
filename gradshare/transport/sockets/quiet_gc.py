"""Keep CPython's full garbage collections off the transport threads while a relay or peer runs.

Why (update latency p99 at N = 32): a full (generation 2) collection scans every object the
collector tracks, with the GIL held. After ``import torch, pyspark, gradshare`` that is ~233 k objects
and ~115 ms per pass; after importing only the encoding package (Numba) 75 k and ~35 ms. CPython starts
one whenever enough objects survived younger collections, which the relay's per-datagram bookkeeping
does within a second of traffic: in ``gradshare bench scale`` (N = 32, 60 steps) one 42 ms pass landed
in the relay thread and made the p99 54 ms against a p50 of 12 ms.

``gc.freeze()`` moves every object tracked now into a permanent generation that collections skip; the
objects made later are collected as before, so garbage cycles made while the job runs are still freed.
The price: a cycle that was already garbage when the freeze began is freed only after ``thaw`` (the
last shell of the process closed), not during the job.

Counted: several relays and peers in one process (tests, the benchmark's peer hosts) freeze once, and
the last to close thaws.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """A shell starts: freeze what the process tracks now, if no other shell already did."""
    global _holders
    with _lock:
        if _holders == 0:
            gc.freeze()
        _holders += 1


def release() -> None:
    """A shell closed (call once per ``hold``): the last one gives the frozen objects back to the
    collector (gc.unfreeze: they join the oldest generation)."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("quiet_gc.release() without a hold()")
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    """How many shells hold the freeze now (for tests and diagnostics)."""
    return _holders
