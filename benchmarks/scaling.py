"""Accuracy as workers are added (N = 1 to 64), in lock step: gradshare vs its dense design vs DDP at 3 lrs (the
harness: lab/scaling.py).

python benchmarks/scaling.py --quick
"""

import sys

from lab import command, scaling

if __name__ == "__main__":
    sys.exit(command(scaling))
