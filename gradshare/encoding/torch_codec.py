"""The threshold codec on torch tensors, on any device (the model, its residual, the encode and
the apply live on the GPU; only the sparse message crosses to the host).

Same contract as the NumPy backend (numpy_codec.py), bit for bit: for the same float32 values `encode`
leaves the same residual and builds a `Message` whose bytes are identical to numpy_codec.encode's, and
`apply` gives the same parameters as numpy_codec.apply. That holds because every value is produced by
the same single IEEE float32 operation on both paths (r + u, a − b, x ∓ τ, p ± float32(τ·scale)) and
elementwise torch ops round exactly like NumPy's and Numba's, on CPU and CUDA alike (no fused
multiply-add; subnormals are kept unless torch.set_flush_denormal(True) is set, which breaks this on
the CPU). Only the selected entry codes are copied to the host, where `Message.from_codes` writes the message.

Differences from the Numba path, both documented where they apply:
- On NaN/inf the whole residual has been accumulated (not only the blocks before the bad one), and with
  ``rewind`` the whole update has been rewound; either way the residual must be reset, as there.
- ``threads`` does not apply: torch runs elementwise ops on its own intra-op threads (or the GPU).

This module is the torch backend (backend.py): its functions have the names and arguments of
numpy_codec.py's. A state picks it once when it is built for a tensor (`backend_of`, `backend_for`), and
the public codec (`encode`, `apply`, `ResidualClipping.apply`, `quantile_threshold`, `buffer_change`,
`apply_update`, folded.py) reaches it through `backend_of` when given a tensor, so a caller never names
this module. It is the encoding package's one seam to torch: importing it imports torch (about 3 s),
which the NumPy path (and `gradshare bench encoding`) never pays: backend.py imports it only when a
tensor or a device asks for it. It imports nothing of the codec above it (no cycle).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import NDArray

from gradshare.encoding.message import FORMS, MAX_THRESHOLD, MIN_THRESHOLD, Message, threshold_value
from gradshare.errors import NonFiniteError

# Values per block of the two-level entry search (`_entries`): 128 measured fastest of 32..256 on a CPU
# at density 1e-3 (smaller blocks make the per-block max/min slower, larger ones search more values).
BLOCK = 128
_FLT_MAX = float(np.finfo(np.float32).max)


def zeros(n: int, device: torch.device | str) -> torch.Tensor:
    """A zero vector of ``n`` float32 values on ``device``."""
    return torch.zeros(n, dtype=torch.float32, device=device)


def check_tensor(name: str, t: object, *, device: torch.device | None = None, n: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must have dtype torch.float32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (pass a flat view of the parameter buffer)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the residual's device)")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements, expected {n}")
    return t


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous float32 tensors share any byte of storage."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


def encode(
    residual: torch.Tensor,
    update: torch.Tensor | None,
    threshold: float,
    *,
    form: str | None = None,
    threads: int = 1,
    base: torch.Tensor | None = None,
    rewind: bool = False,
) -> Message:
    """`codec.encode` on float32 tensors of one device: r += u (or u − base), every |r_i| >= τ leaves r as
    one ±τ entry; returns the identical Message (see the module docstring for the two differences).
    ``threads`` is checked and not used."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    check_tensor("residual", residual)
    device, n = residual.device, residual.numel()
    if update is not None:
        check_tensor("update", update, device=device, n=n)
    if base is not None:
        if update is None:
            raise ValueError("base needs an update to subtract it from")
        check_tensor("base", base, device=device, n=n)
    if rewind:
        if base is None:
            raise ValueError("rewind needs a base to rewind the update to")
        assert update is not None  # a base needs an update: checked above
        if overlap(update, base) or overlap(update, residual):
            raise ValueError("update must not overlap base or residual when rewind is set")
    tau = threshold_value(threshold)
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    with torch.no_grad():
        if update is not None:
            # u = update − base is rounded to float32 before it is added, as the fused kernel does.
            residual.add_(update if base is None else update - base)
            if rewind:
                assert base is not None  # rewind needs a base: checked above
                update.copy_(base)
        tau_t = torch.tensor(tau, dtype=torch.float32, device=device)
        found = _entries(residual, tau_t)
        if found is None:
            i = int(torch.nonzero(~torch.isfinite(residual))[0, 0])  # only on the error path
            what = "residual" if update is None else "residual + update" if base is None else "residual + update - base"
            raise NonFiniteError(
                f"{what} is not finite at index {i} (residual[{i}] = {residual[i].item()!r} after the "
                "accumulation); the residual is updated and must be reset"
            )
        index, values = found
        # x − τ for x >= τ, x + τ (written x − (−τ), the same IEEE result) for x <= −τ.
        residual[index] = values - torch.copysign(tau_t, values)
        codes = (index << 1) | (values < 0).to(torch.int64)
        host = codes.cpu().numpy()  # the only copy to the host: k int64 codes
    return Message.from_codes(host, tau, n, form)


