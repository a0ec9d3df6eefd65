"""`gradshare relay`: run a standalone relay (master) until every rank finished, or Ctrl-C.

    gradshare relay --port 40123 --world-size 4 --n-params 8400000 --key-file job.key --job-id 7
    gradshare relay --new-key job.key ...      # create the key file (mode 0600) and use it

The key never travels over UDP: hand ``job.key`` to the workers the way the Spark job ships it.
The CLI imports this module to build its parser, which loads the transport package (its __init__) anyway:
what the relay needs is imported here at the top.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from gradshare.errors import TransportTimeout
from gradshare.transport import Relay, RelayTuning, new_job_key
from gradshare.transport.protocol.wire import DEFAULT_BIND, DEFAULT_DATAGRAM_SIZE, DEFAULT_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="UDP port to bind (0 = ephemeral; default %(default)s)"
    )
    parser.add_argument("--bind", default=DEFAULT_BIND, help="address to bind (default %(default)s)")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (Spark tasks)")
    parser.add_argument("--n-params", type=int, help="parameter count (initial parameters are zeros)")
    parser.add_argument("--params-file", help=".npy file with the initial float32 parameters")
    parser.add_argument("--key-file", help="file holding the 32-byte job key (raw or hex)")
    parser.add_argument("--new-key", metavar="PATH", help="create a new job key at PATH (mode 0600) and use it")
    parser.add_argument("--job-id", default="0", help="job id (int, or any string: it is hashed)")
    parser.add_argument("--datagram-size", type=int, default=DEFAULT_DATAGRAM_SIZE)
    parser.add_argument("--liveness-timeout", type=float, default=RelayTuning.liveness_timeout)
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="NO encryption or authentication (benchmarking only; anyone can forge updates)",
    )


def _read_key(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read().strip()
    if len(raw) == 32:
        return raw
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) != 32:
        raise SystemExit(f"gradshare relay: --key-file {path} must hold 32 raw bytes or 64 hex digits")
    return key


def _job_id(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def run(args: argparse.Namespace) -> int:
    if args.params_file:
        params = np.load(args.params_file).astype(np.float32, copy=False).reshape(-1)
    elif args.n_params:
        params = np.zeros(args.n_params, np.float32)
    else:
        raise SystemExit("gradshare relay: give --n-params or --params-file")
    if args.insecure:
        key = None
    elif args.new_key:
        key = new_job_key()
        fd = os.open(args.new_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex())
    elif args.key_file:
        key = _read_key(args.key_file)
    else:
        raise SystemExit("gradshare relay: give --key-file or --new-key (or --insecure for benchmarks)")
    relay = Relay(
        params,
        args.world_size,
        key,
        _job_id(args.job_id),
        port=args.port,
        bind=args.bind,
        datagram_size=args.datagram_size,
        insecure=args.insecure,
        tuning=RelayTuning(liveness_timeout=args.liveness_timeout),
    )
    try:
        relay.start()
    except OSError as exc:
        print(f"gradshare relay: {exc}", file=sys.stderr)
        return 1
    assert relay.address is not None  # start() set it
    print(
        f"relay listening on {relay.address[0]}:{relay.address[1]} for {args.world_size} ranks, "
        f"{params.size} parameters{' (INSECURE)' if args.insecure else ''}",
        flush=True,
    )
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while deadline is None or time.monotonic() < deadline:
            try:
                relay.wait_finished(
                    timeout=5.0 if deadline is None else max(0.0, min(5.0, deadline - time.monotonic()))
                )
                print(
                    f"all ranks ended; log complete through step {relay.complete_through}; params {relay.param_hash()}",
                    flush=True,
                )
                break
            except TransportTimeout:
                c = relay.counters()
                print(
                    f"through step {c['complete_through']}: {c['peers']} peers, {c['datagrams_in']} in, "
                    f"{c['forwarded']} forwarded, drops {c['drops']}",
                    flush=True,
                )
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()
    return 0
