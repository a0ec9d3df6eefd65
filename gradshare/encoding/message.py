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

Forms (one module each in forms/, and the table `forms.BY_TAG` from the form byte to its `Form`):
*sparse* = the sorted entry indices as gaps (index - previous index - 1) in LEB128 varints with the
sign folded into bit 0; *rice* = the same gaps Golomb-Rice coded (forms/rice.py); *bitmap* = 2 bits
per parameter (00 none, 01 +τ, 10 −τ, 11 reserved); *empty* = no payload. Every form of the same
entries decodes to the identical vector.

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

from gradshare.encoding import forms
from gradshare.encoding.forms import bitmap_size as bitmap_size  # re-exported: the size of a form, public here before
from gradshare.errors import DecodeError

MAGIC = b"GS"
VERSION = 1
HEADER = struct.Struct("<2sBBfQQQ")
HEADER_SIZE = HEADER.size  # 32

# The forms' names, as Message.form holds them; forms/ has one module per form and the table by wire tag.
EMPTY = forms.EMPTY.name
SPARSE = forms.SPARSE.name
BITMAP = forms.BITMAP.name
RICE = forms.RICE.name
FORMS = forms.NAMES  # also the preference order when two forms are the same size

# Bounds on an adapted or calibrated τ (threshold.py): it must stay a positive normal float32 far from
# overflow, whatever the updates do (e.g. a model whose updates are all exactly zero would otherwise
# drive τ to 0).
MIN_THRESHOLD = 1e-30
MAX_THRESHOLD = 1e30

# Indices travel as (index << 1) | sign in int64: keep n_params well inside that.
MAX_N_PARAMS = 1 << 61


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


def threshold_value(threshold: object) -> float:
    """τ of a number or of a threshold rule (FixedThreshold, AdaptiveThreshold, ...: its current
    ``.threshold``), as the float32 value the kernels use."""
    value = getattr(threshold, "threshold", threshold)
    return to_float32_threshold(value)  # type: ignore[arg-type]


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
    # the payload as its form's kernels read it (forms/base.py; made while validating)
    reader: np.ndarray = field(init=False, repr=False, compare=False)

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
        form = forms.named(self.form)
        if not isinstance(self.payload, bytes):  # a bytes-like is accepted, and kept as bytes
            # the ignore: payload is annotated with what it holds after this line, so the checker sees no way in
            if not isinstance(self.payload, (bytearray, memoryview)):  # type: ignore[unreachable]
                raise TypeError(f"payload must be bytes, got {type(self.payload).__name__}")
            object.__setattr__(self, "payload", bytes(self.payload))
        object.__setattr__(self, "reader", form.validate(self.payload, self.n_params, self.n_entries))

    @classmethod
    def from_codes(cls, codes: np.ndarray, threshold: float, n_params: int, form: str | None = None) -> Message:
        """A Message holding ``codes`` (the encoder's sorted entry codes, kernels.py) in ``form`` (None: the
        smallest). Built from the kernels' own output, so the constructor's validation pass is skipped
        (tests check that every encode result also passes the validating constructor)."""
        if form is not None and form not in forms.BY_NAME:
            raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
        sizes = forms.measure(codes, n_params)
        chosen = forms.smallest(sizes) if form is None else forms.BY_NAME[form]
        return cls.built(threshold, n_params, int(codes.size), chosen, chosen.encode(codes, sizes))

    @classmethod
    def built(cls, threshold: float, n_params: int, n_entries: int, form: forms.Form, payload: bytes) -> Message:
        """A Message of a payload this process wrote in ``form`` from the encoder's own codes (`from_codes`,
        encode_passes.py): the validating constructor's pass is skipped."""
        m = object.__new__(cls)
        for name, value in (
            ("threshold", threshold),
            ("n_params", n_params),
            ("n_entries", n_entries),
            ("form", form.name),
            ("payload", payload),
            ("reader", form.reader(payload)),
        ):
            object.__setattr__(m, name, value)
        return m

    def codes(self) -> np.ndarray:
        """The entry codes ``(index << 1) | neg``, ascending (int64; kernels.py)."""
        out = np.empty(self.n_entries, np.int64)
        forms.BY_NAME[self.form].decode(self.reader, self.n_entries, out)
        return out

    def step(self, scale: float) -> np.float32:
        """float32(τ·scale), the one step every entry adds (both backends round it here, on the host)."""
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise TypeError(f"scale must be a real number, got {type(scale).__name__}") from None
        with np.errstate(over="ignore"):
            step = np.float32(self.threshold * scale)
        if not np.isfinite(step):
            raise ValueError(f"scale {scale!r} times threshold {self.threshold!r} is not finite in float32")
        return step

    def apply_to(self, params: np.ndarray, step: np.float32) -> None:
        """params[i] += ±step at every entry (a float32 array already checked: numpy_codec.apply)."""
        forms.BY_NAME[self.form].apply(self.reader, self.n_entries, step, params)

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
            MAGIC,
            VERSION,
            forms.BY_NAME[self.form].tag,
            self.threshold,
            self.n_params,
            self.n_entries,
            len(self.payload),
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
        form = forms.BY_TAG.get(form_code)
        if form is None:
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
            return cls(tau, n_params, n_entries, form.name, bytes(view[HEADER_SIZE:]))
        except ValueError as exc:  # payload inconsistent with the header
            raise DecodeError(str(exc)) from None
