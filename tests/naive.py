"""Naive NumPy/Python oracles for the encoding kernels (every kernel test compares to one exactly).

Written for obviousness, not speed: element-wise definitions and plain loops, sharing no code with
gradshare.encoding.kernels.
"""

from __future__ import annotations

import numpy as np


def accumulate_encode(residual: np.ndarray, update: np.ndarray | None, tau: float):
    """(new residual, entry codes) of Strom's rule: r += u; every |r_i| >= τ emits ±i and r_i -= ±τ."""
    t = np.float32(tau)
    x = residual.copy() if update is None else (residual + update).astype(np.float32)
    new = x.copy()
    codes = []
    for i in np.flatnonzero(np.abs(x) >= t):  # NaN never passes >=, so it never becomes an entry
        if x[i] >= t:
            new[i] = np.float32(x[i] - t)
            codes.append(2 * int(i))
        else:
            new[i] = np.float32(x[i] + t)
            codes.append(2 * int(i) + 1)
    return new, np.array(codes, dtype=np.int64)


def accumulate_diff_encode(residual: np.ndarray, after: np.ndarray, before: np.ndarray, tau: float):
    """accumulate_encode with u = after - before, the difference rounded to float32 first (what the
    worker sends: P_after - P_before of one optimizer step)."""
    u = np.empty_like(residual)
    for i in range(residual.size):
        u[i] = np.float32(after[i]) - np.float32(before[i])  # float32 scalars: a float32 subtraction
    return accumulate_encode(residual, u, tau)


