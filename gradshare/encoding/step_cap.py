"""The step cap: every replica and the relay scale each parameter tensor's share of one step's summed
messages down to at most ``cap × its norm at the start of training`` (a state object and a function).

    cap = StepCap.of(sizes, initial_params, 0.1)
    apply_step([update_rank0, update_rank1, ...], state, scale=1.0, cap=cap)   # one whole step, rank order

Why: with N workers each step adds N workers' messages, each a full local optimizer step, so a step
moves a tensor ~N times as far as one process's would; at 64 workers that overshoot costs more than the
compression does. Capping the summed step per tensor, relative to the tensor's own size (the trust
ratio of LARS / LAMB, You et al. 2017 / 2020, taken against the initial norm, which every replica
knows from the start), measured in lock step at N = 64 over 3 seeds (docs/benchmarks/scaling.md):
tabular64k 82.81 → 84.41 %, MNIST-1D MLP 72.73 → 75.13 % (tuned DDP 85.63 / 70.99); at N = 32
tabular64k 85.35 → 87.34 %. A global cap (one bound for the whole model) measured worse (docs/design.md,
"What we tried: learning at 64 workers").

The part above the cap is dropped, not fed back: it is the overshoot. What a replica adds is a function
of the step's messages and their order alone: the norm is summed on the host in float64 (entries merged
by index in rank order), each tensor's step is ``float32(τ·scale·factor)`` and added with one float32
addition per entry, on NumPy or on a torch device, so every replica and the relay stay bit-identical.
A tensor whose initial norm is 0 (a zero-initialised bias) is not capped: a bound of 0 would freeze it.
Float buffers (BatchNorm statistics) are not capped: they travel exactly (update.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from gradshare.encoding.backend import backend_of
from gradshare.encoding.codec import apply
from gradshare.encoding.update import StepUpdate, add_buffers
from gradshare.vectors import Vector, to_host

# The step cap of the scaling study's "gradshare-cap" system (benchmarks/scaling.py); SharedTrainer's
# step_cap="auto" is the planner's, by worker count (driver/policy.py)
DEFAULT_STEP_CAP = 0.1


def step_cap_for(option: float | str | None) -> float | None:
    """The cap of a step_cap option other than "auto" (the planner resolves that one): None is no cap."""
    if option == "auto":
        raise ValueError("step_cap='auto' depends on the worker count: the planner resolves it")
    return None if option is None else float(option)


@dataclass(frozen=True)
class StepCap:
    """Per parameter tensor of the flat parameters: where it starts and its bound (inf: not capped).

    starts: the first flat index of each tensor, ascending from 0. bounds: cap × the tensor's norm at
    the start of training. n_params: the flat parameters' size (the last tensor ends there)."""

    starts: tuple[int, ...]
    bounds: tuple[float, ...]
    n_params: int

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0 or len(self.bounds) != len(self.starts):
            raise ValueError(f"step cap: {len(self.starts)} tensor starts (the first must be 0) and "
                             f"{len(self.bounds)} bounds")
        if any(b <= a for a, b in zip(self.starts, (*self.starts[1:], self.n_params))):
            raise ValueError(f"step cap: tensor starts must increase and stay below n_params={self.n_params}")
        if not all(b > 0 for b in self.bounds):  # inf allowed: not capped
            raise ValueError("step cap: every bound must be > 0 (inf: the tensor is not capped)")

    @classmethod
    def of(cls, sizes: Sequence[int], params: Vector, cap: float) -> StepCap:
        """The cap for tensors of ``sizes`` laid out one after another in ``params`` (their start values)."""
        if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap) and cap > 0):
            raise ValueError(f"step_cap must be a positive finite number (a share of each tensor's initial "
                             f"norm), got {cap!r}")
        host = to_host(params)
        starts, bounds, lo = [], [], 0
        for size in sizes:
            norm = float(np.linalg.norm(host[lo:lo + size].astype(np.float64)))
            starts.append(lo)
            bounds.append(cap * norm if norm > 0 else math.inf)
            lo += size
        return cls(tuple(starts), tuple(bounds), lo)

    def to_json(self) -> list[list[float]]:
        """[[start, bound], ...] (a checkpoint's job: a resumed fit keeps the first fit's bounds; JSON
        writes floats exactly, inf as Infinity)."""
        return [[s, b] for s, b in zip(self.starts, self.bounds)]

    @classmethod
    def from_json(cls, data: list[list[float]], n_params: int) -> StepCap:
        return cls(tuple(int(s) for s, _ in data), tuple(float(b) for _, b in data), n_params)

    def factors(self, updates: Sequence[StepUpdate], scale: float) -> tuple[NDArray[np.float64], list[Entries]]:
        """(per tensor, min(1, bound ÷ the norm of the step's summed messages); the messages' entries)."""
        starts = np.asarray((*self.starts, self.n_params), np.int64)
        bounds = np.asarray(self.bounds)
        parts = [entries(u, scale) for u in updates]
        # the triangle inequality first: Σ_r step_r·√(entries of r in the tensor) bounds the norm, and
        # usually settles it without merging the N messages by index
        upper = np.zeros(len(bounds))
        for p in parts:
            upper += p.step * np.sqrt(np.diff(np.searchsorted(p.index, starts)))
        factors = np.ones(len(bounds))
        if (upper <= bounds).all():
            return factors, parts
        values = [np.where(p.neg, -p.step, p.step) for p in parts]
        if len(parts) == 1:   # one message (an aggregate): its indices are distinct already
            where, total = parts[0].index, values[0]
        else:
            where, inverse = np.unique(np.concatenate([p.index for p in parts]), return_inverse=True)
            total = np.bincount(inverse, weights=np.concatenate(values), minlength=where.size)  # in rank order
        tensor = np.searchsorted(starts, where, side="right") - 1
        norm = np.sqrt(np.bincount(tensor, weights=total * total, minlength=len(bounds)))
        over = norm > bounds
        factors[over] = bounds[over] / norm[over]
        return factors, parts


