"""The NumPy backend: the threshold codec on float32 NumPy arrays, with the Numba kernels (kernels.py,
forms/). The CPU default; torch_codec.py is the same contract on torch tensors, bit for bit.

A state picks its backend once, when it is built for an array or a tensor (backend.py); the public
functions of codec.py, threshold.py, folded.py and update.py ask `backend_of` once per call. Every
function here checks its arguments (dtype, shape, contiguity, overlap) before a kernel sees them.

Non-finite values: if r + u becomes NaN or ±inf anywhere (a NaN/inf update, or float32 overflow),
`encode` raises ValueError naming the first such index. The residual has then been partly updated
(every block before that index is accumulated and reduced) and must be reset before it is used again:
a diverged step cannot be sent as ±τ entries.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gradshare.encoding import encode_passes, kernels
from gradshare.encoding.message import FORMS, MAX_THRESHOLD, MIN_THRESHOLD, Message, threshold_value
from gradshare.errors import NonFiniteError


def check_vector(name: str, array: object, *, writable: bool, n: int | None = None) -> np.ndarray:
    """``array`` itself once it is a float32, 1-D, C-contiguous ndarray (of ``n`` values; writable)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    if array.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (pass a flat view of the parameter buffer)")
    if writable and not array.flags.writeable:
        raise ValueError(f"{name} must be writable (it is updated in place)")
    if n is not None and array.size != n:
        raise ValueError(f"{name} has {array.size} elements, expected {n}")
    return array


def zeros(n: int, device: object = None) -> np.ndarray:
    """A zero vector of ``n`` float32 values (on the host: ``device`` must be None)."""
    if device is not None:
        raise ValueError(f"a NumPy vector lives on the host, got device {device!r}")
    return np.zeros(n, np.float32)


def check_threads(threads: object) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    return threads


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gradshare-encode")
        return _pools[threads]


