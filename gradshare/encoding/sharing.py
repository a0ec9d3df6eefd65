"""A worker's update-sharing state and its one step function (a state object and a function, shaped like
PyTorch's
`PowerSGDState` + `powerSGD_hook`).

    state = SharingState(n_params, rule=CalibratedThreshold(density=1e-3), clipping=ResidualClipping())
    state.set_lr(lr)                       # before the step's update enters the residual
    ... the update u is added to state.residual (by the optimizer, or by the fused encode below) ...
    message = share_step(state, step)      # or share_step(state, step, update=P_after, base=P_before, rewind=True)

What the state holds: the residual r (sub-threshold update mass not sent yet), the threshold rule,
residual clipping, the learning rate the residual is expressed in, and this worker's own messages that
its apply log has not applied yet (the staleness lookahead, worker.py).

Learning-rate schedules ("corrected error feedback", Zheng et al. 2019): an update is the
learning rate times a direction, and so is the residual that accumulates it. When the rate changes
from η to η', mass left in r from steps at η would enter the model at the old scale (under cosine
annealing the last, tiny steps would release a backlog built at the peak rate). `set_lr` rescales r by
η'/η, and a fixed or adaptive τ is scaled by η'/η₀ (a calibrated τ follows the rescaled residual by
itself). The invariant, in units of each step's own rate η_t (all η_t > 0):

    Σ_t sent_t / η_t  +  r_T / η_T  =  Σ_t u_t / η_t

so error feedback stays exact in learning-rate-normalised units. A step at η = 0 sends nothing (τ is
set out of reach, no division anywhere) and the residual is not rescaled across a zero rate.

Devices: with ``device=None`` the residual is a NumPy array and every step runs the Numba
kernels, the CPU default. With a device ("cuda", "cuda:1", or "cpu" to run the same code on the CPU,
as the tests do) the residual is a float32 torch tensor there, the update and base must live there
too, and the encode, the clipping and the calibration sample run there with torch ops
(encoding/torch_codec.py); only the message's entry codes come to the host. Both give the same
messages and residuals, bit for bit.

Folded (``fold=(params, point, scale)``, the local view's "Q-form", encoding/folded.py): the state keeps
the point q = P + s·r instead of r. The optimizer adds its update to q (`target`); the encode, the
calibration sample, the clipping and the learning-rate rescaling read r as (q − P)/s; the apply log
applies every message to q as to P (flat.py, `FlatParams.point`). `residual` is then None;
`residual_values()` and `load_residual()` give and take r in either form (checkpoints).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from gradshare.encoding import folded as folding
from gradshare.encoding.backend import NUMPY, Backend, backend_of, torch_backend
from gradshare.encoding.codec import Vector, decode_entries
from gradshare.encoding.message import EMPTY, MAX_THRESHOLD, MIN_THRESHOLD, Message
from gradshare.encoding.threshold import CalibratingRule, ResidualClipping, ThresholdRule

if TYPE_CHECKING:
    import torch


def _usable(device: object) -> torch.device:
    """``device`` as a torch.device torch can allocate on, else a ValueError naming it."""
    import torch  # only here: the NumPy path never imports torch

    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device))
    except RuntimeError:
        raise ValueError(
            f"device must be None, a torch.device or its name (e.g. 'cpu', 'cuda:0'), got {device!r}"
        ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"device {dev} is not usable: torch sees {count} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
    return dev


class SharingState:
    """Everything a worker keeps between steps to share its updates.

    rule: a threshold rule (`CalibratedThreshold`, `AdaptiveThreshold`, `FixedThreshold`, ...).
    clipping: `ResidualClipping` or None.
    follow_lr: rescale the residual (and a non-calibrated τ) with the learning rate (module docstring).
    keep_pending: keep own sent messages until the apply log has applied them (staleness lookahead).
    device: None for a NumPy residual (the Numba path); a torch device or its name ("cpu", "cuda:1") for a
        torch tensor residual on it (module docstring). "auto" is the caller's to resolve first (the worker
        does, with `gradshare.replica.device.resolve_device`), so this package needs no Spark context.
    fold: (params, point, scale) to keep the residual folded into ``point`` = params + scale × r
        (module docstring): two float32 NumPy arrays of n_params, ``point`` equal to ``params`` (r = 0).
    """

    def __init__(
        self,
        n_params: int,
        rule: ThresholdRule,
        clipping: ResidualClipping | None = None,
        *,
        follow_lr: bool = True,
        keep_pending: bool = False,
        device: str | torch.device | None = None,
        fold: tuple[Vector, Vector, float] | None = None,
    ) -> None:
        if isinstance(n_params, bool) or not isinstance(n_params, (int, np.integer)) or n_params < 1:
            raise ValueError(f"n_params must be an int >= 1, got {n_params!r}")
        if not (hasattr(rule, "threshold") and hasattr(rule, "update")):
            raise TypeError("rule must have .threshold and .update(n_entries, n_params)")
        self.rule, self.clipping = rule, clipping
        self.follow_lr, self.keep_pending = bool(follow_lr), bool(keep_pending)
        self.residual: Vector | None
        self.params: Vector | None = None
        self.point: Vector | None = None
        self.scale = 1.0
        # the backend of the residual's (or the point's) kind, chosen here once for every step (backend.py)
        self.backend: Backend[Any]
        if fold is not None:
            self.params, self.point, self.scale = fold  # checked by every pass over them (folded.py)
            if tuple(self.point.shape) != (int(n_params),) or tuple(self.params.shape) != (int(n_params),):
                raise ValueError(f"fold's params and point must have shape ({int(n_params)},)")
            self.residual = None
            self.backend = backend_of(self.point)
        elif device is None:
            self.backend = NUMPY
            self.residual = NUMPY.zeros(int(n_params), None)
        else:
            dev = _usable(device)

            self.backend = torch_backend()
            self.residual = self.backend.zeros(int(n_params), dev)
        self._n_params = int(n_params)
        self.lr: float | None = None  # the rate the residual is expressed in
        self.lr_ref: float | None = None  # the first positive rate: a fixed/adaptive τ is meant for it
        self.pending: deque[tuple[int, Message, np.ndarray]] = deque()  # (step, message, its indices)
        self.tau: float | None = None  # the τ of the last message
        self.silent_steps = 0  # steps that sent no entry

    @property
    def n_params(self) -> int:
        return self._n_params

    @property
    def folded(self) -> bool:
        return self.point is not None

    def fold_pair(self) -> tuple[Vector, Vector] | None:
        """(point, params) when the residual is folded into the point, else None."""
        if self.point is None or self.params is None:
            return None
        return self.point, self.params

    def plain_residual(self) -> Vector:
        """The stored residual r (a state that is not folded)."""
        if self.residual is None:
            raise ValueError("the residual is folded into the point: read residual_values()")
        return self.residual

    @property
    def target(self) -> Vector:
        """The array a step's update is added to (by the optimizer, capture.py): r, or the point q."""
        return self.point if self.point is not None else self.plain_residual()

    def residual_values(self) -> Vector:
        """r: the residual itself, or (folded) a new array (q − P)/s."""
        pair = self.fold_pair()
        return folding.unfold(*pair, self.scale) if pair is not None else self.plain_residual()

    def load_residual(self, values: Vector) -> None:
        """Set r (float32, n_params; NumPy, or a tensor for a tensor residual); folded, on the current P."""
        pair = self.fold_pair()
        if pair is not None:
            point, params = pair
            folding.fold(point, params, self.backend.like(point, values), self.scale)
            return
        self.backend.load(self.plain_residual(), values)

    def load_point(self, values: Vector) -> None:
        """Set the folded point q itself (float32, n_params): a checkpoint's q, so that a resume is bit for
        bit where the fit was ((q − P)/s and back rounds twice). Folded states only."""
        pair = self.fold_pair()
        if pair is None:
            raise ValueError("the residual is not folded into a point: load_residual()")
        self.backend.load(pair[0], values)

    def rescale(self, ratio: float | np.float32) -> None:
        """r ← ratio·r (float32 ratio)."""
        ratio32 = np.float32(ratio)
        pair = self.fold_pair()
        if pair is not None:
            folding.rescale_folded(*pair, ratio32)
            return
        self.backend.rescale(self.plain_residual(), ratio32)

    def set_lr(self, lr: float | None) -> None:
        """The learning rate of the coming step; call before its update enters the residual."""
        if lr is None:
            return
        lr = float(lr)
        if not (np.isfinite(lr) and lr >= 0.0):
            raise ValueError(f"learning rate must be finite and >= 0, got {lr!r}")
        if self.lr_ref is None and lr > 0.0:
            self.lr_ref = lr
        if self.follow_lr and self.lr is not None and self.lr > 0.0 and lr > 0.0 and lr != self.lr:
            self.rescale(np.float32(lr / self.lr))
        follow = getattr(self.rule, "follow_lr", None)  # a calibrated rule's density follows the rate
        if self.follow_lr and follow is not None and lr > 0.0:
            follow(lr)
        self.lr = lr

    def threshold(self, step: int, update: Vector | None = None, base: Vector | None = None) -> float:
        """The τ step ``step`` encodes with (calibrating the rule when it calibrates)."""
        if self.lr == 0.0:
            return MAX_THRESHOLD  # nothing moves at rate 0: nothing is sent, nothing divides by it
        calibrate: Callable[[Vector, int, int], float] | None = getattr(self.rule, "calibrate", None)
        if calibrate is not None:
            # a rule that calibrates also gives the sample's stride (threshold.CalibratingRule)
            stride = cast(CalibratingRule, self.rule).stride(self.n_params, step)
            start = step % stride  # the sample moves every step: no parameter is never looked at
            pair = self.fold_pair()
            if pair is not None:
                sample = folding.unfold(pair[0][start::stride], pair[1][start::stride], self.scale)
            else:
                sample = self.plain_residual()[start::stride]
            if update is not None:  # the general path adds u = update - base inside the encode
                u = update[start::stride] if base is None else update[start::stride] - base[start::stride]
                sample = sample + u
            return calibrate(sample, step, self.n_params)
        tau = self.rule.threshold
        if self.follow_lr and self.lr_ref and self.lr:
            tau = tau * (self.lr / self.lr_ref)
        return min(max(tau, MIN_THRESHOLD), MAX_THRESHOLD)

    def forget_applied(self, applied_through: int) -> None:
        """Drop own messages of steps the apply log has applied (they are in the parameters now)."""
        while self.pending and self.pending[0][0] <= applied_through:
            self.pending.popleft()


