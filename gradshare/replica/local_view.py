"""Where a worker takes its gradient: at the shared parameters plus its own unsent residual.

The replicas hold P, which moves only by the messages of the log. A worker's residual r holds the part
of its own updates that has not crossed τ yet. Taken at P, the gradient ignores r. A direction the
worker has already pushed but not yet sent keeps the same gradient step after step, and under Adam,
whose step is about lr per entry whatever the gradient's size, r grows by about lr a step in that
direction. So does the calibrated τ, the (1 − density) quantile of r: on the 10.5 M-parameter MLP it
climbed from 4e-3 to 1.2e-2 over 12 epochs, each sent entry became a jump of 12 Adam steps, and at a
constant lr the test accuracy swung by 3-5 pp between epochs and ended 3.8 pp under DDP's
(docs/benchmarks/convergence.md).

Taken at P + s·r (s = the scale the log applies messages with: 1 under aggregate="sum", 1/N under
"mean"), the gradient sees where this worker's own updates have already taken it, as in local SGD with
error-compensated sparse synchronisation (Qsparse-local-SGD, Basu et al., NeurIPS 2019). Once that
point has moved far enough, the gradient turns, and r stops growing in that direction. τ then stays
bounded (5.5e-3 at the end of the same run), and the MLP ends 0.15 pp from DDP instead of 3.8 pp.

P itself is not touched: the forward and backward run with every parameter's storage pointed at the
matching slice of a second buffer that holds P + s·r (the aliasing of capture.py), so the replicas
still change only through the log and stay bit-identical. The cost is that buffer (4 bytes a
parameter) and one fused add over P and r per step.

Folded (`FoldedView`, the "Q-form"; the default on the direct update path under aggregate="sum"):
the worker keeps the point q = P + r INSTEAD of r (encoding/folded.py), so the view costs neither the
buffer nor the add (benchmarks/worker_memory.py, 51.6 M MLP, fused Adam: 8.0 P -> 7.0 P). The
parameters are aliased to q for the forward, the backward and the optimizer step, so the optimizer's
update lands in q (local SGD); the encode reads r as q − P and moves q by what it sends; the apply log
applies every message to q as to P (flat.py, `FlatParams.point`). What is learnt is the same up to
float32 rounding: r is held at the precision of q (~ulp(P)), as a single process's parameters hold
their updates. Where it does not apply, the two-buffer `LocalView` stays:
- the general path: L2 weight decay reads the parameter, at P there and at q here, which would change
  what is learnt (and that path's twin is a P-sized buffer of its own anyway); decoupled decay (AdamW)
  is not read by the optimizer there: the direct path adds −lr·λ·P itself (capture.py);
- a scale s != 1 (aggregate="mean"): the point must move by s·u when the optimizer's update u enters
  r, but the direct path lets the optimizer add u itself, unscaled (scaling it would take the pass
  over P that folding saves, or an lr scaled by s, which is not the same step for Adam's eps);
- worker_options={"folded_view": False}, for an A/B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import numpy as np
import torch

from gradshare.replica.capture import aliased
from gradshare.replica.flat import FlatParams
from gradshare.vectors import Vector, copy_into, is_tensor


class LocalView:
    """The point a worker's forward/backward runs at: P + scale × residual (module docstring)."""

    def __init__(self, flat: FlatParams, scale: float = 1.0) -> None:
        self.flat = flat
        self.scale = np.float32(scale)
        self.point: Vector
        if is_tensor(flat.array):
            self.point = torch.empty_like(flat.array)
        else:
            self.point = np.empty_like(flat.array)
        self.views = flat.views(self.point)

    def fill(self, residual: Vector) -> None:
        """point = P + scale × residual, in float32."""
        # P, the point and the residual are of one kind, the point's (FlatParams.device decides all three)
        p, point = self.flat.array, self.point
        if is_tensor(point):
            torch.add(cast(torch.Tensor, p), cast(torch.Tensor, residual), alpha=float(self.scale), out=point)
            return
        p, residual = cast(np.ndarray, p), cast(np.ndarray, residual)
        if self.scale == 1.0:
            np.add(p, residual, out=point)
        else:
            np.multiply(residual, self.scale, out=point)
            point += p

    @contextmanager
    def around(self, residual: Vector | None) -> Iterator[None]:
        """Run the body (forward and backward) with the parameters at P + scale × residual.

        A parameter changed in place in the body (a user's bug, seen by its version counter) changed
        the point, not P. That change is carried into P (P = point − scale × residual), so such a
        replica still leaves the log and the fit's hash check names it, as without the view."""
        if residual is None:  # a folded sharing state has no residual vector: FoldedView is its view
            raise ValueError("LocalView.around needs the residual; a folded state takes FoldedView")
        flat = self.flat
        self.fill(residual)
        versions = flat.versions()
        with aliased(flat.params, self.views):
            yield
        if flat.versions() != versions:
            if is_tensor(self.point):  # one kind, as in `fill`
                cast(torch.Tensor, flat.array).copy_(self.point - float(self.scale) * cast(torch.Tensor, residual))
            else:
                np.subtract(self.point, self.scale * cast(np.ndarray, residual), out=cast(np.ndarray, flat.array))


class FoldedView:
    """The point is the sharing state's folded point q (module docstring): nothing to fill.

    A parameter changed in place in the body outside the optimizer (a user's bug, seen by its version
    counter; `stepped` gives the version bumps of the optimizer's own steps in backward, capture.py)
    changed q. The change cannot be told apart from the residual there, so P takes that parameter's
    point whole (its unsent residual goes with it): the replica still leaves the log and the fit's hash
    check names it, as with `LocalView`."""

    def __init__(self, flat: FlatParams, point: Vector, stepped: Callable[[], list[int]] | None = None) -> None:
        self.flat, self.point = flat, point
        self.views = flat.views(point)
        self.stepped = stepped  # () -> a version bump per parameter its optimizer steps made, or None

    @contextmanager
    def around(self, residual: Vector | None = None) -> Iterator[None]:
        flat = self.flat
        versions = flat.versions()
        with aliased(flat.params, self.views):
            yield
        now = flat.versions()
        own = self.stepped() if self.stepped is not None else [0] * len(now)
        offset = 0
        for p, before, after, bumps in zip(flat.params, versions, now, own):
            n = p.numel()
            if after - bumps != before:
                copy_into(flat.array[offset : offset + n], self.point[offset : offset + n])
            offset += n


class NoView:
    """The gradient at P itself (``local_view=False``)."""

    @contextmanager
    def around(self, residual: Vector | None = None) -> Iterator[None]:
        yield
