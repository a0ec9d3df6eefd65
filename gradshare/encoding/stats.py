"""Debug statistics of a residual in units of τ: how much update mass is waiting to be sent."""

from __future__ import annotations

import numpy as np
from numba import njit

from gradshare.encoding.message import to_float32_threshold

# Percentiles come from an evenly strided sample of at most this many values (exact below it): a
# full sort-based percentile of a 100 M-parameter residual would copy 400 MB for a debug number.
PERCENTILE_SAMPLE = 1 << 20
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


@njit(nogil=True, cache=True)
def _abs_summary(r, tau):
    """(sum |r| over finite values, max |r| over finite values, count |r| >= tau, count non-finite)."""
    total = 0.0
    peak = np.float32(0.0)
    above = 0
    bad = 0
    for j in range(r.size):
        a = abs(r[j])
        if a <= np.float32(3.4028234663852886e38):
            total += a
            peak = max(peak, a)
            above += a >= tau
        else:  # NaN or inf
            bad += 1
    return total, peak, above, bad


def residual_stats(residual: np.ndarray, threshold: float) -> dict[str, float]:
    """Summary of |residual| / τ.

    Keys: ``tau``, ``n_params``, ``abs_mean`` and ``abs_max`` (over finite values, in units of τ),
    ``p50``/``p90``/``p99``/``p999`` (percentiles of |r|/τ; from a strided sample of at most
    PERCENTILE_SAMPLE values when the residual is larger), ``sparsity`` (fraction with |r| >= τ: what an
    encode with no further update would send), ``nonfinite`` (count of NaN/inf values).
    """
    if not isinstance(residual, np.ndarray) or residual.dtype != np.float32 or residual.ndim != 1:
        raise TypeError("residual must be a 1-D float32 numpy.ndarray")
    tau = to_float32_threshold(threshold)
    n = residual.size
    total, peak, above, bad = _abs_summary(residual, np.float32(tau))
    finite = n - bad
    stride = max(1, -(-n // PERCENTILE_SAMPLE))
    sample = np.abs(residual[::stride].astype(np.float64)) / tau
    sample = sample[np.isfinite(sample)]
    pct = np.percentile(sample, PERCENTILES) if sample.size else np.full(len(PERCENTILES), np.nan)
    return {
        "tau": tau,
        "n_params": float(n),
        "abs_mean": float(total / finite / tau) if finite else float("nan"),
        "abs_max": float(peak) / tau if finite else float("nan"),
        "p50": float(pct[0]),
        "p90": float(pct[1]),
        "p99": float(pct[2]),
        "p999": float(pct[3]),
        "sparsity": above / n if n else 0.0,
        "nonfinite": float(bad),
    }
