"""SharedTrainer with more workers: bit-identical replicas and traffic per step vs the
per-rank forwarding model of `gradshare bench scale`.

``python -m gradshare.bench.scale_train --master local[8] --workers 8`` (or ``local-cluster[4,2,1024]``)
trains the demo MLP on digits and prints one JSON line. The CPUs are oversubscribed on a small machine,
which is fine: correctness and traffic are measured here, not time.

Model (the same as bench scale's): per step the relay forwards each rank's update to the N−1 others, so
its egress is (N−1)·Σ_r w_r, w_r the update's wire bytes (payload + 2-byte meta length + meta + 58 bytes
of header and AEAD tag per datagram), plus control traffic (ACKs, STATUS pages answering heartbeats).

`gradshare bench scale` imports this module for `sealed_size` and loads no torch or pyspark, so the
trainer, the demo and Spark are imported by the functions that train.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from gradshare.config.options import Network
from gradshare.transport.protocol.crypto import TAG_BYTES
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE, HEADER_BYTES

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

META_BYTES = 40  # a worker's per-update meta (loss, τ, …) packs to about this many bytes


def sealed_size(body: float, datagram_size: int = DEFAULT_DATAGRAM_SIZE) -> tuple[float, int]:
    """(wire bytes, datagrams) of an update body of ``body`` bytes, cut into chunks that each carry a
    header and an AEAD tag."""
    per_datagram = HEADER_BYTES + TAG_BYTES
    n = max(1, math.ceil(body / (datagram_size - per_datagram)))
    return body + per_datagram * n, n


def wire_bytes(payload: float, datagram_size: int = DEFAULT_DATAGRAM_SIZE) -> tuple[float, int]:
    """(wire bytes, datagrams) of one update of ``payload`` encoder bytes and a worker's meta."""
    return sealed_size(payload + 2 + META_BYTES, datagram_size)


def train_run(spark: SparkSession, workers: int, epochs: int = 2, seed: int = 0) -> dict[str, Any]:
    """Train the demo MLP with ``workers`` workers on ``spark``; figures for the scale report."""
    from gradshare.demo import digits_split, evaluate_accuracy, mlp
    from gradshare.driver.trainer import SharedTrainer

    X_train, X_test, y_train, y_test = digits_split(seed)
    rdd = spark.sparkContext.parallelize(list(zip(X_train, (int(v) for v in y_train))), workers)
    r = SharedTrainer(
        mlp, batch_size=32, epochs=epochs, seed=seed, port=0, verbose=0, network=Network(bind="127.0.0.1")
    ).fit(rdd)
    c = r.counters
    updates = c["updates_in"]  # the relay's own counter (Counters.other)
    steps = updates / workers  # every rank sends one update per step
    payload = sum(h["payload_bytes"] for h in r.history) / max(updates, 1)
    w, _ = wire_bytes(payload)
    model = (workers - 1) * workers * w
    egress = c.bytes_out / steps
    return {
        "workers": workers,
        "master": spark.sparkContext.master,
        "steps": steps,
        "n_params": r.n_params,
        "bit_identical": len({w.param_hash for w in r.worker_reports} | {r.param_hash}) == 1,
        "distinct_executors": len({w.pid for w in r.worker_reports}),
        "accuracy": evaluate_accuracy(r.model, X_test, y_test),
        "payload_bytes_per_update": payload,
        "relay_egress_bytes_per_step": egress,
        "model_forward_bytes_per_step": model,
        "egress_over_model": egress / model,
        # what is not forwarding is control (ACKs, STATUS pages answering 20 Hz heartbeats): per second,
        # not per step, so it dominates when oversubscribed CPUs make steps slow
        "control_bytes_per_s": (c.bytes_out - model * steps) / r.seconds,
        "forwarded_datagrams_per_update": c["forwarded"] / max(updates, 1),
        # each accepted update's own datagrams, once to every other rank (the relay's count: warm-up
        # messages are larger, so the datagram count of a mean-size update under-counts)
        "model_forwarded_datagrams_per_update": (workers - 1) * c["update_datagrams"] / max(updates, 1),
        "relay_retransmits": c.retransmits,
        "seconds": r.seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--master", default="local[4]", help="Spark master, e.g. local[8], local-cluster[4,2,1024]")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args(argv)
    if args.workers < 1 or args.epochs < 1:
        raise ValueError("--workers and --epochs must be >= 1")
    from gradshare.driver.session import get_or_create_session

    spark, created = get_or_create_session(master=args.master)
    try:
        print(json.dumps(train_run(spark, args.workers, args.epochs)), flush=True)
    finally:
        if created:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
