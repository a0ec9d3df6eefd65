"""Threshold rules (how τ evolves) and residual clipping, as small state objects (STYLE item 10).

Each rule holds its tunables first, then its state; ``.threshold`` is the τ for the next step and
``.update(n_entries, n_params)`` advances it deterministically from what the last step sent, so every
run with the same inputs sees the same τ sequence. `encode_step` is the plain function that ties a
rule, the codec and optional clipping together for one training step.

The rules follow Deeplearning4j's `FixedThresholdAlgorithm`, `AdaptiveThresholdAlgorithm` and
`TargetSparsityThresholdAlgorithm`; `ResidualClipping` follows its `ResidualClippingPostProcessor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gradshare.encoding.codec import encode
from gradshare.encoding.message import Message, to_float32_threshold

# DL4J defaults (AdaptiveThresholdAlgorithm): start at 1e-3, keep the sparsity (entries / parameters)
# inside [1e-4, 1e-2], move τ by a factor 0.5**(1/20) per step: a factor 2 in 20 steps.
DEFAULT_THRESHOLD = 1e-3
DEFAULT_MIN_SPARSITY = 1e-4
DEFAULT_MAX_SPARSITY = 1e-2
DEFAULT_DECAY = 0.5 ** (1 / 20)

# Safety bounds on an adapted τ: it must stay a positive normal float32 far from overflow, whatever
# the updates do (e.g. a model whose updates are all exactly zero would otherwise drive τ to 0).
MIN_THRESHOLD = 1e-30
MAX_THRESHOLD = 1e30


def _positive(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


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


@dataclass
class FixedThreshold:
    """τ never changes."""

    tau: float = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        self.tau = to_float32_threshold(self.tau, "tau")

    @property
    def threshold(self) -> float:
        return self.tau

    def update(self, n_entries: int, n_params: int) -> float:
        _sparsity(n_entries, n_params)
        return self.tau


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
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an int >= 1, got {self.every!r}")

    def due(self, step: int) -> bool:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return (step + 1) % self.every == 0

    def apply(self, residual: np.ndarray, threshold: float, step: int) -> bool:
        """Clip ``residual`` in place if ``step`` is due; returns whether it clipped."""
        tau = to_float32_threshold(threshold)
        if not isinstance(residual, np.ndarray) or residual.dtype != np.float32:
            raise TypeError("residual must be a float32 numpy.ndarray")
        if not self.due(step):
            return False
        bound = np.float32(min(self.clip * tau, 3.4e38))
        np.clip(residual, -bound, bound, out=residual)
        return True


def encode_step(
    residual: np.ndarray,
    update: np.ndarray | None,
    rule: FixedThreshold | AdaptiveThreshold | TargetSparsityThreshold,
    *,
    step: int | None = None,
    clipping: ResidualClipping | None = None,
    threads: int = 1,
    base: np.ndarray | None = None,
    rewind: bool = False,
) -> Message:
    """One training step's encode: encode with ``rule.threshold``, advance the rule, then clip if due.

    The message carries the τ it was encoded with; the rule's next τ applies from the next step on.
    ``step`` is required when ``clipping`` is given; ``base``: accumulate ``update - base``;
    ``rewind``: then set ``update`` to ``base`` in the same pass (see `encode`).
    """
    if clipping is not None and step is None:
        raise ValueError("step is required when clipping is given")
    message = encode(residual, update, rule.threshold, threads=threads, base=base, rewind=rewind)
    rule.update(message.n_entries, message.n_params)
    if clipping is not None:
        clipping.apply(residual, message.threshold, step)  # type: ignore[arg-type]
    return message