@dataclass(frozen=True)
class Entries:
    """One message's entries: indices (ascending), signs, and its step float32(τ·scale) as a float."""

    index: NDArray[np.int64]
    neg: NDArray[np.bool_]
    step: float


def entries(update: StepUpdate, scale: float) -> Entries:
    codes = update.message.codes()
    return Entries(codes >> 1, (codes & 1).astype(bool), float(update.message.step(scale)))


def apply_step(updates: Sequence[StepUpdate], state: Vector, scale: float = 1.0, cap: StepCap | None = None,
               followers: Sequence[Vector] = ()) -> None:
    """One whole step's messages (rank order) into ``state`` (parameters, then float buffers) and into
    every follower (vectors of the parameters' size that move with them, flat.py), each tensor's share
    capped by ``cap`` (None, or no tensor over its bound: each message as `update.apply_update` adds it)."""
    if not updates:
        return
    n = updates[0].message.n_params
    targets = (state[:n], *followers)
    if cap is not None:
        factors, parts = cap.factors(updates, scale)
        if (factors < 1.0).any():
            _add_capped(updates, parts, factors, cap, targets, state)
            return
    for u in updates:
        for v in targets:
            apply(u.message, v, scale)
        add_buffers(u, state)


def _add_capped(updates: Sequence[StepUpdate], parts: list[Entries], factors: NDArray[np.float64], cap: StepCap,
                targets: Sequence[Vector], state: Vector) -> None:
    starts = np.asarray(cap.starts, np.int64)
    for u, p in zip(updates, parts):
        if p.index.size:
            steps = (p.step * factors).astype(np.float32)  # each tensor's step, rounded once, on the host
            values = steps[np.searchsorted(starts, p.index, side="right") - 1]
            values[p.neg] = -values[p.neg]
            index = p.index.astype(np.uint32)
            for v in targets:
                backend_of(v).add_at(v, index, values)
        add_buffers(u, state)


def step_applier(scale: float, cap: StepCap | None) -> Callable[[list[StepUpdate], NDArray[np.float32]], None] | None:
    """The relay's `apply_step` for a fit with ``cap`` (None without one: the relay applies message by
    message, as `apply_update`)."""
    return None if cap is None else functools.partial(apply_step, scale=scale, cap=cap)


__all__ = ["DEFAULT_STEP_CAP", "StepCap", "apply_step", "step_applier", "step_cap_for"]
