"""Device-generic codec benchmark; same code and options as `gradshare bench device`.

    python benchmarks/bench_device.py --device cuda --json
"""

import argparse
import sys

from gradshare.bench import device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=device.__doc__.splitlines()[0])
    device.add_arguments(parser)
    return device.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
