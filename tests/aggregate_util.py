"""The real codec as the transport tests' payload (instead of the toy one), and the in-memory simulation
in aggregate mode: shared by the aggregate tests and the N = 32 checks."""

from __future__ import annotations

import numpy as np

from gradshare.encoding import StepUpdate, apply_update, decode_update, encode
from harness import Sim

TAUS = (0.01, 0.125, 0.5, 3e-3)


def real_update(rng: np.random.Generator, n: int, n_entries: int, buffers: int = 0) -> StepUpdate:
    """A StepUpdate of the real codec: ``n_entries`` distinct ±τ entries (and some buffer changes)."""
    tau = np.float32(rng.choice(TAUS))
    vec = np.zeros(n, np.float32)
    idx = rng.choice(n, size=min(n_entries, n), replace=False)
    vec[idx] = tau * rng.choice([-1, 1], size=idx.size).astype(np.float32)
    msg = encode(vec, None, tau)
    if not buffers:
        return StepUpdate(msg)
    b = np.unique(rng.choice(buffers, size=rng.integers(0, buffers + 1))).astype(np.uint32)
    return StepUpdate(msg, b, rng.standard_normal(b.size).astype(np.float32))


def real_payload(rng: np.random.Generator, n: int, n_entries: int) -> bytes:
    return real_update(rng, n, n_entries).to_bytes(0)


def real_apply(payload: bytes, params: np.ndarray) -> None:
    apply_update(decode_update(payload, params.size, n_params=params.size), params)


def aggregate_sim(world_size=4, n_params=3000, **kw) -> Sim:
    sim = Sim(
        world_size=world_size,
        n_params=n_params,
        forwarding="aggregate",
        decode_update=lambda p, n: decode_update(p, n, n_params=n),
        apply_update=lambda u, params: apply_update(u, params),
        **kw,
    )
    sim.make_payload = lambda n_entries: real_payload(sim.rng, sim.N, n_entries)
    sim.apply_payload = real_apply
    return sim
