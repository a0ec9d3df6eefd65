"""The residual folded into the point the gradient is taken at ("Q-form", gradshare/local_view.py).

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
run torch ops with r as a temporary (encoding/torch_codec.py), to the same bits.
"""

from __future__ import annotations

import numpy as np

from gradshare.encoding import kernels as _k
from gradshare.encoding.codec import _build, _check_vector, _threshold_value
from gradshare.encoding.message import Message
from gradshare.vectors import Vector, is_tensor


def _pair(point: Vector, params: Vector) -> bool:
    """Check the pair; True when they are torch tensors (of one device), False for NumPy arrays."""
    if is_tensor(point):
        from gradshare.encoding.torch_codec import _check_tensor, _overlap

        _check_tensor("point", point)
        if _overlap(point, _check_tensor("params", params, device=point.device, n=point.numel())):
            raise ValueError("point must not overlap params (it holds params + scale × residual)")
        return True
    _check_vector("point", point, writable=True)
    _check_vector("params", params, writable=False, n=point.size)
    if np.shares_memory(point, params):
        raise ValueError("point must not overlap params (it holds params + scale × residual)")
    return False


def _scale_pair(scale: float) -> tuple[np.float32, np.float32]:
    """(float32(scale), float32(1/scale)) for a finite scale > 0."""
    scale = float(scale)
    if not (np.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    return np.float32(scale), np.float32(1.0 / scale)


def encode_folded(point: Vector, params: Vector, threshold: float, scale: float = 1.0, *,
                  form: str | None = None) -> Message:
    """Threshold-encode r = (point − params)/scale without storing it: every |r_i| >= τ becomes an entry
    ±τ and point_i moves by ∓float32(τ·scale) in place (module docstring). params is read only.

    Raises ValueError naming the first index where r is NaN or ±inf; the point is then reduced in the
    blocks before it (as `encode` leaves a residual) and must be reset."""
    tensor = _pair(point, params)
    tau = _threshold_value(threshold)
    s, inv = _scale_pair(scale)
    tau32 = np.float32(tau)
    with np.errstate(over="ignore"):
        step = np.float32(tau * float(scale))  # what `apply(message, P, scale)` adds: codec._apply_step
    if not np.isfinite(step):
        raise ValueError(f"scale {scale!r} times threshold {tau!r} is not finite in float32")
    if is_tensor(point) and is_tensor(params):  # == tensor (_pair: both or neither); narrows for the checker
        from gradshare.encoding.torch_codec import encode_folded_tensor

        return encode_folded_tensor(point, params, tau, inv, step, form)
    assert isinstance(point, np.ndarray) and isinstance(params, np.ndarray)  # _pair checked: arrays
    n = point.size
    out = np.empty(max(1024, n >> 8), np.int64)
    k, pos = 0, 0
    while True:
        k, pos, status = _k._folded_encode(point, params, inv, tau32, step, out, k, pos)
        if status == _k.OK:
            break
        if status == _k.NONFINITE:
            block = (point[pos : pos + _k.BLOCK] - params[pos : pos + _k.BLOCK]) * inv
            i = pos + int(np.flatnonzero(~(np.abs(block) <= np.float32(3.4028234663852886e38)))[0])
            raise ValueError(f"the residual (point − params)/scale is not finite at index {i} (point[{i}] = "
                             f"{point[i]!r}, params[{i}] = {params[i]!r}); the point is partly reduced and must "
                             "be reset")
        grown = np.empty(max(2 * out.size, k + _k.BLOCK), np.int64)  # FULL: the block did not fit
        grown[:k] = out[:k]
        out = grown
    return _build(out[:k], tau, n, form)


def clip_folded(point: Vector, params: Vector, bound: float | np.float32, scale: float = 1.0) -> int:
    """Clip r = (point − params)/scale to ±bound in place (through point); returns the entries clipped."""
    tensor = _pair(point, params)
    s, inv = _scale_pair(scale)
    bound32 = np.float32(bound)
    if not bound32 > 0:
        raise ValueError(f"bound must be > 0, got {bound!r}")
    with np.errstate(over="ignore"):
        # s in double, as the encode's step float32(τ·s): one rounding of the product, not two
        scaled = np.float32(min(float(bound32) * float(scale), 3.4e38))
    if is_tensor(point) and is_tensor(params):  # == tensor (_pair)
        from gradshare.encoding.torch_codec import clip_folded_tensor

        return clip_folded_tensor(point, params, inv, bound32, scaled)
    assert isinstance(point, np.ndarray) and isinstance(params, np.ndarray)  # _pair checked: arrays
    return int(_k._folded_clip(point, params, inv, bound32, scaled))


def rescale_folded(point: Vector, params: Vector, ratio: float | np.float32) -> None:
    """r ← ratio·r in place: point = params + (point − params)·ratio (float32)."""
    tensor = _pair(point, params)
    ratio32 = np.float32(ratio)
    if not (np.isfinite(ratio32) and ratio32 >= 0):
        raise ValueError(f"ratio must be finite and >= 0, got {ratio!r}")
    if is_tensor(point) and is_tensor(params):  # == tensor (_pair)
        from gradshare.encoding.torch_codec import rescale_folded_tensor

        return rescale_folded_tensor(point, params, ratio32)
    assert isinstance(point, np.ndarray) and isinstance(params, np.ndarray)  # _pair checked: arrays
    _k._folded_rescale(point, params, ratio32)


def unfold(point: Vector, params: Vector, scale: float = 1.0) -> Vector:
    """r = (point − params)·(1/scale) as a new float32 array or tensor (the values the encode compares
    with τ); strided views (a calibration sample) too."""
    _, inv = _scale_pair(scale)
    if is_tensor(point) and is_tensor(params):  # a pair of one kind, as every caller passes
        import torch

        with torch.no_grad():
            r = point - params
            return r.mul_(float(inv)) if inv != 1.0 else r
    diff: np.ndarray = np.subtract(point, params, dtype=np.float32)
    if inv != 1.0:
        diff *= inv
    return diff


def fold(point: Vector, params: Vector, residual: Vector, scale: float = 1.0) -> None:
    """point = params + float32(scale)·residual, in place (two roundings, as NumPy and torch alike)."""
    _pair(point, params)
    s, _ = _scale_pair(scale)
    if is_tensor(point) and is_tensor(params) and is_tensor(residual):  # _pair: both or neither
        import torch

        with torch.no_grad():
            point.copy_(residual)
            if s != 1.0:
                point.mul_(float(s))
            point.add_(params)
        return
    assert isinstance(point, np.ndarray) and isinstance(params, np.ndarray)  # _pair checked: arrays
    _check_vector("residual", residual, writable=False, n=point.size)
    assert isinstance(residual, np.ndarray)  # checked just above
    if s == 1.0:
        np.add(params, residual, out=point)
    else:
        np.multiply(residual, s, out=point)
        point += params
