"""The *rice* form: Golomb-Rice coded index gaps (message.py has the header).

Payload: byte 0 = the Rice parameter k (0..RICE_MAX_K), then a bit stream, least significant bit of
each byte first. Per entry, with gap = index - previous index - 1 (previous starts at -1):
``gap >> k`` zeros, a one, the low k bits of gap, then the sign bit (1 = −τ). Unused bits of the last
byte are zero.

Why: index gaps of a random sparse update are close to geometric, for which a Rice code with
k ≈ log2(mean gap · ln 2) sits within a few percent of the entropy: ~1.55 bytes per entry at density
1e-3 against ~1.94 for LEB128 varints (the *sparse* form). Clustered entries (runs of neighbours with
rare long jumps) suit varints better; `encode` measures both and keeps the smaller.

Readers see the payload as little-endian uint64 words plus a zero word (`padded_words`) and take a
64-bit window at any bit offset from two words; with k <= 40 most entries decode from one window.

`measure` sizes the sparse and rice forms in one pass over the codes (the codec's form choice);
`rice_decode_batch` is public: the relay's bounded add (blockmax.py) inlines it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from gradshare.encoding.forms.base import CodeSizes, CodeWriter, apply_buffers, check, filled, written
from gradshare.encoding.kernels import (
    CHECK_INDEX,
    CHECK_OK,
    CHECK_OVERLONG,
    CHECK_PADDING,
    CHECK_TRAILING,
    CHECK_TRUNCATED,
    apply_batch,
    cttz,
    prefetch_write,
)

RICE_MAX_K = 40
PAD_WORDS = 1  # zero uint64 words readers need after the payload's words

_U1 = np.uint64(1)
_U63 = np.uint64(63)


def padded_words(payload: bytes) -> np.ndarray:
    """The payload as little-endian uint64 words, zero-padded by at least PAD_WORDS words."""
    n_words = (len(payload) + 7) // 8 + PAD_WORDS
    raw = np.zeros(n_words * 8, np.uint8)
    raw[: len(payload)] = np.frombuffer(payload, np.uint8)
    return raw.view("<u8").astype(np.uint64, copy=False)


@njit(nogil=True, cache=True, inline="always")
def _window(words, bitpos):
    """The 64 stream bits starting at bit ``bitpos`` (bit b = bit b % 64 of words[b // 64])."""
    w = bitpos >> 6
    sh = np.uint64(bitpos & 63)
    # (hi << 1) << (63 - sh) is hi << (64 - sh) without the undefined shift by 64 when sh == 0
    return (words[w] >> sh) | ((words[w + 1] << _U1) << (_U63 - sh))


@njit(nogil=True, cache=True)
def _rice_k0(n, n_params):
    """The first of the four Rice candidates k0..k0+3 around log2 of the mean gap (the optimum for
    geometric gaps is near log2(mean · ln 2)); each costs sum(gap >> k) + n·(k + 2) bits."""
    mean = (n_params - n) / max(n, 1)  # upper bound on the mean gap: entries can sit anywhere
    k0 = 0
    while k0 < RICE_MAX_K and (1 << (k0 + 1)) <= mean:
        k0 += 1
    return min(max(0, k0 - 2), RICE_MAX_K - 3)


@njit(nogil=True, cache=True)
def _tally(codes, k0, state):
    """Add a batch of sorted codes to ``state`` = (sparse form bytes, sum(gap >> k0 + j) for j = 0..3,
    last index): the sizes are measured a batch at a time, the same sums as one pass."""
    varint_bytes, q0, q1, q2, q3, prev = state[0], state[1], state[2], state[3], state[4], state[5]
    for e in range(codes.size):
        c = codes[e]
        i = c >> 1
        gap = i - prev - 1
        prev = i
        q0 += gap >> k0
        q1 += gap >> (k0 + 1)
        q2 += gap >> (k0 + 2)
        q3 += gap >> (k0 + 3)
        v = ((gap << 1) | (c & 1)) >> 7
        varint_bytes += 1
        while v:
            varint_bytes += 1
            v >>= 7
    state[0], state[1], state[2], state[3], state[4], state[5] = varint_bytes, q0, q1, q2, q3, prev


class SizeTally:
    """The sizes every form is chosen by (`CodeSizes`), measured a batch of sorted codes at a time; the
    number of entries is known first (it sets the Rice candidates)."""

    def __init__(self, n_params: int, n_entries: int) -> None:
        self.n_params, self.n_entries, self.added = int(n_params), int(n_entries), 0
        self.k0 = int(_rice_k0(self.n_entries, self.n_params))
        self.state = np.array([0, 0, 0, 0, 0, -1], np.int64)

    def add(self, codes: np.ndarray) -> None:
        _tally(codes, self.k0, self.state)
        self.added += codes.size

    def sizes(self) -> CodeSizes:
        if self.added != self.n_entries:
            raise ValueError(f"measured {self.added} codes of the {self.n_entries} announced")
        n, k0 = self.n_entries, self.k0
        best_k, best = k0, int(self.state[1]) + n * (k0 + 2)
        for j in range(1, 4):
            bits = int(self.state[1 + j]) + n * (k0 + j + 2)
            if bits < best:
                best, best_k = bits, k0 + j
        return CodeSizes(self.n_params, n, int(self.state[0]), best_k, best)


@njit(nogil=True, cache=True, boundscheck=True)
def _rice_write_from(codes, k, out, state):
    """Write the rice stream of ``codes`` into the ZEROED ``out`` (1 + ceil(bits/8) bytes, byte 0 holds k) from
    ``state`` = (byte position, pending bits, their count, last index), which it advances; `_rice_flush`
    writes the last pending bits. Bounds-checked, as the other writers."""
    pos, acc, nb, prev = state[0], state[1], state[2], state[3]
    mask = (np.int64(1) << k) - 1
    for e in range(codes.size):
        c = codes[e]
        i = c >> 1
        gap = i - prev - 1
        prev = i
        q = gap >> k
        while q >= 48:  # long unary run: zeros only, flushed a few bytes at a time
            nb += 48
            q -= 48
            while nb >= 8:
                out[pos] = acc & 0xFF
                acc >>= 8
                nb -= 8
                pos += 1
        acc |= np.int64(1) << (nb + q)
        nb += q + 1
        while nb >= 8:  # keep acc < 2**56: at most 7 pending bits before the k + 1 payload bits
            out[pos] = acc & 0xFF
            acc >>= 8
            nb -= 8
            pos += 1
        acc |= ((gap & mask) | ((c & 1) << k)) << nb
        nb += k + 1
        while nb >= 8:
            out[pos] = acc & 0xFF
            acc >>= 8
            nb -= 8
            pos += 1
    state[0], state[1], state[2], state[3] = pos, acc, nb, prev


class _RiceWriter:
    """The rice payload a batch of codes at a time (base.CodeWriter)."""

    def __init__(self, sizes: CodeSizes) -> None:
        self.buf = np.zeros(1 + (sizes.rice_bits + 7) // 8, np.uint8)
        self.buf[0] = self.k = sizes.rice_k
        self.n_entries, self.added = sizes.n_entries, 0
        self.state = np.array([1, 0, 0, -1], np.int64)  # byte position, pending bits, their count, last index

    def add(self, codes: np.ndarray) -> None:
        _rice_write_from(codes, self.k, self.buf, self.state)
        self.added += codes.size

    def payload(self) -> bytes:
        pos, acc, nb = (int(v) for v in self.state[:3])
        if nb > 0 and pos < self.buf.size:
            self.buf[pos] = acc & 0xFF
            pos += 1
        return filled(self.buf, pos, self.n_entries, self.added, "rice")


@njit(nogil=True, cache=True)
def _check_rice(words, size, n_entries, n_params):
    """Read-only validation of an untrusted rice payload of ``size`` bytes (as `padded_words`)."""
    if size < 1:
        return CHECK_TRUNCATED
    k = np.int64(words[0] & np.uint64(0xFF))
    if k > RICE_MAX_K:
        return CHECK_OVERLONG
    total = size * 8
    max_q = n_params >> k
    umask = (_U1 << np.uint64(k)) - _U1
    bitpos = 8  # after the k byte
    prev = -1
    for _ in range(n_entries):
        v = _window(words, bitpos)
        if v != 0:
            z = np.int64(cttz(v))
            if z + k + 2 <= 64:
                # common case, as _rice_next: the whole entry in one window (a relay validates 32 messages
                # a step). The one found is inside the payload: the words past it are zero.
                if z > max_q:
                    return CHECK_INDEX
                if bitpos + z + k + 2 > total:
                    return CHECK_TRUNCATED
                gap = (z << k) | np.int64((v >> np.uint64(z + 1)) & umask)
                if gap >= n_params - prev - 1:
                    return CHECK_INDEX
                prev = prev + 1 + gap
                bitpos += z + k + 2
                continue
        q = 0
        while True:
            if bitpos >= total:
                return CHECK_TRUNCATED
            v = _window(words, bitpos)
            if v == 0:
                q += 64
                bitpos += 64
                if q > max_q:
                    return CHECK_INDEX
                continue
            z = np.int64(cttz(v))
            q += z
            bitpos += z + 1
            break
        if q > max_q:
            return CHECK_INDEX
        if bitpos + k + 1 > total:
            return CHECK_TRUNCATED
        gap = (q << k) | np.int64(_window(words, bitpos) & umask)
        bitpos += k + 1
        if gap >= n_params - prev - 1:
            return CHECK_INDEX
        prev = prev + 1 + gap
    if (bitpos + 7) >> 3 != size:
        return CHECK_TRAILING
    if bitpos & 7 and (_window(words, bitpos) & np.uint64(0xFF)):
        return CHECK_PADDING
    return CHECK_OK


@njit(nogil=True, cache=True, inline="always")
def _rice_next(words, bitpos, k, umask):
    """(gap, neg, next bitpos) of the entry at ``bitpos`` of a VALIDATED stream."""
    v = _window(words, bitpos)
    if v != 0:
        z = np.int64(cttz(v))
        if z + k + 2 <= 64:  # common case: the whole entry is in this window
            rest = v >> np.uint64(z + 1)
            gap = (z << k) | np.int64(rest & umask)
            return gap, np.int64((rest >> np.uint64(k)) & _U1), bitpos + z + k + 2
    q = 0
    while v == 0:
        q += 64
        bitpos += 64
        v = _window(words, bitpos)
    z = np.int64(cttz(v))
    q += z
    bitpos += z + 1
    v = _window(words, bitpos)
    return (q << k) | np.int64(v & umask), np.int64((v >> np.uint64(k)) & _U1), bitpos + k + 1


@njit(nogil=True, cache=True, inline="always")
def rice_decode_batch(words, bitpos, prev, out, cnt, params):
    """Decode ``cnt`` codes of a VALIDATED rice stream from ``bitpos`` into out[:cnt]; (bitpos, last index).

    Prefetches each target in ``params`` unless it is empty, as forms.sparse.sparse_decode_batch.
    """
    k = np.int64(words[0] & np.uint64(0xFF))
    umask = (_U1 << np.uint64(k)) - _U1
    for t in range(cnt):
        gap, neg, bitpos = _rice_next(words, bitpos, k, umask)
        i = prev + 1 + gap
        out[t] = (i << 1) | neg
        if params.size:
            prefetch_write(params, i)
        prev = i
    return bitpos, prev


@njit(nogil=True, cache=True)
def _rice_decode(words, n_entries, out):
    """Codes of a VALIDATED rice payload (as `padded_words`) into out[:n_entries]."""
    rice_decode_batch(words, 8, -1, out, n_entries, np.empty(0, np.float32))


@njit(nogil=True, cache=True)
def _rice_apply(words, n_entries, steps, params, batch):
    """params[i] += steps[neg] over a VALIDATED rice payload, ``batch.size`` at a time (as the sparse form's apply)."""
    bitpos = 8  # after the k byte
    prev = -1
    done = 0
    while done < n_entries:
        cnt = min(batch.size, n_entries - done)
        bitpos, prev = rice_decode_batch(words, bitpos, prev, batch, cnt, params)
        apply_batch(batch, cnt, steps, params)
        done += cnt


@njit(nogil=True, cache=True)
def _rice_decode_from(words, bitpos, prev, out, cnt):
    """``cnt`` codes of a VALIDATED rice stream from ``bitpos`` (after index ``prev``) into out[:cnt]."""
    return rice_decode_batch(words, bitpos, prev, out, cnt, np.empty(0, np.float32))


def measure(codes: np.ndarray, n_params: int) -> CodeSizes:
    """The sizes every form is chosen by, from one pass over sorted entry ``codes`` (`SizeTally`)."""
    tally = SizeTally(n_params, codes.size)
    tally.add(codes)
    return tally.sizes()


@dataclass(frozen=True)
class RiceForm:
    """Golomb-Rice coded gaps (module docstring); its reader is `padded_words`."""

    name: str = "rice"
    tag: int = 3

    def size(self, sizes: CodeSizes) -> int | None:
        return 1 + (sizes.rice_bits + 7) // 8

    def encode(self, codes: np.ndarray, sizes: CodeSizes) -> bytes:
        return written(self, codes, sizes)

    def writer(self, sizes: CodeSizes) -> CodeWriter:
        return _RiceWriter(sizes)

    def validate(self, payload: bytes, n_params: int, n_entries: int) -> np.ndarray:
        size = len(payload)
        # k byte, then >= 2 bits per entry.
        if not 1 + (2 * n_entries + 7) // 8 <= size:
            raise ValueError(f"rice payload of {size} bytes cannot hold {n_entries} entries")
        words = padded_words(payload)  # bounded by the bytes actually present
        check(self.name, _check_rice(words, size, n_entries, n_params))
        return words

    def reader(self, payload: bytes) -> np.ndarray:
        return padded_words(payload)

    def decode(self, reader: np.ndarray, n_entries: int, out: np.ndarray) -> None:
        _rice_decode(reader, n_entries, out)

    def apply(self, reader: np.ndarray, n_entries: int, step: np.float32, params: np.ndarray) -> None:
        steps, batch = apply_buffers(step, n_entries)
        _rice_apply(reader, n_entries, steps, params, batch)

    @property
    def start(self) -> tuple[int, int]:
        return 8, -1  # after the k byte, before index 0

    def decode_batch(self, reader: np.ndarray, cursor: tuple[int, int], out: np.ndarray, cnt: int) -> tuple[int, int]:
        bitpos, prev = _rice_decode_from(reader, cursor[0], cursor[1], out, cnt)
        return int(bitpos), int(prev)


RICE = RiceForm()
