"""Test accuracy per epoch of gradshare vs DDP dense vs one process, N workers, LR schedules, seeds (the harness:
lab/convergence.py).

SPARK_LOCAL_IP=127.0.0.1 python benchmarks/convergence.py --quick
"""

import sys

from lab import command, convergence

if __name__ == "__main__":
    sys.exit(command(convergence))
