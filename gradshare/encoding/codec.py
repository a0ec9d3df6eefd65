"""Public threshold codec: `encode` (fused r += u and threshold encode) and `apply` (decode-apply).

Strom 2015 / DL4J `SharedTrainingMaster`: a worker keeps a residual r; each step r += u, every
|r_i| >= τ is sent as "±τ at i" and r_i -= ±τ stays local (one τ per entry per step).

Non-finite values: if r + u becomes NaN or ±inf anywhere (a NaN/inf update, or float32 overflow),
`encode` raises ValueError naming the first such index. The residual has then been partly updated
(every block before that index is accumulated and reduced) and must be reset before it is used again:
a diverged step cannot be sent as ±τ entries.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gradshare.encoding import kernels as _k
from gradshare.encoding import rice as _rice
from gradshare.encoding.message import BITMAP, EMPTY, FORMS, RICE, SPARSE, Message, bitmap_size, to_float32_threshold
# The public codec takes either kind of Vector and dispatches on the residual's (or the parameters') kind.
# "as Vector": re-exported, the encoding modules name it from here.
from gradshare.vectors import Vector as Vector
from gradshare.vectors import is_tensor


def _check_vector(name: str, array: object, *, writable: bool, n: int | None = None) -> np.ndarray:
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


def _threshold_value(threshold: object) -> float:
    # A threshold rule (FixedThreshold, AdaptiveThreshold, ...) is accepted for its current τ.
    value = getattr(threshold, "threshold", threshold)
    return to_float32_threshold(value)  # type: ignore[arg-type]


_APPLY_BATCH = 1024  # codes decoded per batch before they are applied (see kernels._apply_batch)

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gradshare-encode")
        return _pools[threads]


def _encode_range(r: np.ndarray, u: np.ndarray | None, tau: np.float32, base: np.ndarray | None = None,
                  rewind: bool = False) -> np.ndarray:
    """Entry codes (local indices) of the fused pass over the views r/u (u - base when base is given);
    grows its buffer as needed."""
    n = r.size
    out = np.empty(max(1024, n >> 8), np.int64)  # 0.4 % density before the first regrowth
    k, pos, added_end = 0, 0, (0 if u is not None else n)
    uu = u if u is not None else r  # not read when added_end == n
    mode = _k.ADD if base is None else _k.DIFF_REWIND if rewind else _k.DIFF
    while True:
        k, pos, status = _k._accumulate_encode(r, uu, uu if base is None else base, mode, tau, out, k, pos, added_end)
        if status == _k.OK:
            return out[:k]
        if status == _k.NONFINITE:
            block = r[pos : pos + _k.BLOCK]
            i = pos + int(np.flatnonzero(~np.isfinite(block))[0])
            raise _NonFinite(i)
        grown = np.empty(max(2 * out.size, k + _k.BLOCK), np.int64)  # FULL: the block did not fit
        grown[:k] = out[:k]
        out = grown
        added_end = max(added_end, pos + _k.BLOCK)  # that block is accumulated already


class _NonFinite(Exception):
    def __init__(self, index: int) -> None:
        self.index = index


def _build(codes: np.ndarray, tau: float, n_params: int, form: str | None) -> Message:
    """A Message holding ``codes`` (sorted entry codes) in ``form`` (None: the smallest form)."""
    k = codes.size
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    if form == EMPTY and k:
        raise ValueError(f"form 'empty' cannot hold {k} entries")
    if form is None and k == 0:
        form = EMPTY
    varint_bytes, rice_k, rice_bits = _rice._form_sizes(codes, n_params)
    sizes = {SPARSE: varint_bytes, RICE: 1 + (rice_bits + 7) // 8, BITMAP: bitmap_size(n_params)}
    if form is None:
        form = min(sizes, key=lambda f: (sizes[f], FORMS.index(f)))  # smallest; ties by FORMS order
    if form == EMPTY:
        buf = np.empty(0, np.uint8)
    elif form == SPARSE:
        buf = np.empty(sizes[SPARSE], np.uint8)
        _k._sparse_write(codes, buf)
    elif form == RICE:
        buf = np.zeros(sizes[RICE], np.uint8)
        _rice._rice_write(codes, rice_k, buf)
    else:
        buf = np.zeros(sizes[BITMAP], np.uint8)
        _k._bitmap_write(codes, buf)
    # Built here from the kernels' own output, so the constructor's validation pass is skipped
    # (tests check that every encode result also passes the validating constructor).
    return Message._trusted(tau, n_params, k, form, buf.tobytes())


def encode(
    residual: Vector,
    update: Vector | None,
    threshold: float,
    *,
    form: str | None = None,
    threads: int = 1,
    base: Vector | None = None,
    rewind: bool = False,
) -> Message:
    """Accumulate ``update`` into ``residual`` IN PLACE and threshold-encode it.

    residual: float32, 1-D, C-contiguous, writable. After the call every |residual_i| that was >= τ
        has been reduced by one τ toward zero, and the message holds the matching ±τ entries.
    update: float32 array of the same shape, or None to encode ``residual`` as it is.
    threshold: τ > 0 (rounded to float32, the precision of the kernels), or a threshold rule object
        (its current ``.threshold`` is used; the rule is not advanced, see `encode_step`).
    form: None picks the smallest of empty/sparse/rice/bitmap; a form name forces it (benchmarks, tests).
    base: with ``update``, accumulate ``update - base`` instead (e.g. P_after and P_before of an optimizer
        step), rounded to float32 before it is added: bit-identical to ``encode(residual, update - base)``
        in one pass, without the temporary.
    rewind: with ``base``, also set ``update`` to ``base`` in the same pass (``update`` must be writable):
        the worker's parameters return to P_before without a copy. On the NaN/inf error, ``update`` is
        rewound up to the block that failed.
    threads: split the vector into this many contiguous ranges encoded in parallel (the kernels release
        the GIL). The message is identical for every thread count.

    Raises ValueError on NaN/inf, see the module docstring.

    A torch.Tensor residual (any device) runs the device-generic path, `torch_codec.encode_tensor`:
    the same message, bit for bit; update and base must then be tensors on the residual's device, and
    ``threads`` is not used (torch's own threads or the GPU do the work).
    """
    if is_tensor(residual):
        from gradshare.encoding.torch_codec import encode_tensor

        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        # the ignore: update and base are tensors too, or encode_tensor raises naming them
        return encode_tensor(residual, update, threshold, form=form, base=base, rewind=rewind)  # type: ignore[arg-type]
    # each check returns the array it checked: the rebinding tells the checker they are arrays now
    _check_vector("residual", residual, writable=True)
    if update is not None:
        update = _check_vector("update", update, writable=False, n=residual.size)
    if base is not None:
        if update is None:
            raise ValueError("base needs an update to subtract it from")
        base = _check_vector("base", base, writable=False, n=residual.size)
    if rewind:
        if base is None:
            raise ValueError("rewind needs a base to rewind the update to")
        update = _check_vector("update", update, writable=True)
        if np.shares_memory(update, base) or np.shares_memory(update, residual):
            raise ValueError("update must not overlap base or residual when rewind is set")
    tau = _threshold_value(threshold)
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    tau32 = np.float32(tau)
    n = residual.size
    try:
        if threads == 1 or n < threads * _k.BLOCK * 16:
            codes = _encode_range(residual, update, tau32, base, rewind)
        else:
            # Contiguous ranges aligned to BLOCK, so each range's codes are sorted and ranges concatenate.
            step = -(-n // threads)
            step = -(-step // _k.BLOCK) * _k.BLOCK
            bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
            futures = [
                _pool(threads).submit(
                    _encode_range, residual[lo:hi], None if update is None else update[lo:hi], tau32,
                    None if base is None else base[lo:hi], rewind,
                )
                for lo, hi in bounds
            ]
            parts = []
            first_bad: int | None = None
            for (lo, _), fut in zip(bounds, futures):
                try:
                    parts.append(fut.result() + (lo << 1))  # local index -> global (the code is index << 1)
                except _NonFinite as exc:
                    first_bad = lo + exc.index if first_bad is None else first_bad
            if first_bad is not None:
                raise _NonFinite(first_bad)
            codes = np.concatenate(parts) if parts else np.empty(0, np.int64)
    except _NonFinite as exc:
        i = exc.index
        what = "residual" if update is None else "residual + update" if base is None else "residual + update - base"
        raise ValueError(
            f"{what} is not finite at index {i} (residual[{i}] = {residual[i]!r}"
            + (f", update[{i}] = {update[i]!r}" if update is not None else "")
            + (f", base[{i}] = {base[i]!r}" if base is not None else "")
            + "); the residual is partly updated and must be reset"
        ) from None
    return _build(codes, tau, n, form)


def apply(message: Message, params: Vector, scale: float = 1.0) -> None:
    """params[i] += ±τ·scale for every entry of ``message`` (decode-apply, in place).

    The step is computed once as float32(τ·scale) and added with float32 arithmetic, so every replica
    that applies the same messages in the same order gets bit-identical parameters. A torch.Tensor
    ``params`` (any device) is updated by `torch_codec.apply_tensor`, to the same bits.
    """
    if is_tensor(params):
        from gradshare.encoding.torch_codec import apply_tensor

        return apply_tensor(message, params, scale)
    if not isinstance(message, Message):
        raise TypeError(f"message must be a Message, got {type(message).__name__}")
    _check_vector("params", params, writable=True, n=message.n_params)
    step = _apply_step(message, scale)
    if message.form in (SPARSE, RICE):
        steps = np.array([step, -step], np.float32)
        batch = np.empty(min(message.n_entries, _APPLY_BATCH), np.int64)
        if message.form == SPARSE:
            _k._sparse_apply(np.frombuffer(message.payload, np.uint8), message.n_entries, steps, params, batch)
        else:
            _rice._rice_apply(message._padded, message.n_entries, steps, params, batch)
    elif message.form == BITMAP:
        _k._bitmap_apply(np.frombuffer(message.payload, np.uint8), np.array([0, step, -step], np.float32), params)


def _apply_step(message: Message, scale: float) -> np.float32:
    """float32(τ·scale), the one step every entry adds (both codecs round it here, on the host)."""
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}") from None
    with np.errstate(over="ignore"):
        step = np.float32(message.threshold * scale)
    if not np.isfinite(step):
        raise ValueError(f"scale {scale!r} times threshold {message.threshold!r} is not finite in float32")
    return step


def decode_entries(message: Message) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64 ascending, signs int8 of ±1) of the message's entries."""
    codes = _codes(message)
    return codes >> 1, (1 - 2 * (codes & 1)).astype(np.int8)


def decode(message: Message) -> np.ndarray:
    """The message as a dense float32 vector (zeros plus the ±τ entries)."""
    dense = np.zeros(message.n_params, np.float32)
    apply(message, dense)
    return dense


def convert(message: Message, form: str | None) -> Message:
    """The same entries in another form (None: the smallest)."""
    return _build(_codes(message), message.threshold, message.n_params, form)


def _codes(message: Message) -> np.ndarray:
    out = np.empty(message.n_entries, np.int64)
    payload = np.frombuffer(message.payload, np.uint8)
    if message.form == SPARSE:
        _k._sparse_decode(payload, message.n_entries, out)
    elif message.form == RICE:
        _rice._rice_decode(message._padded, message.n_entries, out)
    elif message.form == BITMAP:
        _k._bitmap_decode(payload, out)
    return out
