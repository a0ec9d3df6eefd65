"""Accuracy per epoch of gradshare vs DDP dense vs a single process; same code and options as
`gradshare bench convergence`.

    SPARK_LOCAL_IP=127.0.0.1 python benchmarks/bench_convergence.py --quick
"""

import argparse
import sys

from gradshare.bench import convergence


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=convergence.__doc__.splitlines()[0])
    convergence.add_arguments(parser)
    return convergence.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
