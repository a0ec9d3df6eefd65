"""Thin script: the same as `gradshare bench scale` (see gradshare/bench/scale.py)."""

import argparse
import sys

from gradshare.bench.scale import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="relay egress, CPU, latency and exactly-once vs peers")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
