"""`FitResult.plot`: one PNG of a fit, per epoch.

Three panels: training loss; the validation metric (or a note that the fit had no validation data);
traffic, the UDP bytes the workers sent and received against what dense float32 sharing would have
moved in the same steps (log scale: the point of the design is the distance between those lines).
matplotlib is optional (`pip install 'gradshare[plot]'`); the figure is drawn on matplotlib's Agg
canvas directly, never through pyplot, so plotting touches no global backend or figure state and is
safe from any thread.
"""

from __future__ import annotations

import os
from typing import Any, Protocol


class Fit(Protocol):
    """What the figure reads of a FitResult (result.py imports this module: no import back)."""

    @property
    def history(self) -> list[dict[str, Any]]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def n_params(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def seconds(self) -> float: ...


def plot_result(result: Fit, path: str | os.PathLike[str]) -> str:
    """Write the figure of `result` (a FitResult) to `path`; the format follows the suffix (.png, .svg,
    .pdf, ...; PNG when there is none). Returns the path written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("FitResult.plot needs matplotlib: pip install 'gradshare[plot]'") from e
    rows = sorted(result.history, key=lambda row: row["epoch"])
    if not rows:
        raise ValueError("FitResult.plot: the result has no history rows (no epoch was recorded), nothing to plot")
    path = os.fspath(path)
    epochs = [row["epoch"] for row in rows]

    fig = Figure(figsize=(13, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, val_ax, traffic_ax = fig.subplots(1, 3)

    loss_name = rows[-1].get("loss_fn") or "loss"
    loss_ax.plot(epochs, [row["loss"] for row in rows], marker="o")
    loss_ax.set(title=f"training loss ({loss_name})", xlabel="epoch", ylabel="mean over the epoch's steps")

    scored = [(row["epoch"], row["val_metric"]) for row in rows if row.get("val_metric") is not None]
    if scored:
        val_ax.plot(*zip(*scored), marker="o", color="tab:green")
        val_ax.set(title="validation metric", xlabel="epoch", ylabel="after the epoch")
    else:
        val_ax.set(title="validation metric", xlabel="epoch", xticks=[], yticks=[])
        val_ax.text(0.5, 0.5, "no validation data", ha="center", va="center", transform=val_ax.transAxes)

    mb = 1e6
    # dense float32 sharing: every worker sends 4·N bytes a step and receives the other workers' 4·N
    # each (FitResult.dense_bytes, per epoch); a row's steps are summed over the workers
    dense = [4 * result.n_params * row["steps"] * result.world_size / mb for row in rows]
    traffic_ax.plot(epochs, [row["bytes_sent"] / mb for row in rows], marker="o", label="sent")
    traffic_ax.plot(epochs, [row["bytes_received"] / mb for row in rows], marker="o", label="received")
    traffic_ax.plot(epochs, dense, linestyle="--", color="gray", label="dense float32")
    if all(v > 0 for row in rows for v in (row["bytes_sent"], row["bytes_received"])):
        traffic_ax.set_yscale("log")
    traffic_ax.set(title="traffic, all workers (UDP)", xlabel="epoch", ylabel="MB per epoch")
    traffic_ax.legend()

    if len(epochs) < 12:  # whole epochs on the axis, not 0.5 steps
        for ax in (loss_ax, traffic_ax) + ((val_ax,) if scored else ()):
            ax.set_xticks(epochs)
    fig.suptitle(
        f"gradshare: {result.world_size} workers, {result.n_params:,} parameters, "
        f"{result.steps} steps, {result.seconds:.1f} s"
    )
    fig.savefig(path, format=None if os.path.splitext(path)[1] else "png", dpi=100)
    return path
