"""Kernels of the relay's aggregation residual with a per-block bound (used by aggregate.py).

Why (p99 at N = 32): the relay re-encodes its whole residual every step, and the plain encoder
(kernels.encode_codes) reads all of it: 40 MB at 10 M parameters, ~3 ms on a quiet core and three
times that on a loaded one. Only a few blocks can hold an entry: the residual changes only where a
rank's message adds ±τ_r, and after an encode every block is below the block's own maximum. So the
residual carries ``bound``: for each block of ``1 << shift`` values an upper bound of |r| there (NaN or
inf when a value is not finite). Adding a message raises the bound of the blocks it touches; the encode
reads only the blocks whose bound reaches τ and sets their bound to the exact maximum it leaves.

The results are the plain kernels', bit for bit (tests/encoding/test_aggregate_kernels.py against naive oracles):
the adds are the same float32 additions in the same order, and the encode emits and reduces the same
entries, in index order. A skipped block holds no |r| >= τ and nothing non-finite, since its bound is
below τ.

Conventions as kernels.py: entry codes ``(i << 1) | neg``; kernels (``_name``) validate nothing and
allocate nothing; the public functions at the end take what aggregate.py has checked.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gradshare.encoding import kernels
from gradshare.encoding.forms.rice import rice_decode_batch
from gradshare.encoding.forms.sparse import sparse_decode_batch

# 64 float32 values (four cache lines) a block: on the aggregate's residual of bench scale (10 M
# parameters, density 1e-3, N = 4..32) the encode then reads 6-7 % of the blocks, where 22-39 % of
# 256-value blocks hold an entry; the bound array (n / 64 float32, 625 kB at 10 M) stays in L2
SHIFT = 6

OK = kernels.OK
FULL = kernels.FULL
NONFINITE = kernels.NONFINITE


@njit(nogil=True, cache=True, inline="always")
def _add_batch_bounded(batch, cnt, steps, r, bound, shift):
    """r[i] += steps[neg] for the first ``cnt`` codes of ``batch`` (as kernels.apply_batch), raising the
    bound of each block it changes to cover |r[i]| (a NaN sticks: NaN > x is false, and x != x is true
    only for a NaN)."""
    for t in range(cnt):
        c = batch[t]
        i = c >> 1
        x = r[i] + steps[c & 1]
        r[i] = x
        a = abs(x)
        b = i >> shift
        v = bound[b]
        bound[b] = a if (a > v or a != a) else v  # a select, not a branch: it is taken at random


@njit(nogil=True, cache=True)
def _payload_add_bounded(rice, sparse_bytes, rice_words, n_entries, steps, r, bound, shift, batch):
    """_add_batch_bounded over a VALIDATED payload, ``batch.size`` codes at a time, prefetching each
    target in ``r`` as it is decoded (as the sparse and rice forms' apply): the rice form from
    ``rice_words`` (forms.rice.padded_words) if ``rice``, else the sparse form from ``sparse_bytes``."""
    pos = 8 if rice else 0  # rice: a bit position after the k byte; sparse: a byte position
    prev = -1
    done = 0
    while done < n_entries:
        cnt = min(batch.size, n_entries - done)
        if rice:
            pos, prev = rice_decode_batch(rice_words, pos, prev, batch, cnt, r)
        else:
            pos, prev = sparse_decode_batch(sparse_bytes, pos, prev, batch, cnt, r)
        _add_batch_bounded(batch, cnt, steps, r, bound, shift)
        done += cnt


@njit(nogil=True, cache=True)
def _codes_add_bounded(codes, steps, r, bound, shift):
    """_add_batch_bounded over decoded codes (the bitmap form, rare on a relay's inbound messages)."""
    _add_batch_bounded(codes, codes.size, steps, r, bound, shift)


# blocks fetched ahead of the one being encoded: a block read is a random access (its 4 cache lines
# come from memory one block after another otherwise, ~200 ns each, as slow as the full scan)
AHEAD = 8


@njit(nogil=True, cache=True)
def _encode_bounded(r, bound, shift, tau, out, k, start, todo):
    """Emit every |r[i]| >= tau into ``out`` from ``k`` on and reduce it by τ, reading only the blocks
    from ``start`` on whose bound is not below τ; each block read gets its exact max |r| as its bound.
    ``todo``: scratch of bound.size block numbers.

    Returns (k, block, status): OK with block == bound.size; FULL when block ``block``'s entries do not
    fit ``out`` (grow it and call again from that block: nothing of it was changed); NONFINITE when
    block ``block`` holds a NaN or ±inf (blocks before it are emitted and reduced, it is not)."""
    n = r.size
    width = 1 << shift
    m_todo = 0
    for b in range(start, bound.size):
        if not bound[b] < tau:  # a NaN bound is read too
            todo[m_todo] = b
            m_todo += 1
    for q in range(m_todo):
        if q + AHEAD < m_todo:
            ahead = todo[q + AHEAD] << shift
            for line in range(0, min(width, n - ahead), 16):  # 16 float32 = one 64-byte line
                kernels.prefetch_write(r, ahead + line)
        b = todo[q]
        lo = b << shift
        rb = r[lo : min(lo + width, n)]
        cnt = np.int32(0)
        bad = np.int32(0)
        for j in range(rb.size):
            a = abs(rb[j])
            cnt += np.int32(a >= tau)
            bad += np.int32(not (a <= kernels.FLT_MAX))
        if bad:
            return k, b, NONFINITE
        if k + cnt > out.size:
            return k, b, FULL
        m = np.float32(0.0)
        for j in range(rb.size):
            x = rb[j]
            if x >= tau:
                out[k] = (lo + j) << 1
                x = x - tau
                rb[j] = x
                k += 1
            elif x <= -tau:
                out[k] = ((lo + j) << 1) | 1
                x = x + tau
                rb[j] = x
                k += 1
            m = max(m, abs(x))
        bound[b] = m
    return k, bound.size, OK


def n_blocks(n: int, shift: int = SHIFT) -> int:
    """Blocks of ``1 << shift`` values covering ``n`` values."""
    return -(-n >> shift)


def add_sparse(
    reader: np.ndarray, n_entries: int, steps: np.ndarray, r: np.ndarray, bound: np.ndarray, batch: np.ndarray
) -> None:
    """r += a validated sparse payload's ±steps (its reader), keeping the bound."""
    _payload_add_bounded(False, reader, _NO_WORDS, n_entries, steps, r, bound, SHIFT, batch)


def add_rice(
    reader: np.ndarray, n_entries: int, steps: np.ndarray, r: np.ndarray, bound: np.ndarray, batch: np.ndarray
) -> None:
    """r += a validated rice payload's ±steps (its reader, the padded words), keeping the bound."""
    _payload_add_bounded(True, _NO_BYTES, reader, n_entries, steps, r, bound, SHIFT, batch)


def add_codes(codes: np.ndarray, steps: np.ndarray, r: np.ndarray, bound: np.ndarray) -> None:
    """r += ±steps at decoded entry codes, keeping the bound (any form)."""
    _codes_add_bounded(codes, steps, r, bound, SHIFT)


def encode_bounded(r: np.ndarray, bound: np.ndarray, tau: np.float32) -> np.ndarray:
    """The codes of every |r_i| >= τ, each reduced by τ, reading only blocks whose bound reaches τ
    (`_encode_bounded`, resumed after FULL). Raises kernels.NonFiniteAt with the first bad index."""
    out = np.empty(max(1024, r.size >> 8), np.int64)
    todo = np.empty(bound.size, np.int64)
    k, block = 0, 0
    while True:
        k, block, status = _encode_bounded(r, bound, SHIFT, tau, out, k, block, todo)
        if status == OK:
            return out[:k]
        if status == NONFINITE:
            lo = block << SHIFT
            raise kernels.NonFiniteAt(lo + int(np.flatnonzero(~np.isfinite(r[lo : lo + (1 << SHIFT)]))[0]))
        grown = np.empty(max(2 * out.size, k + (1 << SHIFT)), np.int64)  # FULL: the block did not fit
        grown[:k] = out[:k]
        out = grown


_NO_BYTES = np.empty(0, np.uint8)  # the payload argument of the form not in use
_NO_WORDS = np.empty(0, np.uint64)
