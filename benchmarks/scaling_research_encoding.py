"""The encoding and optimizers of `benchmarks/scaling_research.py`, for all N workers at once: gradshare's
calibrated ±τ encode with error feedback on the [N, P] residuals (`Encoder`, one fused Numba pass per step),
torch's Adam arithmetic on [K, P] tensors (`Adam`, `fused_adam`), and Adafactor's rank-1 estimate of a
second moment (`factored`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit


@njit(nogil=True, cache=True)
def _encode_rows(r, tau, clipb, agg, scale, counts, mom, use_mom):
    """One fused pass per worker row: send ±τ where |r| >= τ (r -= ±τ, agg += scale·±τ), clip r to
    ±clipb (0: no clip), zero mom where sent (DGC's momentum factor masking) when use_mom."""
    N, P = r.shape
    for w in range(N):
        t = tau[w]
        c = clipb[w]
        st = scale * t
        n = 0
        for i in range(P):
            x = r[w, i]
            hit = False
            if x >= t:
                x -= t
                agg[i] += st
                hit = True
            elif x <= -t:
                x += t
                agg[i] -= st
                hit = True
            if hit:
                n += 1
                if use_mom:
                    mom[w, i] = 0.0
            if c > 0.0:
                if x > c:
                    x = c
                elif x < -c:
                    x = -c
            r[w, i] = x
        counts[w] = n


class Encoder:
    """Per-worker residuals [N, P] and gradshare's calibrated ±τ encode (module docstring)."""

    def __init__(
        self, N, P, device, density, warmup_steps, warmup_density, clip=5.0, every=5, exact=False, min_entries=768
    ):
        self.r = torch.zeros(N, P, device=device)
        self.P, self.density, self.ws, self.wd = P, density, warmup_steps, max(warmup_density, density)
        self.clip, self.every, self.exact = clip, every, exact
        self.floor = min(min_entries / P, 0.05)
        self.entries = 0
        self.messages = 0
        self.counts = np.zeros(N, dtype=np.int64)
        self.dummy = np.zeros((1, 1), dtype=np.float32)
        self.sched = None
        self.extra = 0.0  # bytes per worker beyond the ±τ messages (dense / factored v exchange)

    def target(self, t):
        d = max(self.density, self.floor)
        if t >= self.ws:
            return d
        start = max(self.wd, d)
        return d * (start / d) ** (1.0 - t / self.ws)

    def encode(self, t, scale, density=None, mom=None):
        """Encode every worker's residual; returns scale × the sum of the decoded messages [P]."""
        r, P = self.r, self.P
        d = self.target(t) if density is None else density
        if self.sched is not None:
            d = max(d, self.sched(t))
        if self.exact:
            k = max(1, round(d * P))
            tau = r.abs().topk(k, dim=1, sorted=False).values.min(dim=1).values
        else:
            stride = max(1, P // max(16384, math.ceil(64 / d)))
            s = r[:, (t % stride) :: stride].abs()
            m = s.shape[1]
            k = min(m, max(1, round(d * m)))
            tau = s.kthvalue(m - k + 1, dim=1).values
        tau = tau.clamp_min(1e-30).numpy().astype(np.float32)
        clipb = (self.clip * tau if self.clip and (t + 1) % self.every == 0 else np.zeros_like(tau)).astype(np.float32)
        agg = np.zeros(P, dtype=np.float32)
        _encode_rows(
            r.numpy(),
            tau,
            clipb,
            agg,
            np.float32(scale),
            self.counts,
            self.dummy if mom is None else mom.numpy(),
            mom is not None,
        )
        self.entries += int(self.counts.sum())
        self.messages += r.shape[0]
        self.last_tau = tau
        return torch.from_numpy(agg)

    def ratio(self):
        if not self.messages:
            return 1.0
        return (
            4
            * self.P
            / (
                (1.56 * self.entries + 70 * self.messages + self.extra * self.messages / self.r.shape[0])
                / self.messages
            )
        )


def fused_adam(t, lr, b2=0.999, eps=1e-8):
    """torch's fused Adam stepping tensor t in place (t += the Adam update of the grad given to step)."""
    prm = torch.nn.Parameter(t)  # shares t's storage
    return prm, torch.optim.Adam([prm], lr=lr, betas=(0.9, b2), eps=eps, fused=True)


class Adam:
    """torch.optim.Adam's arithmetic on [K, P] tensors (returns the update, does not apply it)."""

    def __init__(self, shape, device, lr, b1=0.9, b2=0.999, eps=1e-8):
        self.m = torch.zeros(shape, device=device)
        self.v = torch.zeros(shape, device=device)
        self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0

    def update(self, g):
        self.t += 1
        self.m.lerp_(g, 1 - self.b1)
        self.v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
        denom = (self.v.sqrt() / math.sqrt(1 - self.b2**self.t)).add_(self.eps)
        return self.m / denom * (-self.lr / (1 - self.b1**self.t))


def factored(v, model, rowcol=True):
    """Adafactor's rank-1 estimate of a non-negative [P] vector per weight matrix (biases kept as they
    are): what a shared second moment costs rows + cols floats per matrix to agree on."""
    out = v.clone()
    for sl, a, b in model.tensors():
        M = v[sl].view(a, b)
        if rowcol:
            R, C = M.sum(1, keepdim=True), M.sum(0, keepdim=True)
            out[sl] = (R * C / M.sum().clamp_min(1e-30)).reshape(-1)
        else:
            out[sl] = M.mean()
    return out
