"""`gradshare bench scale`'s model: the relay's cost terms fitted to the measured rows, and the step's
communication time they project to larger N and faster links (scale.py measures, this extrapolates)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

LINKS_GBIT = (1, 10, 25)
PROJECT_TO = (2, 4, 8, 16, 32, 64, 128, 256)


def fit_costs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Relay CPU per step ≈ a·(forwarded datagrams per step) + b·(updates per step), least squares ≥ 0.

    ``a`` is the per-datagram cost of forwarding (sendto + bookkeeping: AEAD is the origin's and the
    receiver's, not the relay's), ``b`` the per-update cost (reassembly, validation, decode + apply to the
    authoritative copy, ACK). One row gives ``a`` alone (b = 0). Aggregated rows add ``c``, the cost of
    the step's one aggregate (calibrate + encode the relay's residual, apply it, seal it), the same at
    any N."""
    y = np.array([r["relay_cpu_per_step_s"] for r in rows], float)
    if rows[0].get("forwarding") == "aggregate":
        A = np.array([[r["forwarded_datagrams_per_step"], r["peers"], 1.0] for r in rows], float)
        coef = np.linalg.lstsq(A, y, rcond=None)[0] if len(rows) >= 3 else np.array([0.0, 0.0, y.mean()])
        if (coef < 0).any():  # noise: keep the non-negative terms, refit them
            keep = coef >= 0
            coef = np.zeros(3)
            coef[keep] = np.linalg.lstsq(A[:, keep], y, rcond=None)[0].clip(0)
        return {"per_datagram_s": float(coef[0]), "per_update_s": float(coef[1]), "per_step_s": float(coef[2])}
    A = np.array([[r["forwarded_datagrams_per_step"], r["peers"]] for r in rows], float)
    if len(rows) >= 2:
        (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
        if a < 0 or b < 0:  # one term is noise: keep the other alone
            a, b = max(float(np.dot(A[:, 0], y) / np.dot(A[:, 0], A[:, 0])), 0.0), 0.0
    else:
        a, b = y[0] / max(A[0, 0], 1.0), 0.0
    return {"per_datagram_s": float(a), "per_update_s": float(b), "per_step_s": 0.0}


def project(
    rows: list[dict[str, Any]], sizes: Sequence[int] = PROJECT_TO, links: Sequence[float] = LINKS_GBIT
) -> dict[str, Any]:
    """Projected step-communication time, from the measured rows.

    Model (stated in the output): per step the relay sends E(N) = P(N)·w bytes in D(N) = P(N)·d
    datagrams, w and d the measured wire bytes and datagrams of one forwarded update (headers and tags
    included), P(N) = N·(N−1) messages per-rank or N aggregated. Its CPU needs C(N) = a·D(N) + b·N + c
    (``fit_costs``; c = 0 per-rank); its link needs 8·E(N)/B. The two overlap (the relay sends while it
    works), so a step's communication takes max(8·E/B, C). Not included: the peers' own receive cost
    (parallel across machines), propagation delay, and loss repair."""
    costs = fit_costs(rows)
    last = max(rows, key=lambda r: r["peers"])
    d = last["datagrams_per_update"]
    w = last["forwarded_bytes_per_update"]
    aggregate = last.get("forwarding") == "aggregate"
    table = []
    for n in sizes:
        pairs = n if aggregate else n * (n - 1)
        e, dg = pairs * w, pairs * d
        cpu = costs["per_datagram_s"] * dg + costs["per_update_s"] * n + costs["per_step_s"]
        row = {"peers": n, "egress_bytes": e, "datagrams": dg, "relay_cpu_s": cpu}
        for g in links:
            wire_s = 8 * e / (g * 1e9)
            row[f"{g}gbit_s"] = max(wire_s, cpu)
            row[f"{g}gbit_bound"] = "link" if wire_s >= cpu else "relay cpu"
        table.append(row)
    what = "N" if aggregate else "N(N-1)"
    model = (
        f"per step: E(N) = {what}*w bytes in D(N) = {what}*d datagrams leave the relay; "
        f"w = {w:,.0f} B and d = {d:.2f} datagrams per forwarded {'aggregate' if aggregate else 'update'} "
        f"(measured); relay CPU C(N) = a*D + b*N + c with a = {costs['per_datagram_s'] * 1e6:.2f} "
        f"us/datagram, b = {costs['per_update_s'] * 1e6:.1f} us/update and c = "
        f"{costs['per_step_s'] * 1e3:.2f} ms/step (least squares over the measured N); "
        "step communication = max(8*E/B, C) at link rate B (link and CPU overlap); peers' receive "
        "cost, propagation and loss repair excluded"
    )
    return {"model": model, "costs": costs, "bytes_per_update": w, "datagrams_per_update": d, "table": table}
