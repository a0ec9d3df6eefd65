"""Benchmarks a user runs on their own machine or cluster (`gradshare bench ...`): the codec's cost on the
CPU (encoding) and on a device (device), and the relay's throughput, latency and loss (transport) and its
growth with the number of peers (scale, with scale_train's Spark check of the same traffic model). The
research studies live outside the package, in benchmarks/lab/.

Imports: the CLI imports a command's module only for that command, to run it or print its --help
(gradshare/cli.py, the import seam), so device, transport and scale import what they run on at module
level. Laziness stays where another module imports one of these for a helper:
- scale_train keeps torch and pyspark inside its functions: scale imports its wire sizes (sealed_size);
- encoding keeps NumPy and Numba inside `measure`: device imports its argument types, and importing it
  must stay free of both (tests/bench/test_bench_encoding.py);
- matplotlib stays lazy everywhere, as an optional dependency that must be told its backend first.
"""
