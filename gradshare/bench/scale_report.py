"""`gradshare bench scale`'s output: the table row by row as the runs end, the heartbeat and projection
tables after them, and the figure (scale.py measures; this module only shows)."""

from __future__ import annotations

from typing import Any

from gradshare.bench.scale_model import LINKS_GBIT


def print_row(r: dict[str, Any], header: bool, params: int, density: float, message_bytes: float) -> None:
    """One run's row of the table (with the table's head before the first)."""
    if header:
        print(
            f"scale ({r['forwarding']} forwarding): {params:,} params, density {density:g}, "
            f"{message_bytes:,.0f} B/update on the wire"
        )
        print(
            f"{'N':>4}{'steps':>7}{'egress MB/step':>16}{'model MB':>10}{'dgrams/step':>13}"
            f"{'relay CPU ms/step':>19}{'p50 ms':>9}{'p99 ms':>9}{'retx':>7}{'exactly once':>14}"
            f"{'offload':>9}"
        )
    p50 = "-" if r["latency_p50_ms"] is None else f"{r['latency_p50_ms']:.1f}"
    p99 = "-" if r["latency_p99_ms"] is None else f"{r['latency_p99_ms']:.1f}"
    print(
        f"{r['peers']:>4}{r['steps']:>7.0f}{r['egress_bytes_per_step'] / 1e6:>16.3f}"
        f"{r['model_egress_bytes_per_step'] / 1e6:>10.3f}{r['egress_datagrams_per_step']:>13,.0f}"
        f"{r['relay_cpu_per_step_s'] * 1e3:>19.2f}{p50:>9}{p99:>9}"
        f"{r['relay_retransmits'] + r['peer_retransmits']:>7}{str(r['exactly_once']):>14}"
        f"{'on' if r['offload'] else 'off':>9}",
        flush=True,
    )


def print_tail(heartbeats: list[dict[str, Any]], projection: dict[str, Any], forwarding: str) -> None:
    """The heartbeat table and the projected step communication, after the runs."""
    print("\nheartbeat traffic at the relay, idle job (protocol cores, simulated 1 s):")
    print(
        f"{'N':>5}{'in dgrams/s':>13}{'out dgrams/s':>14}{'out kB/s':>10}{'out B/s per peer':>18}{'relay CPU ms/s':>16}"
    )
    for h in heartbeats:
        print(
            f"{h['peers']:>5}{h['in_datagrams_per_s']:>13,.0f}{h['out_datagrams_per_s']:>14,.0f}"
            f"{h['out_bytes_per_s'] / 1e3:>10.1f}{h['out_bytes_per_peer_per_s']:>18,.0f}"
            f"{h['relay_cpu_per_s'] * 1e3:>16.2f}"
        )
    print(f"\nprojected step communication, {forwarding} forwarding:")
    print("model: " + projection["model"])
    heads = "".join(f"{f'{g} Gbit/s ms':>16}" for g in LINKS_GBIT)
    print(f"{'N':>5}{'egress MB':>12}{'relay CPU ms':>14}{heads}")
    for row in projection["table"]:
        cells = "".join(
            f"{row[f'{g}gbit_s'] * 1e3:>11.1f} {'L' if row[f'{g}gbit_bound'] == 'link' else 'C':>4}" for g in LINKS_GBIT
        )
        print(f"{row['peers']:>5}{row['egress_bytes'] / 1e6:>12.2f}{row['relay_cpu_s'] * 1e3:>14.1f}{cells}")
    print("(L: the link bounds the step; C: the relay's CPU does)")


def plot(out: dict[str, Any], path: str) -> None:
    """Egress and relay CPU per step, measured against the model, and the projection over links, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, proj = out["runs"], out["projection"]["table"]
    n = [r["peers"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].loglog(n, [r["egress_bytes_per_step"] / 1e6 for r in rows], "o-", label="measured")
    what = "N·w" if out["forwarding"] == "aggregate" else "N(N-1)·w"
    ax[0].loglog([p["peers"] for p in proj], [p["egress_bytes"] / 1e6 for p in proj], "--", label=f"{what} (model)")
    if out["forwarding"] == "aggregate":
        ax[0].loglog(n, [r["target_egress_bytes_per_step"] / 1e6 for r in rows], ":", label="target 2·N·m")
    ax[0].set(xlabel="peers N", ylabel="relay egress per step (MB)", title="egress per step")
    ax[1].loglog(n, [r["relay_cpu_per_step_s"] * 1e3 for r in rows], "o-", label="measured")
    ax[1].loglog([p["peers"] for p in proj], [p["relay_cpu_s"] * 1e3 for p in proj], "--", label="a·D + b·N + c")
    ax[1].set(xlabel="peers N", ylabel="relay thread CPU per step (ms)", title="relay CPU per step")
    ax[2].loglog([p["peers"] for p in proj], [p["relay_cpu_s"] * 1e3 for p in proj], "k-", lw=2, label="relay CPU C")
    for g in LINKS_GBIT:  # the link alone, dashed: a step takes the larger of it and C
        ax[2].loglog(
            [p["peers"] for p in proj],
            [8 * p["egress_bytes"] / (g * 1e9) * 1e3 for p in proj],
            "--",
            label=f"link 8E/B, {g} Gbit/s",
        )
    ax[2].set(xlabel="peers N", ylabel="ms per step", title="projected: max(link, relay CPU)")
    for a in ax:
        a.legend()
        a.grid(True, which="both", alpha=0.3)
    fig.suptitle(
        f"gradshare bench scale: {out['params']:,} params, density {out['density']:g}, {out['forwarding']} forwarding"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["plot", "print_row", "print_tail"]