def _check_encode(
    residual: object, update: object, base: object, rewind: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    r = check_vector("residual", residual, writable=True)
    u = None if update is None else check_vector("update", update, writable=False, n=r.size)
    b = None
    if base is not None:
        if u is None:
            raise ValueError("base needs an update to subtract it from")
        b = check_vector("base", base, writable=False, n=r.size)
    if rewind:
        if b is None:
            raise ValueError("rewind needs a base to rewind the update to")
        u = check_vector("update", u, writable=True)
        if np.shares_memory(u, b) or np.shares_memory(u, r):
            raise ValueError("update must not overlap base or residual when rewind is set")
    return r, u, b


def _codes_threaded(
    r: np.ndarray, u: np.ndarray | None, tau32: np.float32, b: np.ndarray | None, rewind: bool, threads: int
) -> np.ndarray:
    """The fused pass's codes, split into ``threads`` contiguous ranges encoded in parallel (the kernels
    release the GIL); the same codes as one range. Raises kernels.NonFiniteAt with the first bad index."""
    n = r.size
    if threads == 1 or n < threads * kernels.BLOCK * 16:
        return kernels.encode_codes(r, u, tau32, b, rewind)
    # Contiguous ranges aligned to BLOCK, so each range's codes are sorted and ranges concatenate.
    step = -(-n // threads)
    step = -(-step // kernels.BLOCK) * kernels.BLOCK
    bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    futures = [
        _pool(threads).submit(
            kernels.encode_codes,
            r[lo:hi],
            None if u is None else u[lo:hi],
            tau32,
            None if b is None else b[lo:hi],
            rewind,
        )
        for lo, hi in bounds
    ]
    parts = []
    first_bad: int | None = None
    for (lo, _), fut in zip(bounds, futures):
        try:
            parts.append(fut.result() + (lo << 1))  # local index -> global (the code is index << 1)
        except kernels.NonFiniteAt as exc:
            first_bad = lo + exc.index if first_bad is None else first_bad
    if first_bad is not None:
        raise kernels.NonFiniteAt(first_bad)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def encode(
    residual: object,
    update: object,
    threshold: float,
    *,
    form: str | None = None,
    threads: int = 1,
    base: object = None,
    rewind: bool = False,
) -> Message:
    """`codec.encode` on float32 arrays (its docstring)."""
    r, u, b = _check_encode(residual, update, base, rewind)
    tau = threshold_value(threshold)
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    threads = check_threads(threads)
    try:
        if threads == 1:  # a dense step in passes, without an array of all its codes (encode_passes.py)
            return encode_passes.plain_message(r, u, tau, b, rewind, form)
        codes = _codes_threaded(r, u, np.float32(tau), b, rewind, threads)
    except kernels.NonFiniteAt as exc:
        i = exc.index
        what = "residual" if u is None else "residual + update" if b is None else "residual + update - base"
        raise NonFiniteError(
            f"{what} is not finite at index {i} (residual[{i}] = {r[i]!r}"
            + (f", update[{i}] = {u[i]!r}" if u is not None else "")
            + (f", base[{i}] = {b[i]!r}" if b is not None else "")
            + "); the residual is partly updated and must be reset"
        ) from None
    return Message.from_codes(codes, tau, r.size, form)


def apply(message: Message, params: object, scale: float = 1.0) -> None:
    """`codec.apply` on a float32 array."""
    if not isinstance(message, Message):
        raise TypeError(f"message must be a Message, got {type(message).__name__}")
    p = check_vector("params", params, writable=True, n=message.n_params)
    message.apply_to(p, message.step(scale))


def quantile_threshold(values: object, density: float) -> float | None:
    """`threshold.quantile_threshold` of an array."""
    a = np.abs(np.asarray(values, dtype=np.float32))
    a = a[np.isfinite(a)]  # a NaN/inf is the encoder's to report, with its index
    m = a.size
    if m == 0:
        return None
    k = min(m, max(1, round(density * m)))
    # select among the non-zero values: the same k-th largest, and np.partition degenerates on a mostly
    # zero array (a relay's aggregation residual: 9 ms instead of 0.4 ms on 64 k values)
    nonzero = a[a > 0]
    if nonzero.size == 0:
        return None
    kth = float(nonzero.min()) if nonzero.size < k else float(np.partition(nonzero, nonzero.size - k)[nonzero.size - k])
    return min(max(kth, MIN_THRESHOLD), MAX_THRESHOLD)


def check_residual(residual: object) -> np.ndarray:
    """A residual to clip: a float32 ndarray (TypeError else)."""
    if not isinstance(residual, np.ndarray) or residual.dtype != np.float32:
        raise TypeError("residual must be a float32 numpy.ndarray or torch.Tensor")
    return residual


def clip(residual: np.ndarray, bound: np.float32) -> None:
    """residual = clip(residual, −bound, bound) in place."""
    np.clip(residual, -bound, bound, out=residual)


def rescale(residual: np.ndarray, ratio: np.float32) -> None:
    """residual ← ratio·residual (float32) in place."""
    np.multiply(residual, ratio, out=residual)


def load(residual: np.ndarray, values: object) -> None:
    """residual[:] = values."""
    np.copyto(residual, values)  # type: ignore[arg-type]


def like(point: np.ndarray, values: object) -> np.ndarray:
    """``values`` as a contiguous float32 array (the kind of ``point``)."""
    return np.ascontiguousarray(values, dtype=np.float32)


def buffer_change(before: np.ndarray, after: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, (after − before) ÷ world_size) of the entries whose bits changed (`update.buffer_change`)."""
    index = np.flatnonzero(before.view(np.uint32) != after.view(np.uint32))
    return index, ((after[index] - before[index]) / np.float32(world_size)).astype(np.float32)


def add_at(target: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """target[index] += values (distinct indices)."""
    target[index] += values


# --- the folded residual (folded.py): r = (q − p)·(1/s) is read by the kernels, never stored ----------------------


def check_pair(point: object, params: object) -> tuple[np.ndarray, np.ndarray]:
    q = check_vector("point", point, writable=True)
    p = check_vector("params", params, writable=False, n=q.size)
    if np.shares_memory(q, p):
        raise ValueError("point must not overlap params (it holds params + scale × residual)")
    return q, p


def encode_folded(
    point: np.ndarray, params: np.ndarray, tau: float, inv: np.float32, step: np.float32, form: str | None = None
) -> Message:
    """`folded.encode_folded` on a checked pair."""
    try:
        return encode_passes.folded_message(point, params, inv, tau, step, form)
    except kernels.NonFiniteAt as exc:
        i = exc.index
        raise NonFiniteError(
            f"the residual (point − params)/scale is not finite at index {i} (point[{i}] = "
            f"{point[i]!r}, params[{i}] = {params[i]!r}); the point is partly reduced and must "
            "be reset"
        ) from None


def clip_folded(point: np.ndarray, params: np.ndarray, inv: np.float32, bound: np.float32, scaled: np.float32) -> int:
    return kernels.folded_clip(point, params, inv, bound, scaled)


def rescale_folded(point: np.ndarray, params: np.ndarray, ratio: np.float32) -> None:
    kernels.folded_rescale(point, params, ratio)


def unfold(point: np.ndarray, params: np.ndarray, inv: np.float32) -> np.ndarray:
    diff: np.ndarray = np.subtract(point, params, dtype=np.float32)
    if inv != 1.0:
        diff *= inv
    return diff


def fold(point: np.ndarray, params: np.ndarray, residual: object, s: np.float32) -> None:
    r = check_vector("residual", residual, writable=False, n=point.size)
    if s == 1.0:
        np.add(params, r, out=point)
    else:
        np.multiply(r, s, out=point)
        point += params
