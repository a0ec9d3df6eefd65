"""The lab: research harnesses kept out of the wheel (the lock-step harness, the training, convergence,
language-model and scaling studies, and what they share: systems, workloads, reports).

Each study runs as a script of benchmarks/ (``python benchmarks/convergence.py --quick``); those scripts
and the tests import this package with benchmarks/ on the path (a script's own folder; pyproject's
pytest ``pythonpath``). Nothing in gradshare imports it (pyproject's import contract "product-not-lab").

Imports: train and convergence read the tables of systems and workloads (SYSTEMS, LR_SCHEDULES,
WORKLOADS) to build their parser, so systems and workloads keep torch, pyspark and scikit-learn inside the
functions that run a system, and `--help` does not wait for torch; matplotlib stays lazy everywhere, as an
optional dependency that must be told its backend first.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from types import ModuleType

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder this package is in
ROOT = os.path.dirname(BENCHMARKS)  # the checkout: its gradshare comes first on an executor's path


def command(module: ModuleType, argv: Sequence[str] | None = None) -> int:
    """Run a study's command: `module`'s add_arguments(parser) and run(args), the parser described by the
    first line of its docstring."""
    parser = argparse.ArgumentParser(description=(module.__doc__ or "").splitlines()[0])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)) or 0)
