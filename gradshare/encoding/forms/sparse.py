"""The *sparse* form: the sorted entry indices as gaps (index - previous index - 1) in LEB128 varints
with the sign folded into bit 0, ``(gap << 1) | neg``; 1..9 bytes an entry (message.py has the header).

`sparse_decode_batch` is public: the relay's bounded add (blockmax.py) inlines it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from gradshare.encoding.forms.base import CodeSizes, CodeWriter, apply_buffers, byte_reader, check, filled, written
from gradshare.encoding.kernels import (
    CHECK_INDEX,
    CHECK_OK,
    CHECK_OVERLONG,
    CHECK_TRAILING,
    CHECK_TRUNCATED,
    apply_batch,
    prefetch_write,
)


@njit(nogil=True, cache=True, boundscheck=True)
def _sparse_write_from(codes, out, state):
    """Write the sparse form of ``codes`` into ``out`` (sized by forms.rice.measure) from ``state`` = (byte
    position, last index written), which it advances. Bounds-checked: codes that were not the ones measured
    raise IndexError instead of writing past ``out``."""
    pos = state[0]
    prev = state[1]
    for e in range(codes.size):
        c = codes[e]
        i = c >> 1
        v = ((i - prev - 1) << 1) | (c & 1)
        prev = i
        while v >= 0x80:
            out[pos] = (v & 0x7F) | 0x80
            pos += 1
            v >>= 7
        out[pos] = v
        pos += 1
    state[0] = pos
    state[1] = prev


class _SparseWriter:
    """The sparse payload a batch of codes at a time (base.CodeWriter)."""

    def __init__(self, sizes: CodeSizes) -> None:
        self.buf, self.n_entries, self.added = np.empty(sizes.varint_bytes, np.uint8), sizes.n_entries, 0
        self.state = np.array([0, -1], np.int64)  # byte position, last index

    def add(self, codes: np.ndarray) -> None:
        _sparse_write_from(codes, self.buf, self.state)
        self.added += codes.size

    def payload(self) -> bytes:
        return filled(self.buf, int(self.state[0]), self.n_entries, self.added, "sparse")


@njit(nogil=True, cache=True)
def _check_sparse(p, n_entries, n_params):
    """Read-only validation of an untrusted sparse payload. Returns a CHECK_* code."""
    m = p.size
    pos = 0
    prev = -1
    for _ in range(n_entries):
        v = 0
        shift = 0
        while True:
            if pos >= m:
                return CHECK_TRUNCATED
            b = np.int64(p[pos])
            pos += 1
            v |= (b & 0x7F) << shift
            if b < 0x80:
                if b == 0 and shift > 0:
                    return CHECK_OVERLONG
                break
            shift += 7
            if shift > 56:
                return CHECK_OVERLONG
        gap = v >> 1
        if gap >= n_params - prev - 1:  # index = prev + 1 + gap must stay < n_params
            return CHECK_INDEX
        prev = prev + 1 + gap
    if pos != m:
        return CHECK_TRAILING
    return CHECK_OK


@njit(nogil=True, cache=True, inline="always")
def sparse_decode_batch(p, pos, prev, out, cnt, params):
    """Decode ``cnt`` codes of a VALIDATED sparse payload from byte ``pos`` into out[:cnt].

    Returns (next pos, last index) so batches can follow one another. Prefetches each target in
    ``params`` as it is decoded unless ``params`` is empty (see apply_batch).
    """
    for t in range(cnt):
        b = np.int64(p[pos])
        pos += 1
        v = b & 0x7F
        shift = 7
        while b >= 0x80:
            b = np.int64(p[pos])
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
        i = prev + 1 + (v >> 1)
        out[t] = (i << 1) | (v & 1)
        if params.size:
            prefetch_write(params, i)
        prev = i
    return pos, prev


@njit(nogil=True, cache=True)
def _sparse_decode(p, n_entries, out):
    """Codes of a VALIDATED sparse payload into out[:n_entries]."""
    sparse_decode_batch(p, 0, -1, out, n_entries, np.empty(0, np.float32))


@njit(nogil=True, cache=True)
def _sparse_apply(p, n_entries, steps, params, batch):
    """params[i] += steps[neg] for every entry of a VALIDATED sparse payload, ``batch.size`` at a time."""
    pos = 0
    prev = -1
    done = 0
    while done < n_entries:
        cnt = min(batch.size, n_entries - done)
        pos, prev = sparse_decode_batch(p, pos, prev, batch, cnt, params)
        apply_batch(batch, cnt, steps, params)
        done += cnt


@njit(nogil=True, cache=True)
def _sparse_decode_from(p, pos, prev, out, cnt):
    """``cnt`` codes of a VALIDATED sparse payload from byte ``pos`` (after index ``prev``) into out[:cnt]."""
    return sparse_decode_batch(p, pos, prev, out, cnt, np.empty(0, np.float32))


@dataclass(frozen=True)
class SparseForm:
    """LEB128 varint gaps (module docstring)."""

    name: str = "sparse"
    tag: int = 1

    def size(self, sizes: CodeSizes) -> int | None:
        return sizes.varint_bytes

    def encode(self, codes: np.ndarray, sizes: CodeSizes) -> bytes:
        return written(self, codes, sizes)

    def writer(self, sizes: CodeSizes) -> CodeWriter:
        return _SparseWriter(sizes)

    def validate(self, payload: bytes, n_params: int, n_entries: int) -> np.ndarray:
        size = len(payload)
        # Each entry takes 1..9 bytes; reject impossible sizes before scanning.
        if not n_entries <= size <= 9 * n_entries:
            raise ValueError(f"sparse payload of {size} bytes cannot hold {n_entries} entries")
        reader = byte_reader(payload)
        check(self.name, _check_sparse(reader, n_entries, n_params))
        return reader

    def reader(self, payload: bytes) -> np.ndarray:
        return byte_reader(payload)

    def decode(self, reader: np.ndarray, n_entries: int, out: np.ndarray) -> None:
        _sparse_decode(reader, n_entries, out)

    def apply(self, reader: np.ndarray, n_entries: int, step: np.float32, params: np.ndarray) -> None:
        steps, batch = apply_buffers(step, n_entries)
        _sparse_apply(reader, n_entries, steps, params, batch)

    @property
    def start(self) -> tuple[int, int]:
        return 0, -1  # byte 0, before index 0

    def decode_batch(self, reader: np.ndarray, cursor: tuple[int, int], out: np.ndarray, cnt: int) -> tuple[int, int]:
        pos, prev = _sparse_decode_from(reader, cursor[0], cursor[1], out, cnt)
        return int(pos), int(prev)


SPARSE = SparseForm()