def share_step(
    state: SharingState, step: int, *, update: Vector | None = None, base: Vector | None = None, rewind: bool = False
) -> Message:
    """Encode this step's share of the residual as one message and advance the state.

    Direct path: the optimizer has already added the update to ``state.residual``; call with no
    ``update``. General path: ``update``/``base`` are P_after/P_before, added inside the fused encode,
    which with ``rewind`` also puts P_before back (see `encode`). The rule advances, the residual is
    clipped when due, and with ``keep_pending`` the message is kept for the lookahead.
    """
    tau = state.threshold(step, update, base)
    pair = state.fold_pair()
    if pair is not None:
        if update is not None:
            raise ValueError("a folded state takes the update in its point (the direct path): pass no update")
        message = folding.encode_folded(*pair, tau, state.scale)
        state.rule.update(message.n_entries, message.n_params)
        clipping = state.clipping
        if clipping is not None and clipping.due(step):
            folding.clip_folded(*pair, clipping.bound(message.threshold), state.scale)
    else:  # encode_step, on the state's own backend
        residual = state.plain_residual()
        message = state.backend.encode(residual, update, tau, base=base, rewind=rewind)
        state.rule.update(message.n_entries, message.n_params)
        clipping = state.clipping
        if clipping is not None and clipping.due(step):
            state.backend.clip(residual, clipping.bound(message.threshold))
    state.tau = message.threshold
    if message.n_entries == 0:
        state.silent_steps += 1
    if state.keep_pending:
        state.pending.append((step, message, decode_entries(message)[0]))
    return message


def skipped_step(state: SharingState) -> Message:
    """The message of a step whose optimizer step was skipped (a loss scaler found inf/NaN gradients,
    precision.py): its update is zero, so it sends nothing, and the residual and the rule are left as
    they were (encoding the residual again would send mass of earlier steps under a re-calibrated τ).
    The empty message is still sent, so the apply log can advance past the step."""
    state.silent_steps += 1
    tau = state.tau if state.tau is not None else MAX_THRESHOLD  # an empty message's τ is never applied
    return Message(tau, state.n_params, 0, EMPTY, b"")
