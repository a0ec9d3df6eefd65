"""The residual folded into the point the gradient is taken at ("Q-form", gradshare/replica/local_view.py).

With the local view a worker needs two things P-sized besides P: its residual r, and the point
P + s·r its forward/backward runs at. Storing the point q = P + s·r INSTEAD of r keeps one of them:
r = (q − P)·(1/s) is read on the fly by the passes that need it, and never stored.

    m = encode_folded(q, p, τ, s)       # every |r_i| >= τ sent as ±τ; q_i moves by ∓float32(τ·s)
    clip_folded(q, p, bound, s)         # r clipped to ±bound
    rescale_folded(q, p, ratio)         # r scaled by ratio (a learning-rate change, sharing.py)
    r = unfold(q, p, s)                 # r itself, for a checkpoint
    fold(q, p, r, s)                    # q = p + s·r (a checkpoint's r on freshly loaded parameters)

An entry sent moves q by exactly the step the apply log adds to P (and to q) when it applies the
message, float32(τ·s), so once the log has applied it, q − P is where it was less that step's
rounding: the worker does not send it again. r is read as (q − p)·(1/s) in float32, so it carries the
rounding of q, ~ulp(P) (a single process's parameters carry the same), not that of a separate r.

NumPy arrays run Numba kernels that read r block by block; float32 torch tensors (the device state)
run torch ops with r as a temporary (encoding/torch_codec.py), to the same bits. Each function asks
`backend_of` the point once, and the backend checks the pair (both of its kind, one length, no overlap).
"""

from __future__ import annotations

import numpy as np

from gradshare.encoding.backend import backend_of
from gradshare.encoding.message import Message, threshold_value
from gradshare.vectors import Vector


def _scale_pair(scale: float) -> tuple[np.float32, np.float32]:
    """(float32(scale), float32(1/scale)) for a finite scale > 0."""
    scale = float(scale)
    if not (np.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    return np.float32(scale), np.float32(1.0 / scale)


def encode_folded(
    point: Vector, params: Vector, threshold: float, scale: float = 1.0, *, form: str | None = None
) -> Message:
    """Threshold-encode r = (point − params)/scale without storing it: every |r_i| >= τ becomes an entry
    ±τ and point_i moves by ∓float32(τ·scale) in place (module docstring). params is read only.

    Raises ValueError naming the first index where r is NaN or ±inf; the point is then reduced in the
    blocks before it (as `encode` leaves a residual) and must be reset."""
    backend = backend_of(point)
    q, p = backend.check_pair(point, params)
    tau = threshold_value(threshold)
    _, inv = _scale_pair(scale)
    with np.errstate(over="ignore"):
        step = np.float32(tau * float(scale))  # what `apply(message, P, scale)` adds: Message.step
    if not np.isfinite(step):
        raise ValueError(f"scale {scale!r} times threshold {tau!r} is not finite in float32")
    return backend.encode_folded(q, p, tau, inv, step, form)


def clip_folded(point: Vector, params: Vector, bound: float | np.float32, scale: float = 1.0) -> int:
    """Clip r = (point − params)/scale to ±bound in place (through point); returns the entries clipped."""
    backend = backend_of(point)
    q, p = backend.check_pair(point, params)
    _, inv = _scale_pair(scale)
    bound32 = np.float32(bound)
    if not bound32 > 0:
        raise ValueError(f"bound must be > 0, got {bound!r}")
    with np.errstate(over="ignore"):
        # s in double, as the encode's step float32(τ·s): one rounding of the product, not two
        scaled = np.float32(min(float(bound32) * float(scale), 3.4e38))
    return backend.clip_folded(q, p, inv, bound32, scaled)


def rescale_folded(point: Vector, params: Vector, ratio: float | np.float32) -> None:
    """r ← ratio·r in place: point = params + (point − params)·ratio (float32)."""
    backend = backend_of(point)
    q, p = backend.check_pair(point, params)
    ratio32 = np.float32(ratio)
    if not (np.isfinite(ratio32) and ratio32 >= 0):
        raise ValueError(f"ratio must be finite and >= 0, got {ratio!r}")
    backend.rescale_folded(q, p, ratio32)


def unfold(point: Vector, params: Vector, scale: float = 1.0) -> Vector:
    """r = (point − params)·(1/scale) as a new float32 array or tensor (the values the encode compares
    with τ); strided views (a calibration sample) too."""
    _, inv = _scale_pair(scale)
    r: Vector = backend_of(point).unfold(point, params, inv)
    return r


def fold(point: Vector, params: Vector, residual: Vector, scale: float = 1.0) -> None:
    """point = params + float32(scale)·residual, in place (two roundings, as NumPy and torch alike)."""
    backend = backend_of(point)
    q, p = backend.check_pair(point, params)
    s, _ = _scale_pair(scale)
    backend.fold(q, p, residual, s)
