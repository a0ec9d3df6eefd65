"""Some replica tests run a benchmark's module; the benchmarks import each other as scripts do, from
their own folder, so that folder is on sys.path here (appended: nothing of the tests' own is shadowed)."""

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)
