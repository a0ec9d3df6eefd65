"""`gradshare demo | bench encoding | bench device | bench transport | bench scale | bench train | bench convergence | relay`.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so `gradshare bench encoding` never imports
torch or pyspark.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# (command path, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "gradshare.demo", "train a small MLP on digits with 2 workers on an embedded Spark"),
    (("bench", "encoding"), "gradshare.bench.encoding", "encoding overhead vs numpy.add"),
    (("bench", "device"), "gradshare.bench.device",
     "device-generic (torch) encode vs torch add on cpu/cuda, beside the Numba path"),
    (("bench", "transport"), "gradshare.bench.transport", "relay throughput, latency, loss, crypto cost"),
    (("bench", "scale"), "gradshare.bench.scale",
     "relay egress, CPU, latency and exactly-once vs the number of peers; projected to 256"),
    (("bench", "train"), "gradshare.bench.train", "gradshare vs DDP dense vs DDP+PowerSGD vs single process"),
    (("bench", "convergence"), "gradshare.bench.convergence",
     "accuracy per epoch: gradshare vs DDP dense vs single process, N workers, LR schedules, seeds"),
    (("relay",), "gradshare.transport.relay_main", "run a standalone relay (master)"),
]


def threshold_arg(text: str) -> float | str:
    """A --threshold value: 'auto' (SharedTrainer's calibrated τ) or a positive number (τ itself)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"--threshold must be 'auto' or a positive number, got {text!r}")
    return value


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is not there either
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradshare", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in COMMANDS:
        if not _available(module):
            continue  # a command whose module is not built yet is simply not offered
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                group = top.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True, metavar="WHAT")
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(sub)
        sub.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
