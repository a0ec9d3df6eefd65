"""Thin script: the same as `gradshare bench transport` (see gradshare/bench/transport.py)."""

import argparse
import sys

from gradshare.bench.transport import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="relay throughput, latency, loss, crypto cost")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
