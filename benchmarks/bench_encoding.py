"""Encoding overhead benchmark; same code and options as `gradshare bench encoding`.

    python benchmarks/bench_encoding.py --params 100000000 --json
"""

import argparse
import sys

from gradshare.bench import encoding


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=encoding.__doc__.splitlines()[0])
    encoding.add_arguments(parser)
    return encoding.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
