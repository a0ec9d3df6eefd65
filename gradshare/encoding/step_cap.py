"""The step cap: every replica and the relay scale each parameter tensor's share of one step's summed
messages down to at most ``cap × its norm now`` (the norm the tensor has as the step is applied; a
state object and a function).

    cap = StepCap.of(sizes, initial_params, 0.06)
    apply_step([update_rank0, update_rank1, ...], state, scale=1.0, cap=cap)   # one whole step, rank order

Why: with N workers each step adds N workers' messages, each a full local optimizer step, so a step
moves a tensor ~N times as far as one process's would. Capping the summed step per tensor relative to
the tensor's own size is the trust ratio of LARS / LAMB (You et al. 2017 / 2020), which reads the weight
norm as it is at each step. Read against the tensor's norm now, the cap follows the run: a tensor that
has grown (a CNN's filters under Adam at a high lr) gets room to move, and one initialised small (Hugging
Face's normal(0, 0.02)) is held as tightly as before. From 32 workers the cap stays a share of each
tensor's initial norm (``initial``), as it was measured there (driver/policy.py;
docs/benchmarks/scaling.md, "The step cap against the norm a tensor has now").

The part above the cap is dropped, not fed back: it is the overshoot. What a replica adds is a function
of its state before the step and the step's messages and their order alone, all of which are the same
on every replica: the norms are summed on the host in float64 in a fixed order (`tensor_norms2`; window
by window of indices for the step, each message streamed in index order, so no array as large as a
message is held), each tensor's step is ``float32(τ·scale·factor)`` and added with one float32 addition
per entry, on NumPy or on a torch device, so every replica and the relay stay bit-identical. A tensor
whose initial norm is 0 (a zero-initialised bias) is not capped: its norm starts at 0 and a share of it
would freeze it. Float buffers (BatchNorm statistics) are not capped: they travel exactly (update.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from gradshare.encoding.backend import backend_of
from gradshare.encoding.code_stream import CodeStream
from gradshare.encoding.codec import apply
from gradshare.encoding.message import Message
from gradshare.encoding.norms import add_capped, tensor_norms2, window_norms2
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


@dataclass
class _SeenNorms:
    """The norms a replica last read (0: never) and the steps it applied since (`StepCap.bounds`)."""

    norm: NDArray[np.float64]
    since: NDArray[np.int64]


@dataclass(frozen=True)
class StepCap:
    """Per parameter tensor of the flat parameters: where it starts and the share of its norm a step may
    move it (inf: not capped).

    starts: the first flat index of each tensor, ascending from 0. shares: the cap, or inf for a tensor
    whose norm was 0 at the start of training. n_params: the flat parameters' size (the last tensor ends
    there). initial: None, the cap is a share of each tensor's norm as the step starts; or each tensor's
    norm at the start of training, the cap a share of that (the row from 32 workers, where it was measured
    so: policy.py). It remembers the norms it last read (`bounds`), which belong to one replica's
    parameters as they move step by step: each replica applies with its own (``dataclasses.replace(cap)``)."""

    starts: tuple[int, ...]
    shares: tuple[float, ...]
    n_params: int
    initial: tuple[float, ...] | None = None  # each tensor's initial norm, when the cap is a share of it
    _seen: _SeenNorms = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0 or len(self.shares) != len(self.starts):
            raise ValueError(
                f"step cap: {len(self.starts)} tensor starts (the first must be 0) and {len(self.shares)} shares"
            )
        if any(b <= a for a, b in zip(self.starts, (*self.starts[1:], self.n_params))):
            raise ValueError(f"step cap: tensor starts must increase and stay below n_params={self.n_params}")
        if not all(b > 0 for b in self.shares):  # inf allowed: not capped
            raise ValueError("step cap: every share must be > 0 (inf: the tensor is not capped)")
        if self.initial is not None and len(self.initial) != len(self.starts):
            raise ValueError(f"step cap: {len(self.initial)} initial norms for {len(self.starts)} tensors")
        count = len(self.starts)
        object.__setattr__(self, "_seen", _SeenNorms(np.zeros(count), np.zeros(count, np.int64)))

    @classmethod
    def of(cls, sizes: Sequence[int], params: Vector, cap: float, norm: str = "now") -> StepCap:
        """The cap for tensors of ``sizes`` laid out one after another in ``params`` (their start values:
        a tensor whose norm is 0 there is not capped), a share of the norm each has ``norm``: "now" (as
        each step starts) or "initial" (in ``params``)."""
        if norm not in ("now", "initial"):
            raise ValueError(f"norm must be 'now' or 'initial', got {norm!r}")
        if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap) and cap > 0):
            raise ValueError(f"step_cap must be a positive finite number (a share of each tensor's norm), got {cap!r}")
        starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        norms2 = tensor_norms2(
            np.ascontiguousarray(to_host(params)[: sum(sizes)], np.float32), starts, np.ones(len(sizes), bool)
        )
        return cls(
            tuple(int(s) for s in starts),
            tuple(float(cap) if n > 0 else math.inf for n in norms2),
            int(sum(sizes)),
            tuple(math.sqrt(n) for n in norms2) if norm == "initial" else None,
        )

    def to_json(self) -> list[list[float]]:
        """[[start, share], ...], or [[start, share, initial norm], ...] (a checkpoint's job: a resumed fit
        caps the tensors the first fit did, as it did; JSON writes floats exactly, inf as Infinity)."""
        if self.initial is None:
            return [[s, b] for s, b in zip(self.starts, self.shares)]
        return [[s, b, n] for s, b, n in zip(self.starts, self.shares, self.initial)]

    @classmethod
    def from_json(cls, data: list[list[float]], n_params: int) -> StepCap:
        initial = tuple(float(row[2]) for row in data) if data and len(data[0]) == 3 else None
        return cls(tuple(int(row[0]) for row in data), tuple(float(row[1]) for row in data), n_params, initial)

    def bounds(self, params: Vector, upper: NDArray[np.float64]) -> NDArray[np.float64]:
        """Per tensor, share × its norm in ``params`` (the parameters as the step starts), for the tensors
        the step may take past it: ``upper`` bounds the step's norm in each; inf where it is not capped,
        its norm is 0, or its norm cannot be below upper ÷ share (then the norm is not read).

        The last norms read bound the norms now from below: a step moves a capped tensor by at most its
        share of its norm, so after s steps its norm is at least (1 − share)^s of the one read. Most steps
        are settled that way, without a pass over the parameters; the factors are the same either way
        (a settled tensor's would be 1), so replicas that read their norms at different steps agree."""
        shares = np.asarray(self.shares)
        if self.initial is not None:  # a share of the initial norm: nothing to read
            fixed = np.full(len(shares), math.inf)
            finite = np.isfinite(shares)
            fixed[finite] = shares[finite] * np.asarray(self.initial)[finite]
            return fixed
        capped = np.isfinite(shares) & (upper > 0)
        seen = self._seen
        with np.errstate(invalid="ignore", over="ignore"):
            # each step's float32 additions round by at most 2^-24 of each value: 1e-6 of the norm, per step
            lower = seen.norm * np.maximum(1.0 - np.minimum(shares, 1.0) - 1e-6, 0.0) ** seen.since
            need = capped & ~(upper <= shares * lower)
        out = np.full(len(shares), math.inf)
        if need.any():
            host = np.ascontiguousarray(to_host(params)[: self.n_params], np.float32)  # a view on the host
            norm = np.sqrt(tensor_norms2(host, np.asarray(self.starts, np.int64), need))
            seen.norm[need], seen.since[need] = norm[need], 0
            out[need] = np.where(norm[need] > 0, shares[need] * norm[need], math.inf)
        seen.since += 1  # the step is applied next
        return out

    def factors(self, updates: Sequence[StepUpdate], scale: float, params: Vector) -> NDArray[np.float64]:
        """Per tensor, min(1, bound ÷ the norm of the step's summed messages), the bounds read from
        ``params`` as the step starts."""
        starts = np.asarray(self.starts, np.int64)
        factors = np.ones(len(self.shares))
        # the triangle inequality first: Σ_r step_r·√(entries of r in the tensor) bounds the norm, and
        # usually settles it without merging the N messages by index
        upper = np.zeros(len(self.shares))
        for u in updates:
            if u.message.n_entries:
                upper += float(u.message.step(scale)) * np.sqrt(entries_per_tensor(u.message, starts))
        bounds = self.bounds(params, upper)
        if (upper <= bounds).all():
            return factors
        norm = np.sqrt(summed_norms2(updates, scale, starts, self.n_params))
        over = norm > bounds
        factors[over] = bounds[over] / norm[over]
        return factors


def entries_per_tensor(message: Message, starts: NDArray[np.int64]) -> NDArray[np.float64]:
    """How many of the message's entries fall in each tensor (``starts``: each one's first index)."""
    counts = np.zeros(len(starts))
    bounds = starts << 1  # a code is below a tensor's first code exactly when its index is
    for codes in CodeStream(message).batches():
        counts += np.diff(np.searchsorted(codes, bounds), append=codes.size)
    return counts


# Entries merged at a time over all of a step's messages, whatever the model's and the messages' size:
# each window's codes are copied out of the streams and joined (16 bytes an entry; 3 MiB with the streams'
# batches, measured with tracemalloc on two 60 %-dense 4 M messages), where a window
# of 2 M indices held ~170 MB on the relay and on each worker at a dense step of the 51.6 M MLP
# (benchmarks/worker_memory.py --threshold 1e-3).
WINDOW = 1 << 17


def summed_norms2(
    updates: Sequence[StepUpdate], scale: float, starts: NDArray[np.int64], n_params: int, window: int | None = None
) -> NDArray[np.float64]:
    """Per tensor (``starts``: each one's first index), the squared norm of the step's messages summed by
    index, in float64. Read a window of indices at a time, each message streamed in index order
    (code_stream.py), so memory stays bounded whatever the model's and the messages' size: by default each
    window ends where the first of the messages' decoded batches (WINDOW / N codes each) does, so it holds
    at most WINDOW entries; ``window`` fixes its width in indices instead. The sums are the same on every
    replica: each index adds the messages' values in rank order, each window's squares are summed in
    index order, and the windows in turn."""
    norm2 = np.zeros(len(starts))
    live = [u for u in updates if u.message.n_entries]
    per = max(1, WINDOW // max(1, len(live)))
    streams = [(CodeStream(u.message, per), float(u.message.step(scale))) for u in live]
    lo = 0
    while streams and lo < n_params:
        if window is not None:
            hi = min(lo + max(1, window), n_params)
        else:
            reach = [r for r in (stream.reach() for stream, _ in streams) if r is not None]
            if not reach:
                break
            hi = min(reach)
        _add_window(norm2, streams, hi, starts)
        lo = hi
    return norm2


def _add_window(
    norm2: NDArray[np.float64], streams: Sequence[tuple[CodeStream, float]], hi: int, starts: NDArray[np.int64]
) -> None:
    """`summed_norms2` of the codes below index ``hi`` not taken yet, added to ``norm2`` (norms.py's kernel)."""
    runs, steps = [], []
    for stream, step in streams:
        codes = stream.below(hi)
        if codes.size:
            runs.append(codes)
            steps.append(step)
    if runs:
        window_norms2(runs, steps, starts, norm2)


def apply_step(
    updates: Sequence[StepUpdate],
    state: Vector,
    scale: float = 1.0,
    cap: StepCap | None = None,
    followers: Sequence[Vector] = (),
) -> None:
    """One whole step's messages (rank order) into ``state`` (parameters, then float buffers) and into
    every follower (vectors of the parameters' size that move with them, flat.py), each tensor's share
    capped by ``cap`` (None, or no tensor over its bound: each message as `update.apply_update` adds it)."""
    if not updates:
        return
    n = updates[0].message.n_params
    targets = (state[:n], *followers)
    if cap is not None:
        factors = cap.factors(updates, scale, state[:n])
        if (factors < 1.0).any():
            _add_capped(updates, factors, cap, targets, state, scale)
            return
    for u in updates:
        for v in targets:
            apply(u.message, v, scale)
        add_buffers(u, state)


def _add_capped(
    updates: Sequence[StepUpdate],
    factors: NDArray[np.float64],
    cap: StepCap,
    targets: Sequence[Vector],
    state: Vector,
    scale: float,
) -> None:
    """Each message in rank order, a batch of its entries at a time, each entry's tensor's step
    float32(τ·scale·factor) (rounded once, on the host) added once to every target: the same float32
    additions in the same order on every replica."""
    starts = np.asarray(cap.starts, np.int64)
    for u in updates:
        steps = (float(u.message.step(scale)) * factors).astype(np.float32)
        for codes in CodeStream(u.message).batches():
            indexed: tuple[NDArray[np.uint32], NDArray[np.float32]] | None = None  # a torch target's batch
            for v in targets:
                if isinstance(v, np.ndarray):
                    add_capped(codes, starts, steps, v)
                    continue
                if indexed is None:
                    indexed = _indexed(codes, starts, steps)
                backend_of(v).add_at(v, *indexed)
        add_buffers(u, state)


def _indexed(
    codes: NDArray[np.int64], starts: NDArray[np.int64], steps: NDArray[np.float32]
) -> tuple[NDArray[np.uint32], NDArray[np.float32]]:
    """(indices, ±step of each one's tensor) of a batch of codes, for a torch target's add_at."""
    index = codes >> 1
    values = steps[np.searchsorted(starts, index, side="right") - 1]
    np.negative(values, out=values, where=(codes & 1).astype(bool))
    return index.astype(np.uint32), values


def step_applier(scale: float, cap: StepCap | None) -> Callable[[list[StepUpdate], NDArray[np.float32]], None] | None:
    """The relay's `apply_step` for a fit with ``cap`` (None without one: the relay applies message by
    message, as `apply_update`)."""
    # the relay's own copy: it remembers the norms it read of the relay's parameters
    return None if cap is None else functools.partial(apply_step, scale=scale, cap=replace(cap))


__all__ = [
    "DEFAULT_STEP_CAP",
    "StepCap",
    "apply_step",
    "entries_per_tensor",
    "step_applier",
    "step_cap_for",
    "summed_norms2",
]