def leb128(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def sparse_payload(codes: np.ndarray) -> bytes:
    """Gaps (index - previous - 1, previous starting at -1) shifted left once, sign in bit 0, LEB128."""
    out = b""
    prev = -1
    for c in codes.tolist():
        i, neg = c >> 1, c & 1
        out += leb128(((i - prev - 1) << 1) | neg)
        prev = i
    return out


def rice_payload(codes: np.ndarray, k: int) -> bytes:
    """Byte k, then per entry: gap >> k zeros, a one, the k low bits of gap, the sign; LSB-first bits."""
    bits = []
    prev = -1
    for c in codes.tolist():
        i, neg = c >> 1, c & 1
        gap = i - prev - 1
        prev = i
        bits += [0] * (gap >> k) + [1]
        bits += [(gap >> b) & 1 for b in range(k)] + [neg]
    bits += [0] * (-len(bits) % 8)
    out = bytearray([k])
    for j in range(0, len(bits), 8):
        out.append(sum(bit << b for b, bit in enumerate(bits[j : j + 8])))
    return bytes(out)


def bitmap_payload(codes: np.ndarray, n_params: int) -> bytes:
    """2 bits per parameter, parameter i at bits 2*(i%4) of byte i//4: 01 = +τ, 10 = −τ."""
    out = bytearray((n_params + 3) // 4)
    for c in codes.tolist():
        i, neg = c >> 1, c & 1
        out[i // 4] |= (2 if neg else 1) << (2 * (i % 4))
    return bytes(out)


def apply(codes: np.ndarray, tau: float, params: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """params with ±float32(τ·scale) added at each entry, one float32 addition per entry."""
    out = params.copy()
    step = np.float32(float(tau) * float(scale))
    for c in codes.tolist():
        i, neg = c >> 1, c & 1
        out[i] = np.float32(out[i] - step) if neg else np.float32(out[i] + step)
    return out


def dense(codes: np.ndarray, tau: float, n_params: int) -> np.ndarray:
    return apply(codes, tau, np.zeros(n_params, np.float32))


def parse_sparse(payload: bytes, n_entries: int, n_params: int) -> list[int] | None:
    """Entry codes of a sparse payload, or None if invalid (varints of at most 9 bytes, shortest form)."""
    codes, pos, prev = [], 0, -1
    for _ in range(n_entries):
        start, v, shift = pos, 0, 0
        while True:
            if pos >= len(payload) or pos - start >= 9:
                return None
            b = payload[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                if b == 0 and pos - start > 1:
                    return None
                break
        i = prev + 1 + (v >> 1)
        if i >= n_params:
            return None
        codes.append((i << 1) | (v & 1))
        prev = i
    return codes if pos == len(payload) else None


def parse_rice(payload: bytes, n_entries: int, n_params: int) -> list[int] | None:
    """Entry codes of a rice payload, or None if invalid (k <= 40, no extra bytes, zero padding)."""
    if not payload or payload[0] > 40:
        return None
    k = payload[0]
    bits = [(byte >> b) & 1 for byte in payload[1:] for b in range(8)]
    codes, pos, prev = [], 0, -1
    for _ in range(n_entries):
        q = 0
        while pos < len(bits) and bits[pos] == 0:
            q += 1
            pos += 1
        if pos + 1 + k + 1 > len(bits):
            return None
        pos += 1
        rem = sum(bits[pos + b] << b for b in range(k))
        neg = bits[pos + k]
        pos += k + 1
        i = prev + 1 + ((q << k) | rem)
        if i >= n_params:
            return None
        codes.append((i << 1) | neg)
        prev = i
    if len(bits) - pos >= 8 or any(bits[pos:]):
        return None
    return codes


def parse_bitmap(payload: bytes, n_entries: int, n_params: int) -> list[int] | None:
    """Entry codes of a bitmap payload, or None if invalid (size, code 0b11, bits past n_params, count)."""
    if len(payload) != (n_params + 3) // 4:
        return None
    codes = []
    for i in range(4 * len(payload)):
        code = (payload[i // 4] >> (2 * (i % 4))) & 3
        if code == 3 or (code and i >= n_params):
            return None
        if code:
            codes.append((i << 1) | (code >> 1))
    return codes if len(codes) == n_entries else None


def naive_kth_largest_abs(values, density):
    """Oracle of threshold.quantile_threshold: sort everything, take the k-th largest |value|
    (k = round(density · m), at least 1), or the smallest non-zero one when that is 0."""
    a = sorted(abs(float(np.float32(v))) for v in values if np.isfinite(v))
    if not a:
        return None
    k = min(len(a), max(1, round(density * len(a))))
    kth = a[len(a) - k]
    if kth > 0:
        return kth
    nonzero = [v for v in a if v > 0]
    return min(nonzero) if nonzero else None


def apply_step_update(
    codes: np.ndarray, tau: float, buffer_index, buffer_value, state: np.ndarray, n_params: int, scale: float = 1.0
) -> np.ndarray:
    """A step update (encoding/update.py) applied to a copy of the whole state, one entry at a time:
    ±τ·scale on the parameters, the exact float32 values on the buffer part."""
    out = state.copy()
    out[:n_params] = apply(codes, tau, state[:n_params], scale)
    for i, v in zip(buffer_index, buffer_value):
        out[n_params + int(i)] = np.float32(out[n_params + int(i)] + np.float32(v))
    return out


def block_max_abs(values: np.ndarray, width: int) -> np.ndarray:
    """Per block of ``width`` values: max |value| (0 for none; NaN when the block holds a NaN)."""
    out = np.zeros(-(-values.size // width), np.float32)
    for b in range(out.size):
        block = np.abs(values[b * width : (b + 1) * width])
        out[b] = np.nan if np.isnan(block).any() else block.max()
    return out


def folded_encode(point: np.ndarray, params: np.ndarray, tau: float, scale: float):
    """(new point, entry codes) of the folded encode: r_i = (q_i − p_i)·float32(1/s) in float32; every
    |r_i| >= τ emits ±i and q_i -= ±float32(τ·s)."""
    t, inv = np.float32(tau), np.float32(1.0 / scale)
    step = np.float32(float(t) * scale)
    new = point.copy()
    codes = []
    for i in range(point.size):
        x = np.float32(np.float32(point[i] - params[i]) * inv)
        if x >= t:
            new[i] = np.float32(point[i] - step)
            codes.append(2 * i)
        elif x <= -t:
            new[i] = np.float32(point[i] + step)
            codes.append(2 * i + 1)
    return new, np.array(codes, dtype=np.int64)


def folded_clip(point: np.ndarray, params: np.ndarray, bound: float, scale: float) -> np.ndarray:
    """The point with r = (q − p)·float32(1/s) clipped to ±bound: q_i = p_i ± float32(bound·s)."""
    b, inv = np.float32(bound), np.float32(1.0 / scale)
    sb = np.float32(float(b) * scale)
    new = point.copy()
    for i in range(point.size):
        x = np.float32(np.float32(point[i] - params[i]) * inv)
        if x > b:
            new[i] = np.float32(params[i] + sb)
        elif x < -b:
            new[i] = np.float32(params[i] - sb)
    return new


def folded_rescale(point: np.ndarray, params: np.ndarray, ratio: float) -> np.ndarray:
    """q_i = p_i + (q_i − p_i)·ratio, each operation rounded to float32."""
    f = np.float32(ratio)
    new = point.copy()
    for i in range(point.size):
        new[i] = np.float32(params[i] + np.float32(np.float32(point[i] - params[i]) * f))
    return new
