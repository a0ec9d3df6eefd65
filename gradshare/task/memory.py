"""What a task's process holds: its resident set and peak (Linux /proc), and handing freed heap pages
back to the OS (the worker's report, benchmarks/worker_memory.py, benchmarks/spill_memory.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Literal


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc malloc_trim, every arena). Freed blocks below
    glibc's mmap threshold (which grows to 32 MB as large blocks are freed) stay in the process's RSS
    until trimmed: a worker's big transients (the snapshot's datagrams, the model's first storage) would
    otherwise sit under its steps' peak (benchmarks/worker_memory.py: ~60 MB on the 51.6 M MLP). Not every
    step: a step's transients are bounded batches now, and the pages a trim hands back are faulted in again
    by the next backward (docs/benchmarks/memory.md, "Heap trimming"). No-op where the C library is not glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to trim with
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


# libc's malloc_trim, False where there is none; looked up on first use
_malloc_trim: Callable[[int], int] | Literal[False] | None = None


def reset_peak_rss() -> int:
    """Restart this process's peak-RSS count (VmHWM) from its current RSS, which it returns: the task's
    baseline (interpreter, torch, pyspark). 0 where Linux's /proc is missing (no reports then).

    First hand the heap's free pages back to the OS (`release_free_memory`): a reused Python worker
    still holds the pages an earlier task freed, which would hide this task's allocations from the count."""
    release_free_memory()  # not glibc: the count may then read low in a reused worker
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: "5" resets the peak RSS
    except OSError:
        return 0
    return proc_status_bytes("VmRSS")


def proc_status_bytes(field: str) -> int:
    """A size field of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
