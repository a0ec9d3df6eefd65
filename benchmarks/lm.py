"""A causal transformer language model: validation loss per epoch, gradshare vs DDP, N workers, seeds (the harness:
lab/lm.py).

python benchmarks/lm.py --quick
"""

import sys

from lab import command, lm

if __name__ == "__main__":
    sys.exit(command(lm))
