"""gradshare vs DDP dense vs DDP+PowerSGD vs a single process, on shaped loopback links.

Thin wrapper: the same as `gradshare bench train [options]` (see gradshare/bench/train.py).
    PYTHONPATH=. python benchmarks/compare.py --quick
"""

import argparse
import sys

from gradshare.bench import train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    train.add_arguments(parser)
    sys.exit(train.run(parser.parse_args()))
