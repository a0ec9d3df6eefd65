"""`gradshare demo | bench encoding | bench device | bench transport | bench scale | relay`.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
This is the CLI's import seam: `main` imports only the module of the command it is given,
so `gradshare --help` imports no command module (no NumPy, Numba, torch or pyspark), and
`gradshare bench encoding` never imports torch or pyspark. A command module may import what its
command needs at module level, except where it is imported without its command too (gradshare/bench/__init__.py).
The research studies (training, convergence, language models, scaling) are scripts of benchmarks/, not
commands: they are not in the wheel.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

# (command path, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "gradshare.demo", "train a small MLP on digits with 2 workers on an embedded Spark"),
    (("bench", "encoding"), "gradshare.bench.encoding", "encoding overhead vs numpy.add"),
    (
        ("bench", "device"),
        "gradshare.bench.device",
        "device-generic (torch) encode vs torch add on cpu/cuda, beside the Numba path",
    ),
    (("bench", "transport"), "gradshare.bench.transport", "relay throughput, latency, loss, crypto cost"),
    (
        ("bench", "scale"),
        "gradshare.bench.scale",
        "relay egress, CPU, latency and exactly-once vs the number of peers; projected to 256",
    ),
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
    """Whether `module` exists, without importing it or its parent package (find_spec(module) would
    import gradshare.transport, which loads NumPy): its file is looked up in the parent's directories."""
    parent, _, leaf = module.rpartition(".")
    try:
        spec = importlib.util.find_spec(parent)
    except ModuleNotFoundError:  # its grandparent package is not there either
        return False
    if spec is None or spec.submodule_search_locations is None:
        return False
    return any(
        os.path.isfile(os.path.join(d, leaf + ".py")) or os.path.isfile(os.path.join(d, leaf, "__init__.py"))
        for d in spec.submodule_search_locations
    )


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command (argv None), or of the one command `argv` names: only that
    command's module is imported and adds its options (module docstring); the others are listed."""
    parser = argparse.ArgumentParser(prog="gradshare", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
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
        if argv is not None and tuple(argv[: len(path)]) != path:
            continue  # not the command being run: its help line is all the parser needs
        mod = importlib.import_module(module)
        mod.add_arguments(sub)
        sub.set_defaults(handler=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
