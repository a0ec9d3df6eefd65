"""A step's message without an array of all its entry codes: where a step is dense, its entries are
read in passes over the residual and written straight into the chosen form.

    message = plain_message(r, u, tau, base, rewind, form)    # encode (numpy_codec.encode)
    message = folded_message(q, p, inv, tau, step, form)      # the folded residual (numpy_codec.encode_folded)

Why: the encoders emit sorted int64 codes (8 bytes an entry) into a buffer that doubled whenever a block
did not fit. A sparse step's codes are small, but a dense one's (a fixed first τ, the warm-up's density,
Adam's first steps) are not: at 51.6 M parameters a worker's encode held ~320 MB of codes and their
regrowth for a payload of a few MB, 1.2 × the parameters' bytes above the rest of its step
(benchmarks/worker_memory.py --threshold 1e-3, docs/benchmarks/memory.md).

So the first buffer (n/256 codes, 0.4 % density: every sparse step) is never grown. A step whose entries
do not fit it goes on in passes over the rest of the vector, from the block where the buffer filled:
1. count the entries (read only; this finds a NaN or ±inf too), which sets the Rice candidates;
2. measure the forms' sizes (forms.rice.SizeTally) from the codes, CHUNK at a time (read only);
3. emit the codes again, CHUNK at a time, reducing the residual as the one-pass encode does, each batch
   written into the chosen form's payload (Form.writer).
The codes and the payload are those of the one-pass encode (tests/encoding/test_encode_passes.py); what
is held is the first buffer, one chunk and the payload. The two read-only passes cost a dense step two
more reads of the vector; sparse steps never take them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
from numba import njit

from gradshare.encoding import forms
from gradshare.encoding.forms.rice import SizeTally
from gradshare.encoding.kernels import (
    ADD,
    BLOCK,
    DIFF,
    DIFF_REWIND,
    NONFINITE,
    OK,
    NonFiniteAt,
    _accumulate_encode,
    _bad_count,
    _count_block,
    _count_folded_block,
    _folded_bad_count,
    _folded_encode,
    folded_bad_at,
    plain_bad_at,
)
from gradshare.encoding.message import Message

CHUNK = 1 << 16  # codes emitted at a time in the passes: 512 kB of int64


def first_buffer(n: int) -> np.ndarray:
    """The one buffer of codes a step fills before it goes on in passes: 0.4 % density (n/256)."""
    return np.empty(max(1024, n >> 8), np.int64)


@njit(nogil=True, cache=True)
def _count_plain(r, tau, start):
    """(entries of r from block ``start`` on, the position a NaN or ±inf stopped at or r.size, status)."""
    n = r.size
    total = 0
    pos = start
    while pos < n:
        stop = min(pos + BLOCK, n)
        rb = r[pos:stop]
        flagged = _count_block(rb, tau)
        if flagged and _bad_count(rb):
            return total, pos, NONFINITE
        total += flagged
        pos = stop
    return total, n, OK


@njit(nogil=True, cache=True)
def _count_folded(q, p, inv, tau, start):
    """`_count_plain` of r = (q − p)·inv."""
    n = q.size
    total = 0
    pos = start
    while pos < n:
        stop = min(pos + BLOCK, n)
        qb, pb = q[pos:stop], p[pos:stop]
        flagged = _count_folded_block(qb, pb, inv, tau)
        if flagged and _folded_bad_count(qb, pb, inv):
            return total, pos, NONFINITE
        total += flagged
        pos = stop
    return total, n, OK


class _Rest(Protocol):
    """The vector from the block where the first buffer filled: its entries counted, then emitted."""

    def count(self) -> int: ...

    def batches(self, reduce: bool) -> Iterator[np.ndarray]: ...


class _PlainRest:
    """r from ``start`` on, every update already accumulated into it."""

    def __init__(self, r: np.ndarray, tau: np.float32, start: int) -> None:
        self.r, self.tau, self.start = r, tau, start

    def count(self) -> int:
        total, pos, status = _count_plain(self.r, self.tau, self.start)
        if status == NONFINITE:
            raise NonFiniteAt(plain_bad_at(self.r, pos))
        return int(total)

    def batches(self, reduce: bool) -> Iterator[np.ndarray]:
        r, out, pos = self.r, np.empty(CHUNK, np.int64), self.start
        while pos < r.size:
            # added_end = r.size: the count-only loop, whatever the mode
            k, pos, status = _accumulate_encode(r, r, r, ADD, self.tau, out, 0, pos, r.size, reduce)
            if status == NONFINITE:  # the count pass found none: r changed under the encode
                raise NonFiniteAt(plain_bad_at(r, pos))
            yield out[:k]
            if status == OK:
                return


class _FoldedRest:
    """r = (q − p)·inv from ``start`` on; reducing an entry moves q by ∓step."""

    def __init__(
        self, q: np.ndarray, p: np.ndarray, inv: np.float32, tau: np.float32, step: np.float32, start: int
    ) -> None:
        self.q, self.p, self.inv, self.tau, self.step, self.start = q, p, inv, tau, step, start

    def count(self) -> int:
        total, pos, status = _count_folded(self.q, self.p, self.inv, self.tau, self.start)
        if status == NONFINITE:
            raise NonFiniteAt(folded_bad_at(self.q, self.p, self.inv, pos))
        return int(total)

    def batches(self, reduce: bool) -> Iterator[np.ndarray]:
        q, out, pos = self.q, np.empty(CHUNK, np.int64), self.start
        while pos < q.size:
            k, pos, status = _folded_encode(q, self.p, self.inv, self.tau, self.step, out, 0, pos, reduce)
            if status == NONFINITE:
                raise NonFiniteAt(folded_bad_at(q, self.p, self.inv, pos))
            yield out[:k]
            if status == OK:
                return


def _in_passes(head: np.ndarray, rest: _Rest, n_params: int, tau: float, form: str | None) -> Message:
    """The message of the codes in ``head`` followed by those of ``rest`` (module docstring)."""
    n_entries = head.size + rest.count()
    tally = SizeTally(n_params, n_entries)
    tally.add(head)
    for codes in rest.batches(reduce=False):
        tally.add(codes)
    sizes = tally.sizes()
    chosen = forms.smallest(sizes) if form is None else forms.named(form)
    writer = chosen.writer(sizes)
    writer.add(head)
    for codes in rest.batches(reduce=True):
        writer.add(codes)
    return Message.built(tau, n_params, n_entries, chosen, writer.payload())


def plain_message(
    r: np.ndarray, u: np.ndarray | None, threshold: float, base: np.ndarray | None, rewind: bool, form: str | None
) -> Message:
    """The message of the fused pass over r/u (u − base when base is given; kernels.encode_codes), its
    entries reduced in r. Raises NonFiniteAt with the first bad index."""
    n, tau = r.size, np.float32(threshold)
    out = first_buffer(n)
    added_end = 0 if u is not None else n
    uu = u if u is not None else r  # not read when added_end == n
    bb = uu if base is None else base
    mode = ADD if base is None else DIFF_REWIND if rewind else DIFF
    k, pos, status = _accumulate_encode(r, uu, bb, mode, tau, out, 0, 0, added_end)
    if status == NONFINITE:
        raise NonFiniteAt(plain_bad_at(r, pos))
    if status == OK:
        return Message.from_codes(out[:k], threshold, n, form)
    if added_end < n:
        # the block at pos is accumulated already; accumulate the rest, emitting nothing (τ = inf flags
        # only a NaN or ±inf), so that the passes read r as the one-pass encode would
        _, bad, done = _accumulate_encode(
            r, uu, bb, mode, np.float32(np.inf), out[:0], 0, pos, max(added_end, pos + BLOCK)
        )
        if done == NONFINITE:
            raise NonFiniteAt(plain_bad_at(r, bad))
    return _in_passes(out[:k], _PlainRest(r, tau, pos), n, threshold, form)


def folded_message(
    q: np.ndarray, p: np.ndarray, inv: np.float32, threshold: float, step: np.float32, form: str | None
) -> Message:
    """The message of r = (q − p)·inv, q moved by ∓step at each entry (kernels.folded_encode_codes).
    Raises NonFiniteAt with the first bad index."""
    tau = np.float32(threshold)
    out = first_buffer(q.size)
    k, pos, status = _folded_encode(q, p, inv, tau, step, out, 0, 0)
    if status == NONFINITE:
        raise NonFiniteAt(folded_bad_at(q, p, inv, pos))
    if status == OK:
        return Message.from_codes(out[:k], threshold, q.size, form)
    return _in_passes(out[:k], _FoldedRest(q, p, inv, tau, step, pos), q.size, threshold, form)


__all__ = ["CHUNK", "first_buffer", "folded_message", "plain_message"]
