"""Squared norms of the tensors laid out in a flat float32 array, summed in float64 in a fixed order, so
that every replica and the relay get the same bits from the same values (the step cap's bounds, step_cap.py);
and the step cap's two passes over a step's entry codes: the squared norms of the messages summed by index
(`window_norms2`), and the capped add (`add_capped`), one loop over the codes each where NumPy took a sort,
a search and several temporaries per entry (benchmarks/step_cap.py: ~27 ns an entry each before).

Why not NumPy: `np.dot` / `np.linalg.norm` go through BLAS, whose summation order depends on the build and
the CPU (and a float32 dot accumulates in float32); two machines could then disagree in the last bit, and a
bound that differs by a bit can change a step's factor.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numpy.typing import NDArray


@njit(nogil=True, cache=True)
def _norms2(values, starts, ends, which, out):
    """out[k] = Σ values[starts[k]:ends[k]]² in float64 for each k where which[k]: eight running sums
    over the tensor's entries by index mod 8 from its start, then added in a fixed tree, so the result
    is the same bits wherever the tensor lies in memory (no fastmath: LLVM keeps this order)."""
    for k in range(starts.size):
        if not which[k]:
            continue
        lo, hi = starts[k], ends[k]
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
        i = lo
        while i + 8 <= hi:
            x0, x1 = np.float64(values[i]), np.float64(values[i + 1])
            x2, x3 = np.float64(values[i + 2]), np.float64(values[i + 3])
            x4, x5 = np.float64(values[i + 4]), np.float64(values[i + 5])
            x6, x7 = np.float64(values[i + 6]), np.float64(values[i + 7])
            a0 += x0 * x0
            a1 += x1 * x1
            a2 += x2 * x2
            a3 += x3 * x3
            a4 += x4 * x4
            a5 += x5 * x5
            a6 += x6 * x6
            a7 += x7 * x7
            i += 8
        tail = 0.0
        while i < hi:
            x = np.float64(values[i])
            tail += x * x
            i += 1
        out[k] = (((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))) + tail


@njit(nogil=True, cache=True)
def _window_norms2(codes, offsets, steps, starts, out):
    """out[t] += Σ over the window's indices i in tensor t of (Σ_j ±steps[j])², the inner sum over the runs j
    (one message each, ``codes[offsets[j]:offsets[j + 1]]``, sorted) that hold i, in run order from 0.0;
    the squares summed per tensor in index order from 0.0, then added to ``out`` (as NumPy's bincount)."""
    runs = offsets.size - 1
    pos = offsets[:-1].copy()
    window = np.zeros(out.size)
    t = 0
    while True:
        low = -1
        for j in range(runs):
            if pos[j] < offsets[j + 1]:
                i = codes[pos[j]] >> 1
                if low < 0 or i < low:
                    low = i
        if low < 0:
            break
        total = 0.0
        for j in range(runs):
            if pos[j] < offsets[j + 1] and (codes[pos[j]] >> 1) == low:
                total += -steps[j] if codes[pos[j]] & 1 else steps[j]
                pos[j] += 1
        while t + 1 < starts.size and starts[t + 1] <= low:
            t += 1
        window[t] += total * total
    for k in range(out.size):
        out[k] += window[k]


@njit(nogil=True, cache=True)
def _add_capped(codes, starts, steps, target):
    """target[i] += ±steps[tensor of i] for each sorted code (float32, in code order)."""
    t = 0
    for e in range(codes.size):
        c = codes[e]
        i = c >> 1
        while t + 1 < starts.size and starts[t + 1] <= i:
            t += 1
        v = steps[t]
        target[i] += -v if c & 1 else v


def window_norms2(
    runs: list[NDArray[np.int64]], steps: list[float], starts: NDArray[np.int64], out: NDArray[np.float64]
) -> None:
    """One window of the step cap's summed norms (step_cap.summed_norms2) added to ``out``: ``runs`` are the
    messages' sorted codes in the window (rank order), ``steps`` their ±step each."""
    offsets = np.cumsum([0, *(r.size for r in runs)]).astype(np.int64)
    codes = runs[0] if len(runs) == 1 else np.concatenate(runs)
    _window_norms2(codes, offsets, np.asarray(steps, np.float64), starts, out)


def add_capped(
    codes: NDArray[np.int64], starts: NDArray[np.int64], steps: NDArray[np.float32], target: NDArray[np.float32]
) -> None:
    """target[i] += ±steps[t] for each sorted code, t the tensor of index i (``starts``); the caller checked
    the indices against the target (decoded from validated messages of its size)."""
    _add_capped(codes, starts, steps, target)


def tensor_norms2(
    values: NDArray[np.float32], starts: NDArray[np.int64], which: NDArray[np.bool_]
) -> NDArray[np.float64]:
    """Per tensor (``starts``: each one's first index in ``values``, the last ending at its end), the
    squared norm in float64 where ``which`` says, 0 elsewhere; the same bits on every machine."""
    if values.dtype != np.float32 or values.ndim != 1:
        raise ValueError(f"values must be a 1-D float32 array, got {values.dtype} with {values.ndim} dimensions")
    if starts.shape != which.shape or (starts.size and (starts[0] != 0 or starts[-1] >= values.size)):
        raise ValueError(
            f"starts ({starts.size}) must begin at 0, stay below {values.size} and match which ({which.size})"
        )
    ends = np.append(starts[1:], values.size).astype(np.int64)
    out = np.zeros(starts.size)
    _norms2(values, starts.astype(np.int64), ends, which.astype(np.bool_), out)
    return out


__all__ = ["add_capped", "tensor_norms2", "window_norms2"]
