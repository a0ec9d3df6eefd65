"""gradshare vs DDP dense vs DDP+PowerSGD vs a single process, on shaped loopback links (the harness: lab/train.py).

python benchmarks/train.py --quick
"""

import sys

from lab import command, train

if __name__ == "__main__":
    sys.exit(command(train))
