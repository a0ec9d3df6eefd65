"""Command-line benchmarks (`gradshare bench ...`); scripts in benchmarks/ call these too.

Imports follow one rule, for `gradshare --help`: the CLI imports every command module (the ones
`gradshare.cli.COMMANDS` names) to build its parser, so a command module imports the standard library
and stdlib-only modules (netns) at module level, and torch, pyspark, Numba, NumPy, matplotlib and
the gradshare modules that load them inside the functions that run the benchmark. So do systems.py
and workloads.py for torch, pyspark and scikit-learn (train and convergence read their tables while
the parser is built). The other modules (report, profile, scale_train's constants) import at module
level; matplotlib stays lazy everywhere, as an optional dependency that must be told its backend first.
"""
