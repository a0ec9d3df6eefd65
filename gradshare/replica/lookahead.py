"""The own-update lookahead (staleness k >= 1, `Compression.lookahead`; gradshare/task/worker.py's
module docstring): the step runs at P + this rank's sent messages the log has not applied yet, and P
is put back bit for bit afterwards.

Only the touched values are saved (a few per thousand parameters), not all of P: subtracting the ±τ
again would not restore P bit for bit in float32, putting the saved values back does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradshare.encoding import SharingState
from gradshare.replica.flat import FlatParams
from gradshare.vectors import Vector, index_for, where


@dataclass(frozen=True)
class LookBack:
    """What `look_back` needs: the touched indices, P there before and after the lookahead, and the
    folded point's (None: there is no point)."""

    idx: Vector
    saved: Vector
    ahead: Vector
    saved_point: Vector | None = None
    point_ahead: Vector | None = None


def look_ahead(flat: FlatParams, state: SharingState, applied_through: int, scale: float) -> LookBack | None:
    """Add this rank's sent messages the log has not applied (through `applied_through`) to P and its
    followers (the twin the update is measured from; the folded point: P + pending + s·r, the local
    view's point), on P's device. None (and nothing done) when no own message is pending: the step runs
    at P as with k = 0."""
    pending = state.pending
    state.forget_applied(applied_through)
    if not pending:
        return None
    live, point = flat.array, flat.point
    idx = index_for(live, np.concatenate([i for _, _, i in pending]))
    saved = live[idx]
    saved_point = None if point is None else point[idx]
    for _, msg, _ in pending:  # in step order, the order the log will apply them
        flat.add(msg, scale)
    return LookBack(idx, saved, live[idx], saved_point, None if point is None else point[idx])


def look_back(flat: FlatParams, back: LookBack) -> None:
    """After the step's encode (P and its twin equal again), restore P at the touched indices. Where
    forward/backward changed a touched value in place, that change stays in P, as everywhere else. The
    folded point likewise: what the step moved it by (its update, what it sent) stays, the rest goes
    back bit for bit.

    Every vector here is of P's kind (FlatParams.device): the ignores below are mypy not seeing that
    a union-typed P, its point and the values gathered from them are one kind."""
    idx = back.idx
    now = flat.array[idx]
    # == : exact, -0.0 too
    params: Vector = where(now == back.ahead, back.saved, back.saved + (now - back.ahead))  # type: ignore[type-var,assignment]
    point: Vector | None = None
    if back.saved_point is not None and flat.point is not None:  # saved_point: there is a point
        now = flat.point[idx]
        point = where(  # type: ignore[type-var,assignment]
            now == back.point_ahead,
            back.saved_point,
            back.saved_point + (now - back.point_ahead),  # type: ignore[operator]
        )
    flat.put(idx, params, point)
