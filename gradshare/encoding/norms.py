"""Squared norms of the tensors laid out in a flat float32 array, summed in float64 in a fixed order, so
that every replica and the relay get the same bits from the same values (the step cap's bounds, step_cap.py).

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


def tensor_norms2(values: NDArray[np.float32], starts: NDArray[np.int64],
                  which: NDArray[np.bool_]) -> NDArray[np.float64]:
    """Per tensor (``starts``: each one's first index in ``values``, the last ending at its end), the
    squared norm in float64 where ``which`` says, 0 elsewhere; the same bits on every machine."""
    if values.dtype != np.float32 or values.ndim != 1:
        raise ValueError(f"values must be a 1-D float32 array, got {values.dtype} with {values.ndim} dimensions")
    if starts.shape != which.shape or (starts.size and (starts[0] != 0 or starts[-1] >= values.size)):
        raise ValueError(f"starts ({starts.size}) must begin at 0, stay below {values.size} and match "
                         f"which ({which.size})")
    ends = np.append(starts[1:], values.size).astype(np.int64)
    out = np.zeros(starts.size)
    _norms2(values, starts.astype(np.int64), ends, which.astype(np.bool_), out)
    return out


__all__ = ["tensor_norms2"]
