"""The encoded update of one step: a frozen, always-valid `Message` and its bounded byte format.

Wire format (little endian), a fixed 32-byte header followed by the payload:

    offset size field
    0      2    magic b"GS"
    2      1    version (1)
    3      1    form: 0 empty, 1 sparse, 2 bitmap, 3 rice
    4      4    τ, float32 (the kernels compute in float32, so this is exactly the τ that was used)
    8      8    n_params, uint64
    16     8    n_entries, uint64
    24     8    payload length in bytes, uint64 (must equal the bytes that follow)

Forms: *sparse* = the sorted entry indices as gaps (index - previous index - 1) in LEB128
varints with the sign folded into bit 0; *rice* = the same gaps Golomb-Rice coded (see rice.py);
*bitmap* = 2 bits per parameter (00 none, 01 +τ, 10 −τ, 11 reserved); *empty* = no payload. Every
form of the same entries decodes to the identical vector.

A `Message` is validated completely in its constructor (payload included, by a read-only Numba pass),
so any `Message` that exists can be applied without further checks: no index >= n_params can reach a
kernel. `from_bytes` checks the header against ``max_params`` and the real data length before it
allocates or scans anything, and turns every failure into `DecodeError`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from gradshare.encoding import kernels as _k
from gradshare.encoding import rice as _rice
from gradshare.errors import DecodeError

MAGIC = b"GS"
VERSION = 1
HEADER = struct.Struct("<2sBBfQQQ")
HEADER_SIZE = HEADER.size  # 32

EMPTY = "empty"
SPARSE = "sparse"
BITMAP = "bitmap"
RICE = "rice"
FORMS = (EMPTY, SPARSE, RICE, BITMAP)  # also the preference order when two forms are the same size
_FORM_CODE = {EMPTY: 0, SPARSE: 1, BITMAP: 2, RICE: 3}
_CODE_FORM = {v: k for k, v in _FORM_CODE.items()}

# Indices travel as (index << 1) | sign in int64: keep n_params well inside that.
MAX_N_PARAMS = 1 << 61

_CHECK_TEXT = {
    _k.CHECK_TRUNCATED: "an entry runs past the end of the payload",
    _k.CHECK_OVERLONG: "a varint is longer than 9 bytes or not in shortest form, or the rice k is > 40",
    _k.CHECK_INDEX: "an index is >= n_params",
    _k.CHECK_TRAILING: "bytes are left over after n_entries entries",
    _k.CHECK_PADDING: "bits are set past the last parameter (bitmap) or the last entry (rice)",
    _k.CHECK_RESERVED: "the bitmap holds the reserved code 0b11",
    _k.CHECK_COUNT: "the bitmap holds a different number of entries than n_entries",
}


def bitmap_size(n_params: int) -> int:
    """Payload bytes of the bitmap form: 2 bits per parameter."""
    return (n_params + 3) // 4


def to_float32_threshold(threshold: float, name: str = "threshold") -> float:
    """τ as the float32 value the kernels use; ValueError unless finite and > 0 in float32."""
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(threshold).__name__}") from None
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf and is rejected below
        tau32 = float(np.float32(value))
    if not (math.isfinite(tau32) and tau32 > 0.0):
        raise ValueError(f"{name} must be finite and > 0 in float32, got {value!r}")
    return tau32


@dataclass(frozen=True)
class Message:
    """One worker's encoded update for one step (validated on construction).

    threshold: τ (float32 precision); every entry means ±τ at one index.
    n_params:  length of the parameter vector the message applies to.
    n_entries: number of ±τ entries.
    form:      "empty", "sparse", "rice" or "bitmap" (see module docstring).
    payload:   the form's bytes.
    """

    threshold: float
    n_params: int
    n_entries: int
    form: str
    payload: bytes
    # rice payload as zero-padded uint64 words for the kernels' bit reader (made while validating)
    _padded: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", to_float32_threshold(self.threshold))
        for name in ("n_params", "n_entries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            object.__setattr__(self, name, int(value))
        if not 0 <= self.n_params <= MAX_N_PARAMS:
            raise ValueError(f"n_params must be in [0, 2**61], got {self.n_params}")
        if not 0 <= self.n_entries <= self.n_params:
            raise ValueError(f"n_entries must be in [0, n_params={self.n_params}], got {self.n_entries}")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")
        if not isinstance(self.payload, bytes):  # a bytes-like is accepted, and kept as bytes
            # the ignore: payload is annotated with what it holds after this line, so the checker sees no way in
            if not isinstance(self.payload, (bytearray, memoryview)):  # type: ignore[unreachable]
                raise TypeError(f"payload must be bytes, got {type(self.payload).__name__}")
            object.__setattr__(self, "payload", bytes(self.payload))
        padded = _check_payload(self.form, self.payload, self.n_params, self.n_entries)
        object.__setattr__(self, "_padded", padded)

    @classmethod
    def _trusted(cls, threshold: float, n_params: int, n_entries: int, form: str, payload: bytes) -> Message:
        """A Message from the encoder's own kernels: same fields, without the payload validation pass."""
        m = object.__new__(cls)
        for name, value in (
            ("threshold", threshold), ("n_params", n_params), ("n_entries", n_entries), ("form", form),
            ("payload", payload), ("_padded", _rice.padded_words(payload) if form == RICE else None),
        ):
            object.__setattr__(m, name, value)
        return m

    def __repr__(self) -> str:
        return (
            f"Message(threshold={self.threshold!r}, n_params={self.n_params}, n_entries={self.n_entries}, "
            f"form={self.form!r}, payload=<{len(self.payload)} bytes>)"
        )

    @property
    def density(self) -> float:
        """Entries per parameter (0.0 for an empty parameter vector)."""
        return self.n_entries / self.n_params if self.n_params else 0.0

    @property
    def nbytes(self) -> int:
        """Size of `to_bytes()` without building it."""
        return HEADER_SIZE + len(self.payload)

    def to_bytes(self) -> bytes:
        head = HEADER.pack(
            MAGIC, VERSION, _FORM_CODE[self.form], self.threshold, self.n_params, self.n_entries, len(self.payload)
        )
        return head + self.payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, max_params: int) -> Message:
        """Decode untrusted bytes. Raises DecodeError on anything invalid, including n_params > max_params.

        Nothing is allocated from a header field before it is checked against ``max_params`` and
        against the length of ``data`` itself.
        """
        if isinstance(max_params, bool) or not isinstance(max_params, (int, np.integer)) or max_params < 0:
            raise ValueError(f"max_params must be an int >= 0, got {max_params!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes-like, got {type(data).__name__}")
        view = memoryview(data).cast("B")
        if len(view) < HEADER_SIZE:
            raise DecodeError(f"message too short: {len(view)} bytes < {HEADER_SIZE}-byte header")
        magic, version, form_code, tau, n_params, n_entries, length = HEADER.unpack_from(view)
        if magic != MAGIC:
            raise DecodeError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise DecodeError(f"unsupported version {version}, expected {VERSION}")
        if form_code not in _CODE_FORM:
            raise DecodeError(f"unknown form code {form_code}")
        if not (math.isfinite(tau) and tau > 0.0):
            raise DecodeError(f"threshold {tau!r} is not finite and > 0")
        if n_params > max_params:
            raise DecodeError(f"n_params {n_params} exceeds max_params {max_params}")
        if n_entries > n_params:
            raise DecodeError(f"n_entries {n_entries} exceeds n_params {n_params}")
        if length != len(view) - HEADER_SIZE:
            raise DecodeError(f"payload length field {length} != {len(view) - HEADER_SIZE} bytes present")
        try:
            return cls(tau, n_params, n_entries, _CODE_FORM[form_code], bytes(view[HEADER_SIZE:]))
        except ValueError as exc:  # payload inconsistent with the header
            raise DecodeError(str(exc)) from None


