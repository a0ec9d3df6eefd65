"""The *bitmap* form: 2 bits per parameter, 4 parameters per byte, parameter i at bits 2*(i & 3) of
byte i >> 2; code 0b00 = nothing, 0b01 = +τ, 0b10 = −τ, 0b11 = reserved (rejected by the decoder).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from gradshare.encoding.forms.base import CodeSizes, CodeWriter, byte_reader, check, filled, written
from gradshare.encoding.kernels import CHECK_COUNT, CHECK_OK, CHECK_PADDING, CHECK_RESERVED


def bitmap_size(n_params: int) -> int:
    """Payload bytes of the bitmap form: 2 bits per parameter."""
    return (n_params + 3) // 4


@njit(nogil=True, cache=True, boundscheck=True)
def _bitmap_write(codes, out):
    """Set the 2-bit codes of ``codes`` into the ZEROED bitmap ``out`` (bounds-checked, as the other writers)."""
    for e in range(codes.size):
        c = codes[e]
        i = c >> 1
        out[i >> 2] |= np.uint8((1 + (c & 1)) << ((i & 3) << 1))


@njit(nogil=True, cache=True)
def _check_bitmap(p, n_params, n_entries):
    """Read-only validation of an untrusted bitmap payload (size already checked). Returns CHECK_*."""
    count = 0
    for q in range(p.size):
        b = np.int64(p[q])
        if b & (b >> 1) & 0x55:
            return CHECK_RESERVED
        marks = (b | (b >> 1)) & 0x55
        # popcount of the 4 possible marks (bits 0, 2, 4, 6)
        count += (marks & 1) + ((marks >> 2) & 1) + ((marks >> 4) & 1) + ((marks >> 6) & 1)
    tail = n_params & 3
    if tail and p.size and (np.int64(p[p.size - 1]) >> (tail << 1)):
        return CHECK_PADDING
    if count != n_entries:
        return CHECK_COUNT
    return CHECK_OK


@njit(nogil=True, cache=True)
def _bitmap_decode(p, out):
    """Codes of a VALIDATED bitmap payload into ``out`` (sized to its entry count)."""
    k = 0
    for q in range(p.size):
        b = np.int64(p[q])
        if b:
            for s in range(4):
                c = (b >> (s << 1)) & 3
                if c:
                    out[k] = (((q << 2) + s) << 1) | (c >> 1)
                    k += 1


@njit(nogil=True, cache=True)
def _bitmap_decode_from(p, i, out, cnt):
    """The next ``cnt`` codes of a VALIDATED bitmap from parameter ``i`` on into out[:cnt] (the caller
    keeps ``cnt`` within the entries left); returns the parameter after the last one decoded."""
    k = 0
    while k < cnt:
        b = np.int64(p[i >> 2])
        if b == 0:  # four untouched parameters: skip the byte
            i = ((i >> 2) + 1) << 2
            continue
        c = (b >> ((i & 3) << 1)) & 3
        if c:
            out[k] = (i << 1) | (c >> 1)
            k += 1
        i += 1
    return i


@njit(nogil=True, cache=True)
def _bitmap_apply(p, steps3, params):
    """params[i] += steps3[code_i] over a VALIDATED bitmap; steps3 = [0, +s, -s].

    Zero bytes (four untouched parameters) are skipped: a bitmap is chosen only for dense steps, but
    most bytes are still zero at densities around its break-even point.
    """
    for q in range(p.size):
        b = np.int64(p[q])
        if b:
            base = q << 2
            for s in range(4):
                c = (b >> (s << 1)) & 3
                if c:
                    params[base + s] += steps3[c]


class _BitmapWriter:
    """The bitmap a batch of codes at a time (base.CodeWriter): each code sets its own 2 bits."""

    def __init__(self, sizes: CodeSizes) -> None:
        self.buf, self.n_entries, self.added = np.zeros(bitmap_size(sizes.n_params), np.uint8), sizes.n_entries, 0

    def add(self, codes: np.ndarray) -> None:
        _bitmap_write(codes, self.buf)
        self.added += codes.size

    def payload(self) -> bytes:
        return filled(self.buf, self.buf.size, self.n_entries, self.added, "bitmap")


@dataclass(frozen=True)
class BitmapForm:
    """2 bits per parameter (module docstring): the smallest form only for dense steps."""

    name: str = "bitmap"
    tag: int = 2

    def size(self, sizes: CodeSizes) -> int | None:
        return bitmap_size(sizes.n_params)

    def encode(self, codes: np.ndarray, sizes: CodeSizes) -> bytes:
        return written(self, codes, sizes)

    def writer(self, sizes: CodeSizes) -> CodeWriter:
        return _BitmapWriter(sizes)

    def validate(self, payload: bytes, n_params: int, n_entries: int) -> np.ndarray:
        size = len(payload)
        if size != bitmap_size(n_params):
            raise ValueError(f"bitmap payload is {size} bytes, expected {bitmap_size(n_params)} for {n_params} params")
        reader = byte_reader(payload)
        check(self.name, _check_bitmap(reader, n_params, n_entries))
        return reader

    def reader(self, payload: bytes) -> np.ndarray:
        return byte_reader(payload)

    def decode(self, reader: np.ndarray, n_entries: int, out: np.ndarray) -> None:
        _bitmap_decode(reader, out)

    def apply(self, reader: np.ndarray, n_entries: int, step: np.float32, params: np.ndarray) -> None:
        _bitmap_apply(reader, np.array([0, step, -step], np.float32), params)

    @property
    def start(self) -> tuple[int, int]:
        return 0, -1  # parameter 0

    def decode_batch(self, reader: np.ndarray, cursor: tuple[int, int], out: np.ndarray, cnt: int) -> tuple[int, int]:
        after = int(_bitmap_decode_from(reader, cursor[0], out, cnt))
        return after, after - 1


BITMAP = BitmapForm()