def _entries(r: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ascending indices, values) of every |r_i| >= τ, or None when r holds a NaN/inf.

    torch.nonzero over the whole vector is slow on a CPU (~50x an add at 10 M), so the search is
    two-level, like the Numba kernel's blocks: the max and min of each BLOCK say which blocks hold an
    entry (and, NaN propagating through both, whether any value is not finite); only those blocks are
    searched. At density 1e-3 about 12 % of 128-value blocks are searched.
    """
    n = r.numel()
    nb = n // BLOCK
    blocks = r[: nb * BLOCK].view(nb, BLOCK)
    tail = r[nb * BLOCK :]  # fewer than BLOCK values: searched directly
    hi, lo = blocks.amax(dim=1), blocks.amin(dim=1)
    bad = (~(hi <= _FLT_MAX)).any() | (~(lo >= -_FLT_MAX)).any() | (~torch.isfinite(tail)).any()
    if bool(bad):  # one device→host sync decides
        return None
    hot = torch.nonzero((hi >= tau) | (lo <= -tau)).squeeze(1)
    found = blocks[hot]
    row, col = torch.nonzero(found.abs() >= tau, as_tuple=True)  # row-major: ascending within and across
    in_tail = torch.nonzero(tail.abs() >= tau).squeeze(1)
    return (torch.cat([hot[row] * BLOCK + col, in_tail + nb * BLOCK]), torch.cat([found[row, col], tail[in_tail]]))


def apply(message: Message, params: torch.Tensor, scale: float = 1.0) -> None:
    """`codec.apply` on a float32 tensor: params[i] += ±float32(τ·scale) for every entry, in place.

    The step is rounded on the host exactly as `apply` rounds it, and each index occurs once in a
    message, so each parameter sees one float32 addition, the same one the Numba kernel performs.
    """
    if not isinstance(message, Message):
        raise TypeError(f"message must be a Message, got {type(message).__name__}")
    check_tensor("params", params, n=message.n_params)
    step = message.step(scale)
    if message.n_entries == 0:
        return
    codes = torch.from_numpy(message.codes()).to(params.device)
    steps = torch.tensor([step, -step], dtype=torch.float32, device=params.device)
    index = codes >> 1
    with torch.no_grad():
        params[index] += steps[codes & 1]


def buffer_change(
    before: torch.Tensor, after: torch.Tensor, world_size: int
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """`update.buffer_change` of two tensors, on their device: (indices, values ÷ world_size) of the
    entries whose bits changed, the same bits as NumPy's; only those entries come to the host."""
    with torch.no_grad():
        index = torch.nonzero(before.view(torch.int32) != after.view(torch.int32)).squeeze(1)
        # A divisor tensor on the device, not a Python scalar: CUDA turns division by a host scalar into
        # multiplication by its reciprocal, which rounds differently from NumPy's true division.
        world = torch.tensor(float(world_size), dtype=torch.float32, device=before.device)
        values = (after[index] - before[index]) / world
        return index.cpu().numpy(), values.cpu().numpy()


def add_at(target: torch.Tensor, index: NDArray[np.uint32], values: NDArray[np.float32]) -> None:
    """target[index] += values (host arrays; `update.apply_update`'s buffer part on a tensor)."""
    device_index = torch.from_numpy(index.astype(np.int64)).to(target.device)
    with torch.no_grad():
        target[device_index] += torch.from_numpy(values).to(target.device)