def _check_payload(form: str, payload: bytes, n_params: int, n_entries: int) -> np.ndarray | None:
    """Validate a payload against its header fields (ValueError naming the problem).

    Returns the padded copy the rice kernels read (None for the other forms).
    """
    size = len(payload)
    padded = None
    if form == EMPTY:
        if n_entries or size:
            raise ValueError(f"empty form needs n_entries == 0 and no payload, got {n_entries} / {size} bytes")
        return None
    if form == BITMAP:
        if size != bitmap_size(n_params):
            raise ValueError(f"bitmap payload is {size} bytes, expected {bitmap_size(n_params)} for {n_params} params")
        code = _k._check_bitmap(np.frombuffer(payload, np.uint8), n_params, n_entries)
    elif form == SPARSE:
        # Each entry takes 1..9 bytes; reject impossible sizes before scanning.
        if not n_entries <= size <= 9 * n_entries:
            raise ValueError(f"sparse payload of {size} bytes cannot hold {n_entries} entries")
        code = _k._check_sparse(np.frombuffer(payload, np.uint8), n_entries, n_params)
    else:
        # k byte, then >= 2 bits per entry.
        if not 1 + (2 * n_entries + 7) // 8 <= size:
            raise ValueError(f"rice payload of {size} bytes cannot hold {n_entries} entries")
        padded = _rice.padded_words(payload)  # bounded by the bytes actually present
        code = _rice._check_rice(padded, size, n_entries, n_params)
    if code != _k.CHECK_OK:
        raise ValueError(f"invalid {form} payload: {_CHECK_TEXT[code]}")
    return padded
