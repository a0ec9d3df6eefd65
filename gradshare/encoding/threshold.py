"""Threshold rules (how τ evolves) and residual clipping, as small state objects with their tunables first.

Each rule holds its tunables first, then its state; ``.threshold`` is the τ for the next step and
``.update(n_entries, n_params)`` advances it deterministically from what the last step sent, so every
run with the same inputs sees the same τ sequence. `encode_step` is the plain function that ties a
rule, the codec and optional clipping together for one training step.

The rules follow Deeplearning4j's `FixedThresholdAlgorithm`, `AdaptiveThresholdAlgorithm` and
`TargetSparsityThresholdAlgorithm`; `ResidualClipping` follows its `ResidualClippingPostProcessor`.
`CalibratedThreshold` (``threshold="auto"``) instead derives τ before every encode from a
strided sample of what is about to be encoded, as Deep Gradient Compression does (Lin et al. 2018), so
no step is silent and τ needs no hand tuning: a rule with ``calibrate`` is asked for τ before the
encode, the others only advance after it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gradshare.encoding.backend import backend_of
from gradshare.encoding.codec import encode

# MIN_THRESHOLD/MAX_THRESHOLD ("as"): re-exported, the τ bounds are named from here
from gradshare.encoding.message import MAX_THRESHOLD as MAX_THRESHOLD
from gradshare.encoding.message import MIN_THRESHOLD as MIN_THRESHOLD
from gradshare.encoding.message import Message, to_float32_threshold
from gradshare.vectors import Vector

# DL4J defaults (AdaptiveThresholdAlgorithm): start at 1e-3, keep the sparsity (entries / parameters)
# inside [1e-4, 1e-2], move τ by a factor 0.5**(1/20) per step: a factor 2 in 20 steps.
DEFAULT_THRESHOLD = 1e-3
DEFAULT_MIN_SPARSITY = 1e-4
DEFAULT_MAX_SPARSITY = 1e-2
DEFAULT_DECAY = 0.5 ** (1 / 20)

# CalibratedThreshold: the share of entries each step sends, after the warm-up. Chosen by measurement
# (docs/benchmarks/convergence.md): against 1e-3 it raised the final accuracy on 17 of 18 workload ×
# schedule × N rows (+0.3 to +2.1 pp) at 530-590x less traffic than dense instead of 700-790x.
DEFAULT_DENSITY = 2e-3
# A sample of at least SAMPLE_ENTRIES expected entries above τ (relative error of the density ~1/8)
# and never fewer than MIN_SAMPLE values: the calibration costs the same on a 10 M and a 1 B model.
SAMPLE_ENTRIES = 64
MIN_SAMPLE = 16384
# ... but never fewer than this many entries per step: a message of 768 entries (~1.2 kB) still fits
# one 1400-byte datagram, so on a small model a lower density saves no datagram, only learning (a 64 k
# CNN at 1e-3 would send 64 entries a step and learn far slower than dense, docs/benchmarks/convergence.md).
DEFAULT_MIN_ENTRIES = 768
# ... and that floor never asks for more than this share of the entries: on a 9.6 k model 768 entries
# would be 8 % (the demo's traffic fell under 50x less than dense), where 5 % keeps it above.
FLOOR_MAX_DENSITY = 0.05
# The warm-up starts at this density at most (DGC starts at 25 %). 10 % measured better than 25 % and 5 %; 7 %
# (was 10 %) keeps the benchmark MLP's 2 workers reaching 90 % in the same epoch on each of seeds 0-4 with 13 %
# fewer bytes over 16 epochs (lock step: 590x -> 669x less than dense; 6 % already cost seeds 0 and 2 an
# epoch), which brings the train study's whole-run traffic above 300x (docs/benchmarks/train.md).
DEFAULT_WARMUP_DENSITY = 0.07
# The run-long density decay of the default rule from 32 workers on (driver/policy.py): the density decays
# from 2 % of the entries to the target, and each worker's lr is lowered by (density / target) ** 0.35
# meanwhile (CalibratedThreshold's run-long decay). Why: with N workers each worker's entry waits
# ~1/density steps in its residual while a 64-worker run is only ~100 steps long. Lock step, 3 seeds,
# last-3 test accuracy (docs/design.md, "What we tried: learning at 64 workers"): tabular64k N = 64
# 81.9 -> 82.7 %, MNIST-1D MLP N = 64 70.5 -> 73.2 % (tuned DDP 85.8 / 73.0), N = 32 MNIST-1D 82.0 -> 83.2 %;
# at N = 16 it bought nothing (tabular64k 87.7 -> 87.6 %).
DEFAULT_DECAY_FROM = 0.02
DEFAULT_DECAY_LR_POWER = 0.35


# Under a decaying learning rate the density rises as (peak rate / rate) ** LR_EXPONENT, at most
# MAX_LR_BOOST times (docs/benchmarks/convergence.md, "Density follows the learning rate"): on the digits MLP with
# cosine annealing, N = 4, seeds 0-2 (lock step), the last-3 accuracy rose from 96.37 to 97.06 % (DDP 96.96)
# at 0.77x the traffic; an exponent of 1.0 gave the same accuracy at less compression, and step decay
# moved by 0.15 pp at most (same page).
LR_EXPONENT = 0.5
MAX_LR_BOOST = 4.0


def _positive(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def _int_at_least(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_decay(decay: float) -> float:
    decay = _positive("decay", decay)
    if not 0.5 <= decay < 1.0:
        raise ValueError(f"decay must be in [0.5, 1.0) (DL4J's range), got {decay!r}")
    return decay


def _sparsity(n_entries: int, n_params: int) -> float | None:
    for name, value in (("n_entries", n_entries), ("n_params", n_params)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if n_entries > n_params:
        raise ValueError(f"n_entries ({n_entries}) cannot exceed n_params ({n_params})")
    return n_entries / n_params if n_params else None  # no parameters: nothing to adapt to


def _adapt(tau: float, n_entries: int, n_params: int, low: float, high: float, decay: float) -> float:
    """τ after a step of the given sparsity: × decay below [low, high], ÷ decay above, kept inside."""
    s = _sparsity(n_entries, n_params)
    if s is None or low <= s <= high:
        return tau
    tau = tau * decay if s < low else tau / decay
    return min(max(tau, MIN_THRESHOLD), MAX_THRESHOLD)


class ThresholdRule(Protocol):
    """What `encode_step` and `SharingState` need of a τ rule: its τ for the next step, and an update
    by what a step sent (which returns the next τ). Every rule here is one."""

    @property
    def threshold(self) -> float: ...

    def update(self, n_entries: int, n_params: int) -> float: ...


class CalibratingRule(ThresholdRule, Protocol):
    """A rule that sets τ from a sample of the values about to be encoded (`CalibratedThreshold`)."""

    def stride(self, n_params: int, step: int) -> int: ...

    def calibrate(self, sample: Vector, step: int, n_params: int) -> float: ...


class _HeldThreshold:
    """A τ that what a step sends does not move (`update` only checks its arguments)."""

    tau: float

    @property
    def threshold(self) -> float:
        return self.tau

    def update(self, n_entries: int, n_params: int) -> float:
        _sparsity(n_entries, n_params)
        return self.tau


@dataclass
class FixedThreshold(_HeldThreshold):
    """τ never changes."""

    tau: float = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        self.tau = to_float32_threshold(self.tau, "tau")


class _SparsityRule:
    """τ moves by ``decay`` per step toward the sparsity band ``_band()`` (shared by the adaptive rules)."""

    tau: float
    decay: float

    def _band(self) -> tuple[float, float]:
        raise NotImplementedError

    @property
    def threshold(self) -> float:
        return self.tau

    def update(self, n_entries: int, n_params: int) -> float:
        low, high = self._band()
        self.tau = _adapt(self.tau, n_entries, n_params, low, high, self.decay)
        return self.tau


@dataclass
class AdaptiveThreshold(_SparsityRule):
    """Keep the sparsity inside [min_sparsity, max_sparsity] (DL4J `AdaptiveThresholdAlgorithm`).

    Below the band τ is multiplied by ``decay`` (more entries next step), above it divided by it,
    inside it unchanged.
    """

    initial: float = DEFAULT_THRESHOLD
    min_sparsity: float = DEFAULT_MIN_SPARSITY
    max_sparsity: float = DEFAULT_MAX_SPARSITY
    decay: float = DEFAULT_DECAY
    tau: float = field(init=False)

    def __post_init__(self) -> None:
        self.initial = to_float32_threshold(self.initial, "initial")
        self.min_sparsity = _positive("min_sparsity", self.min_sparsity)
        self.max_sparsity = _positive("max_sparsity", self.max_sparsity)
        if not self.min_sparsity <= self.max_sparsity <= 1.0:
            raise ValueError(
                f"need min_sparsity <= max_sparsity <= 1, got {self.min_sparsity!r} and {self.max_sparsity!r}"
            )
        self.decay = _check_decay(self.decay)
        self.tau = self.initial

    def _band(self) -> tuple[float, float]:
        return self.min_sparsity, self.max_sparsity


@dataclass
class TargetSparsityThreshold(_SparsityRule):
    """Steer the sparsity toward one ``target`` value (DL4J `TargetSparsityThresholdAlgorithm`).

    Every step τ moves by one factor ``decay`` toward the target: down when the step was sparser
    than the target, up when it was denser, unchanged on an exact hit.
    """

    target: float = 1e-3
    initial: float = DEFAULT_THRESHOLD
    decay: float = DEFAULT_DECAY
    tau: float = field(init=False)

    def __post_init__(self) -> None:
        self.target = _positive("target", self.target)
        if self.target > 1.0:
            raise ValueError(f"target must be a sparsity in (0, 1], got {self.target!r}")
        self.initial = to_float32_threshold(self.initial, "initial")
        self.decay = _check_decay(self.decay)
        self.tau = self.initial

    def _band(self) -> tuple[float, float]:
        return self.target, self.target


def sample_stride(n_params: int, density: float) -> int:
    """Stride of the calibration sample over ``n_params`` values for a target ``density``."""
    want = max(MIN_SAMPLE, math.ceil(SAMPLE_ENTRIES / density))
    return max(1, n_params // want)


def quantile_threshold(values: Vector, density: float) -> float | None:
    """τ such that about ``density`` of |values| are >= τ (the k-th largest, no full sort).

    When fewer than that share of values is non-zero, the smallest non-zero |value| (every non-zero
    value then crosses); None when all are zero or the array is empty (nothing to send). A torch
    tensor is searched on its device (`torch_codec.quantile_threshold`, the identical τ).
    """
    return backend_of(values).quantile_threshold(values, density)


@dataclass
class CalibratedThreshold(_HeldThreshold):
    """τ re-derived before every encode so that about ``density`` of the entries cross it (``"auto"``).

    ``calibrate(sample, step)`` takes a strided sample (`sample_stride`) of the values about to be
    encoded (residual + this step's update) and sets τ to its (1 − density) quantile: step 0 already
    sends about the target share, and no later step is silent while anything is left to send. Under
    a learning-rate schedule τ follows the residual down as the updates shrink.

    ``min_entries``: a floor on the entries per step (the density is at least min_entries / n_params,
    up to FLOOR_MAX_DENSITY).

    Warm-up (DGC): for the first ``warmup_steps`` steps the target falls geometrically from
    ``warmup_density`` to the density, so the first steps, where the model moves most, send more.

    Run-long decay (``decay_from`` > 0, ``decay_steps`` the run's planned steps; 0 until `for_run`
    fills it in, as SharedTrainer does): the target is at least
    ``density × (decay_from / density) ** (1 − step / decay_steps)``, more entries early in the run. Why:
    at 64 workers a run is ~128 steps of each worker, while an entry of average size waits ~1/density
    steps in the residual; paying for that delay early took tabular64k from 81.8 to 83.9 % in lock step
    (docs/design.md, "What we tried: learning at 64 workers"). On MNIST-1D it costs unless each worker's
    lr is lowered while the density is high (``decay_lr_power``, `lr_factor`). SharedTrainer's default
    rule turns both on from 32 workers (the planner's table, driver/policy.py).

    Learning rate (``follow_lr``, called by SharingState with each step's rate): after the warm-up the
    density is ``density × min(max_lr_boost, (peak rate / rate) ** lr_exponent)``. Why: as the rate
    anneals, τ falls with the residual, and the noise that the ±τ steps at the peak rate committed to
    the model is corrected only where a later entry crosses τ; at the same 0.2 % of the entries a step
    too few entries are left to do it (docs/research/convergence.md). A warm-up of the
    rate itself (rising) leaves the factor at 1.
    """

    density: float = DEFAULT_DENSITY
    warmup_steps: int = 0
    warmup_density: float = DEFAULT_WARMUP_DENSITY  # raised to the density when that is higher
    min_entries: int = DEFAULT_MIN_ENTRIES
    decay_from: float = 0.0  # 0: no run-long decay (class docstring)
    decay_steps: int = 0
    decay_lr_power: float = 0.0  # each worker's lr × (density / target) ** this during the decay
    lr_exponent: float = LR_EXPONENT  # 0: the density does not follow the learning rate
    max_lr_boost: float = MAX_LR_BOOST
    tau: float = field(default=DEFAULT_THRESHOLD, init=False)  # until the first calibration
    lr_peak: float = field(default=0.0, init=False)  # the highest rate seen (0: none yet)
    lr_boost: float = field(default=1.0, init=False)  # the density's factor at the current rate

    def __post_init__(self) -> None:
        self.density = _positive("density", self.density)
        if self.density > 1.0:
            raise ValueError(f"density must be a share of entries in (0, 1], got {self.density!r}")
        self.warmup_steps = _int_at_least("warmup_steps", self.warmup_steps, 0)
        self.warmup_density = _positive("warmup_density", self.warmup_density)
        if self.warmup_density > 1.0:
            raise ValueError(f"warmup_density must be a share of entries in (0, 1], got {self.warmup_density!r}")
        self.min_entries = _int_at_least("min_entries", self.min_entries, 0)
        self.decay_steps = _int_at_least("decay_steps", self.decay_steps, 0)
        if not (math.isfinite(self.decay_from) and 0.0 <= self.decay_from <= 1.0):
            raise ValueError(f"decay_from must be 0 (off) or a share of entries in (0, 1], got {self.decay_from!r}")
        if not (math.isfinite(self.decay_lr_power) and self.decay_lr_power >= 0.0):
            raise ValueError(f"decay_lr_power must be finite and >= 0, got {self.decay_lr_power!r}")
        if not (math.isfinite(self.lr_exponent) and self.lr_exponent >= 0.0):
            raise ValueError(f"lr_exponent must be finite and >= 0, got {self.lr_exponent!r}")
        if not (math.isfinite(self.max_lr_boost) and self.max_lr_boost >= 1.0):
            raise ValueError(f"max_lr_boost must be finite and >= 1, got {self.max_lr_boost!r}")

    def for_run(self, steps: int) -> CalibratedThreshold:
        """A copy whose run-long decay spans ``steps`` (the run's planned steps) where it was left at 0."""
        rule = copy.deepcopy(self)
        if rule.decay_from > 0.0 and rule.decay_steps == 0:
            rule.decay_steps = _int_at_least("steps", steps, 1)
        return rule

    def follow_lr(self, lr: float) -> None:
        """The coming step's learning rate (> 0): sets the density's factor (class docstring)."""
        if not (math.isfinite(lr) and lr > 0.0):
            raise ValueError(f"learning rate must be finite and > 0, got {lr!r}")
        self.lr_peak = max(self.lr_peak, lr)
        self.lr_boost = min(self.max_lr_boost, (self.lr_peak / lr) ** self.lr_exponent)

    def target(self, step: int, n_params: int) -> float:
        """The share of entries step ``step`` aims to send (the warm-up ramp, then the density times the
        learning rate's factor; at least the run-long decay's, when on)."""
        floor = min(self.min_entries / max(n_params, 1), FLOOR_MAX_DENSITY)
        density = min(1.0, max(self.density * self.lr_boost, floor))
        target = density
        if step < self.warmup_steps:
            start = max(self.warmup_density, density)
            ramp: float = (start / density) ** (1.0 - step / self.warmup_steps)  # float ** float: typed Any
            target = density * ramp
        if self.decay_from > 0.0 and self.decay_steps == 0:
            raise ValueError(
                "decay_from needs decay_steps, the run's planned steps (epochs × steps per epoch); "
                "SharedTrainer fills it in (for_run), a rule used on its own must be given it"
            )
        if self.decay_from > 0.0 and step < self.decay_steps:
            decay: float = (max(self.decay_from, density) / density) ** (1.0 - step / self.decay_steps)
            target = max(target, density * decay)
        return target

    def lr_factor(self, step: int, n_params: int) -> float:
        """What each worker's own optimizer lr is multiplied by at step ``step``: (density / target) **
        decay_lr_power while the run-long decay holds the target above the density, else 1. Why: more
        entries early pass more of the N workers' summed steps through; a smaller step per worker keeps
        what gets through about constant (MNIST-1D at 64 workers: 54.7 % with the decay alone, 73.2 with
        power 0.35; docs/design.md, "What we tried: learning at 64 workers")."""
        if self.decay_lr_power == 0.0 or self.decay_from == 0.0 or step >= self.decay_steps:
            return 1.0
        floor = min(self.min_entries / max(n_params, 1), FLOOR_MAX_DENSITY)
        base = min(1.0, max(self.density, floor))
        factor: float = (base / self.target(step, n_params)) ** self.decay_lr_power  # float ** float: typed Any
        return min(1.0, factor)

    def stride(self, n_params: int, step: int) -> int:
        return sample_stride(n_params, self.target(step, n_params))

    def calibrate(self, sample: Vector, step: int, n_params: int) -> float:
        """Set τ from ``sample`` (of ``n_params`` values) for step ``step``; keeps the last τ when the
        sample is all zero."""
        tau = quantile_threshold(sample, self.target(step, n_params))
        if tau is not None:
            self.tau = to_float32_threshold(tau, "calibrated threshold")
        return self.tau


@dataclass
class ResidualClipping:
    """Every ``every`` steps clip the residual to ±clip·τ (DL4J `ResidualClippingPostProcessor`).

    A residual entry far beyond τ can only drain one τ per step; clipping bounds that backlog (stale
    update mass) so it cannot dominate later steps. Runs on steps where (step + 1) % every == 0, i.e.
    after every ``every``-th step counted from step 0.
    """

    clip: float = 5.0
    every: int = 5

    def __post_init__(self) -> None:
        self.clip = _positive("clip", self.clip)
        self.every = _int_at_least("every", self.every, 1)

    def due(self, step: int) -> bool:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return (step + 1) % self.every == 0

    def bound(self, threshold: float) -> np.float32:
        """The clip bound for a message of this τ: float32(clip·τ), kept finite."""
        return np.float32(min(self.clip * to_float32_threshold(threshold), 3.4e38))

    def apply(self, residual: Vector, threshold: float, step: int) -> bool:
        """Clip ``residual`` (a float32 NumPy array, or a float32 torch tensor on any device) in place
        if ``step`` is due; returns whether it clipped."""
        tau = to_float32_threshold(threshold)
        backend = backend_of(residual)
        checked = backend.check_residual(residual)
        if not self.due(step):
            return False
        backend.clip(checked, self.bound(tau))
        return True


def encode_step(
    residual: Vector,
    update: Vector | None,
    rule: ThresholdRule,
    *,
    step: int | None = None,
    clipping: ResidualClipping | None = None,
    threads: int = 1,
    base: Vector | None = None,
    rewind: bool = False,
    tau: float | None = None,
) -> Message:
    """One training step's encode: encode with ``rule.threshold``, advance the rule, then clip if due.

    The message carries the τ it was encoded with; the rule's next τ applies from the next step on.
    ``step`` is required when ``clipping`` is given; ``base``: accumulate ``update - base``;
    ``rewind``: then set ``update`` to ``base`` in the same pass (see `encode`); ``tau``: encode with
    this τ instead of ``rule.threshold`` (a calibrated or learning-rate-scaled τ, see `SharingState`);
    the rule still advances by what was sent.
    """
    if clipping is not None and step is None:
        raise ValueError("step is required when clipping is given")
    tau = rule.threshold if tau is None else tau
    message = encode(residual, update, tau, threads=threads, base=base, rewind=rewind)
    rule.update(message.n_entries, message.n_params)
    if clipping is not None:
        clipping.apply(residual, message.threshold, step)  # type: ignore[arg-type]
    return message