def check_residual(residual: object) -> torch.Tensor:
    """A residual to clip: a tensor (TypeError else; its dtype and shape are checked by `clip`)."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError("residual must be a float32 numpy.ndarray or torch.Tensor")
    return residual


def clip(residual: torch.Tensor, bound: np.float32) -> None:
    """residual = clamp(residual, −bound, bound) in place (ResidualClipping on a tensor; the same values
    as np.clip for every finite and infinite input, NaN stays NaN)."""
    check_tensor("residual", residual)
    with torch.no_grad():
        residual.clamp_(-float(bound), float(bound))


def quantile_threshold(values: torch.Tensor, density: float) -> float | None:
    """`threshold.quantile_threshold` of a tensor, on its device: the identical τ for the same values.

    The k-th largest |value| is one order statistic, so torch.kthvalue and np.partition find the same
    float; the fallback (smallest non-zero) and the clamp are the same too.
    """
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    a = values.detach().reshape(-1).to(torch.float32).abs()
    a = a[torch.isfinite(a)]  # a NaN/inf is the encoder's to report, with its index
    m = a.numel()
    if m == 0:
        return None
    k = min(m, max(1, round(density * m)))
    kth = float(torch.kthvalue(a, m - k + 1).values)  # the (m − k + 1)-th smallest = k-th largest
    if kth <= 0.0:
        nonzero = a[a > 0]
        if nonzero.numel() == 0:
            return None
        kth = float(nonzero.min())
    return min(max(kth, MIN_THRESHOLD), MAX_THRESHOLD)


# --- the folded residual (encoding/folded.py) on tensors: r = (q − p)·(1/s) is a temporary here ---------------


def encode_folded(
    point: torch.Tensor, params: torch.Tensor, tau: float, inv: np.float32, step: np.float32, form: str | None = None
) -> Message:
    """`folded.encode_folded` on float32 tensors of one device (arguments checked there): the same
    message and the same point, bit for bit. r is computed once into a temporary the size of P (a device
    has no Numba kernel to read it block by block); on NaN/inf nothing has been changed."""
    with torch.no_grad():
        r = (point - params) * float(inv)
        tau_t = torch.tensor(tau, dtype=torch.float32, device=point.device)
        found = _entries(r, tau_t)
        if found is None:
            i = int(torch.nonzero(~torch.isfinite(r))[0, 0])
            raise NonFiniteError(
                f"the residual (point − params)/scale is not finite at index {i} (point[{i}] = "
                f"{point[i].item()!r}, params[{i}] = {params[i].item()!r}); nothing was changed"
            )
        index, values = found
        del r
        neg = values < 0
        steps = torch.tensor([float(step), -float(step)], dtype=torch.float32, device=point.device)
        point[index] -= steps[neg.to(torch.int64)]  # q − step for r >= τ, q − (−step) = q + step for r <= −τ
        codes = (index << 1) | neg.to(torch.int64)
        host = codes.cpu().numpy()
    return Message.from_codes(host, tau, point.numel(), form)


def clip_folded(
    point: torch.Tensor, params: torch.Tensor, inv: np.float32, bound: np.float32, scaled: np.float32
) -> int:
    """`folded.clip_folded` on tensors: the same point, bit for bit."""
    with torch.no_grad():
        r = (point - params) * float(inv)
        high, low = r > float(bound), r < -float(bound)
        del r
        point.copy_(torch.where(high, params + float(scaled), torch.where(low, params - float(scaled), point)))
        return int(high.sum() + low.sum())


def rescale_folded(point: torch.Tensor, params: torch.Tensor, ratio: np.float32) -> None:
    """`folded.rescale_folded` on tensors: point = params + (point − params)·ratio, the same bits."""
    with torch.no_grad():
        diff = point - params
        diff.mul_(float(ratio))
        torch.add(params, diff, out=point)


def check_pair(point: object, params: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(point, params) once they are float32 tensors of one device and length that do not overlap."""
    q = check_tensor("point", point)
    p = check_tensor("params", params, device=q.device, n=q.numel())
    if overlap(q, p):
        raise ValueError("point must not overlap params (it holds params + scale × residual)")
    return q, p


def unfold(point: torch.Tensor, params: torch.Tensor, inv: np.float32) -> torch.Tensor:
    """`folded.unfold` on tensors: (point − params)·inv, a new tensor (strided views too)."""
    with torch.no_grad():
        r = point - params
        return r.mul_(float(inv)) if inv != 1.0 else r


def fold(point: torch.Tensor, params: torch.Tensor, residual: object, s: np.float32) -> None:
    """`folded.fold` on tensors: point = params + s·residual."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor like point, got {type(residual).__name__}")
    with torch.no_grad():
        point.copy_(residual)
        if s != 1.0:
            point.mul_(float(s))
        point.add_(params)


def rescale(residual: torch.Tensor, ratio: np.float32) -> None:
    """residual ← ratio·residual: a float32 tensor times a float32-exact scalar, NumPy's rounding."""
    residual.mul_(float(ratio))


def load(residual: torch.Tensor, values: object) -> None:
    """residual[:] = values (an array or a tensor)."""
    residual.copy_(torch.as_tensor(values))


def like(point: torch.Tensor, values: object) -> torch.Tensor:
    """``values`` as a tensor on ``point``'s device."""
    return torch.as_tensor(values).to(point.device)
