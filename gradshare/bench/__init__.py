"""Command-line benchmarks (`gradshare bench ...`); scripts in benchmarks/ call these too.

Imports: the CLI imports a command's module only for that command, to run it or print its
--help (gradshare/cli.py, the import seam), so device, transport, scale, train and convergence import
what they run on at module level. Laziness stays where another module imports one of these for a
table or a helper:
- systems and workloads keep torch, pyspark and scikit-learn inside the functions that run a system:
  train and convergence read their tables (SYSTEMS, LR_SCHEDULES, WORKLOADS) to build their parser, and
  `gradshare bench train --help` should not wait for torch;
- scale_train keeps torch and pyspark inside its functions: scale imports its wire sizes (sealed_size);
- encoding keeps NumPy and Numba inside `measure`: device imports its argument types, and importing it
  must stay free of both (tests/bench/test_bench_encoding.py);
- matplotlib stays lazy everywhere, as an optional dependency that must be told its backend first.
report and profile import at module level.
"""
