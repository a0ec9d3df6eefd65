"""`gradshare bench scale`: how the relay's traffic and CPU grow with the number of peers.

For each N in ``--peers`` a real :class:`~gradshare.transport.Relay` (a thread of this process, as in the
driver) serves N real :class:`~gradshare.transport.Peer` objects spread over ``--procs`` processes
(several peers per process: 64 processes would only measure the scheduler of a 2-core machine). Every
rank sends a synthetic encoded update each step (real codec bytes at ``--density``), sealed with the job
key, over loopback; steps are synchronous (staleness 0: a rank sends step t once its log is complete
through t-1), so a step's traffic is the burst a training step makes. Peers only receive: applying 10 M
parameters in 64 replicas would measure memory bandwidth, not the transport; the relay applies the log to
its own copy as in training. Per N it reports

- relay egress bytes and datagrams per step (``bytes_out`` of the relay, control traffic included),
  beside the per-rank forwarding model N·(N−1)·m;
- relay CPU per step: CPU time of the relay thread alone (``pthread_getcpuclockid``), so the peers'
  load on the same cores does not count;
- update latency p50/p99: a rank's send → the moment every other peer has received it (the time its
  peer's receiver thread completed it: ``Update.arrived``; the host loop that serves several peers
  would add its own round time);
- exactly-once: every peer received every rank's every step (through that rank's last step) exactly once.

Heartbeat traffic vs N (up to 256: STATUS pages) is measured on the protocol cores over an in-memory link
with a simulated clock (the cores called directly; heartbeat.py), and a projected step-communication table at 1/10/25
Gbit/s for N up to 256 is fitted from the measured costs (the model is printed and stored with the table).

``--forwarding per-rank`` (the relay forwards each rank's datagrams to every other rank) or
``aggregate`` (the relay adds a step's N messages into its own residual and sends one
re-encoded message, at ``--density``, to every rank; encoding/aggregate.py). In aggregate mode the
peers receive one message per step, origin AGGREGATE_ORIGIN; exactly-once is checked per step, and a
rank's update latency is its send → the moment every peer has the step's aggregate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np

from gradshare.bench.heartbeat import heartbeat_traffic
from gradshare.bench.scale_model import project
from gradshare.bench.scale_report import plot, print_row, print_tail
from gradshare.bench.scale_train import sealed_size
from gradshare.encoding import CalibratedThreshold, encode
from gradshare.encoding.aggregate import AggregateState
from gradshare.transport import Peer, Relay, RelayTuning, Update, new_job_key
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN
from gradshare.transport.protocol.relay.core import default_apply_update, default_decode_update
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE, encode_update_body
from gradshare.transport.sockets import udp

FORWARDING_MODES = ("per-rank", "aggregate")
OFFLOAD_CHOICES = ("on", "off", "both")
HEARTBEAT_PEERS = (2, 8, 32, 128, 256)


def peer_counts(text: str) -> list[int]:
    """``--peers`` value: comma-separated ints >= 2, e.g. ``2,4,8``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--peers must be comma-separated integers (got {text!r})") from None
    if not values or any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"--peers needs at least one count, each >= 2 (got {text!r})")
    return values


def default_procs() -> int:
    """One peer process per CPU but one: the relay's thread keeps a core, as a driver does whose peers
    run on other machines. With as many busy peer processes as cores the relay waits for a core behind
    the load generators, and its latency measures the scheduler (2 cores, N = 32, 150 steps, three runs
    each: p50 14.2/14.2/15.3 ms with 2 peer processes, 11.8/12.8/15.0 ms with 1)."""
    return max(1, (os.cpu_count() or 2) - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peers",
        type=peer_counts,
        default=[2, 4, 8, 16, 32, 64],
        help="comma-separated peer counts (default 2,4,8,16,32,64)",
    )
    parser.add_argument("--params", type=int, default=10_000_000, help="parameter count")
    parser.add_argument("--density", type=float, default=1e-3, help="fraction of entries per update")
    parser.add_argument(
        "--forwarding",
        choices=FORWARDING_MODES,
        default="per-rank",
        help="relay forwarding mode: per-rank, or aggregate",
    )
    parser.add_argument("--steps", type=int, default=30, help="at most this many steps per peer count")
    parser.add_argument(
        "--seconds",
        type=float,
        default=12.0,
        help="at most this long sending steps per peer count (at least 2 steps are run)",
    )
    parser.add_argument(
        "--procs",
        type=int,
        default=default_procs(),
        help="peer processes (peers are spread over them; default: one per CPU but one, %(default)s here)",
    )
    parser.add_argument("--datagram-size", type=int, default=DEFAULT_DATAGRAM_SIZE)
    parser.add_argument(
        "--aggregate-datagram-size",
        type=int,
        default=None,
        help="datagram size of the relay's aggregates (its snapshot_datagram_size; default "
        "--datagram-size; 65000 is what SharedTrainer uses on loopback)",
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOAD_CHOICES,
        default="on",
        help="UDP segmentation offload (GSO sends, GRO reads; udp.py) in the relay and the "
        "peers: on, off, or both (each N runs off, then on: the baseline in the same run)",
    )
    parser.add_argument(
        "--heartbeat-peers",
        type=peer_counts,
        default=list(HEARTBEAT_PEERS),
        help="peer counts for the heartbeat-traffic measurement (protocol cores)",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    parser.add_argument("--png", metavar="PATH", help="write a plot to PATH")


# --- peers (child process) ---------------------------------------------------------------------------


def _host_main(cfg: dict[str, Any], ranks: list[int], barrier: Barrier, results: mp.Queue[dict[str, Any]]) -> None:
    """Several ranks in one process: join, then synchronous steps; records deliveries for the parent."""
    W, messages, timeout = cfg["peers"], cfg["messages"], cfg["timeout"]
    aggregate = cfg["forwarding"] == "aggregate"
    senders = [AGGREGATE_ORIGIN] if aggregate else list(range(W))
    out: dict[str, Any] = {"ranks": ranks, "error": None}
    peers: list[Peer] = []
    udp.OFFLOAD = udp.OFFLOAD and cfg["offload"]
    try:
        for r in ranks:
            peers.append(
                Peer(
                    tuple(cfg["address"]),
                    r,
                    W,
                    0,
                    cfg["key"],
                    1,
                    cfg["params"],
                    datagram_size=cfg["datagram_size"],
                    timeout=timeout,
                )
            )
        for p in peers:
            p.join(timeout)
        send_t: dict[tuple[int, int], float] = {}
        delivered: dict[tuple[int, int], float] = {}  # (step, sender) -> when the last local receiver got it
        counts: dict[int, Counter[tuple[int, int]]] = {p.rank: Counter() for p in peers}

        def record(p: Peer, updates: list[Update]) -> bool:
            for u in updates:
                counts[p.rank][(u.step, u.sender)] += 1
                if u.sender != p.rank:
                    # stamped by the peer's receiver thread when the update came in: this loop serves
                    # many peers in turn, so the time it gets round to one is not the peer's
                    key = (u.step, u.sender)
                    delivered[key] = max(delivered.get(key, 0.0), u.arrived)
            return bool(updates)

        barrier.wait(timeout)  # every rank joined ...
        barrier.wait(timeout)  # ... and the parent took its "before" counters
        deadline = time.monotonic() + cfg["seconds"]
        t = 0
        while t < cfg["steps"] and (t < 2 or time.monotonic() < deadline):
            for p in peers:
                send_t[(t, p.rank)] = time.monotonic()
                p.send_update(t, messages[(t * W + p.rank) % len(messages)])
            # poll every local peer (not one blocking receive after another): each delivery is stamped
            # when it happens, not when the loop comes round to its receiver
            waiting, give_up = list(peers), time.monotonic() + timeout
            while waiting:
                moved = False
                for p in waiting:
                    moved |= record(p, p.receive())
                waiting = [p for p in waiting if p.complete_through < t]
                if waiting and not moved:
                    if time.monotonic() > give_up:
                        raise TimeoutError(
                            f"ranks {[p.rank for p in waiting]}: step {t} incomplete after {timeout:g} s"
                        )
                    waiting[0].wait(0.002)
            t += 1
        for p in peers:
            p.finish(t - 1)
        for p in peers:
            record(p, p.receive(until_step=1 << 31, timeout=timeout))
        # exactly-once, checked here (shipping every (step, sender, receiver) would be millions of tuples):
        # per receiver and sender (aggregated: the relay's one sender), the steps received must be
        # 0..last with no repeats
        received_through: dict[int, list[int]] = {}
        duplicates = gaps = 0
        for r, c in counts.items():
            through = [-1] * len(senders)
            for i, s in enumerate(senders):
                steps = sorted(step for (step, sender) in c if sender == s)
                through[i] = steps[-1] if steps else -1
                gaps += len(steps) != through[i] + 1
            duplicates += sum(v - 1 for v in c.values())
            received_through[r] = through
        counters: list[dict[str, Any]] = [p.counters() for p in peers]
        out.update(
            send_t=send_t,
            delivered=delivered,
            last_step=t - 1,
            received_through=received_through,
            duplicates=duplicates,
            gaps=gaps,
            retransmits=sum(c.get("retransmits", 0) for c in counters),
        )
    except BaseException as exc:  # reported to the parent
        out["error"] = f"ranks {ranks[0]}..{ranks[-1]}: {exc!r}"
        barrier.abort()
    finally:
        for p in peers:
            p.close()
        results.put(out)


def _thread_cpu(name: str) -> float:
    """CPU seconds used so far by this process's thread called ``name`` (the relay's I/O thread)."""
    for th in threading.enumerate():
        if th.name == name and th.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(th.ident))
    raise RuntimeError(f"no thread named {name!r} (did the relay start?)")


# --- one peer count -----------------------------------------------------------------------------------


def run_one(n_peers: int, args: argparse.Namespace, messages: list[bytes], offload: bool = True) -> dict[str, Any]:
    """Run ``n_peers`` ranks through the relay; the measured figures of one row of the table. ``offload``:
    whether the relay's and the peers' sockets use UDP segmentation offload where the system has it."""
    saved = udp.OFFLOAD
    udp.OFFLOAD = saved and offload  # for the relay's socket, opened below
    try:
        return _run_one(n_peers, args, messages, offload=udp.OFFLOAD)
    finally:
        udp.OFFLOAD = saved


def _run_one(n_peers: int, args: argparse.Namespace, messages: list[bytes], offload: bool) -> dict[str, Any]:
    aggregate = args.forwarding == "aggregate"
    outs, c0, c1, relay_cpu = _exchange(n_peers, args, messages, offload, aggregate)
    return _row(n_peers, args, messages, offload, aggregate, outs, c0, c1, relay_cpu)


def _exchange(
    n_peers: int, args: argparse.Namespace, messages: list[bytes], offload: bool, aggregate: bool
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], float]:
    """The relay here, the ranks in child processes, synchronous steps: (each process's report, the
    relay's counters once every rank joined and at the end, the relay thread's CPU seconds between)."""
    ctx = mp.get_context("spawn")
    key = new_job_key()
    # the aggregate is encoded at the ranks' density: one message of about one rank's size per step
    aggregator = (
        AggregateState(args.params, rule=CalibratedThreshold(density=args.density, min_entries=0))
        if aggregate
        else None
    )
    relay = Relay(
        np.zeros(args.params, np.float32),
        n_peers,
        key,
        1,
        port=0,
        bind="127.0.0.1",
        datagram_size=args.datagram_size,
        aggregator=aggregator,
        tuning=RelayTuning(forwarding=args.forwarding, snapshot_datagram_size=args.aggregate_datagram_size),
    ).start()
    procs = []
    try:
        n_procs = max(1, min(args.procs, n_peers))
        groups = [list(range(n_peers))[i::n_procs] for i in range(n_procs)]
        timeout = 120.0
        assert relay.address is not None  # started above
        cfg = dict(
            address=relay.address,
            peers=n_peers,
            params=args.params,
            key=key,
            messages=messages,
            forwarding=args.forwarding,
            offload=offload,
            steps=args.steps,
            seconds=args.seconds,
            datagram_size=args.datagram_size,
            timeout=timeout,
        )
        barrier = ctx.Barrier(n_procs + 1)  # + this process: counters start once every rank joined
        results: mp.Queue[dict[str, Any]] = ctx.Queue()
        procs = [ctx.Process(target=_host_main, args=(cfg, g, barrier, results), daemon=True) for g in groups]
        for p in procs:
            p.start()
        thread = f"gradshare-relay-{relay.address[1]}"
        c0: dict[str, Any]
        try:
            barrier.wait(timeout + 60)
            c0, cpu0 = relay.counters(), _thread_cpu(thread)
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            c0, cpu0 = relay.counters(), 0.0  # a child failed: its error comes through results
        outs = [results.get(timeout=timeout + 10 * args.seconds + 60) for _ in procs]
        errors = [o["error"] for o in outs if o["error"]]
        if errors:
            raise RuntimeError(f"{n_peers} peers: " + "; ".join(errors))
        relay.wait_finished(60)
        c1: dict[str, Any] = relay.counters()
        cpu1 = _thread_cpu(thread)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        relay.close()
    return outs, c0, c1, cpu1 - cpu0


def _row(
    n_peers: int,
    args: argparse.Namespace,
    messages: list[bytes],
    offload: bool,
    aggregate: bool,
    outs: list[dict[str, Any]],
    c0: dict[str, Any],
    c1: dict[str, Any],
    relay_cpu: float,
) -> dict[str, Any]:
    """One row of the table from the processes' reports and the relay's counters (`_exchange`)."""
    last: dict[int, int] = {}
    send_t: dict[tuple[int, int], float] = {}
    delivered: dict[tuple[int, int], float] = {}
    for o in outs:
        last.update({r: o["last_step"] for r in o["ranks"]})
        send_t.update(o["send_t"])
        for k, v in o["delivered"].items():
            delivered[k] = max(delivered.get(k, 0.0), v)
    expected = [max(last.values())] if aggregate else [last[s] for s in range(n_peers)]
    exactly_once = all(
        o["duplicates"] == 0 and o["gaps"] == 0 and all(th == expected for th in o["received_through"].values())
        for o in outs
    )
    # step 0 pays for first-touch costs (buffers, caches) in every process: latency from step 1 on
    # aggregated: a rank's update reaches the others inside its step's aggregate
    got = {k: delivered.get((k[0], AGGREGATE_ORIGIN) if aggregate else k) for k in send_t}
    lat = np.array([arrived - ts for k, ts in send_t.items() if k[0] >= 1 and (arrived := got[k]) is not None]) * 1e3
    if len(lat) + n_peers < len(send_t):  # an update nobody else received (exactly_once is False then)
        exactly_once = False
    updates = c1["updates_in"] - c0["updates_in"]
    steps = updates / n_peers
    forwarded = c1["forwarded"] - c0["forwarded"]
    message_wire = _wire_bytes(messages, args.datagram_size)
    if aggregate:
        # what went out per step and peer: one aggregate (its datagrams, wire bytes from the relay's tally)
        per_update_dgrams = forwarded / max(steps * n_peers, 1)
        per_update_bytes = (c1.get("aggregate_wire_bytes", 0) - c0.get("aggregate_wire_bytes", 0)) / max(steps, 1)
        model_egress = n_peers * per_update_bytes
    else:
        per_update_dgrams = forwarded / max(updates * (n_peers - 1), 1)
        per_update_bytes = message_wire
        model_egress = n_peers * (n_peers - 1) * message_wire
    return {
        "peers": n_peers,
        "forwarding": args.forwarding,
        "offload": offload,
        "steps": steps,
        "updates": updates,
        "egress_bytes_per_step": (c1["bytes_out"] - c0["bytes_out"]) / steps,
        "egress_datagrams_per_step": (c1["datagrams_out"] - c0["datagrams_out"]) / steps,
        "forwarded_datagrams_per_step": forwarded / steps,
        "forwarded_bytes_per_step": (c1.get("forwarded_bytes", 0) - c0.get("forwarded_bytes", 0)) / steps,
        "datagrams_per_update": per_update_dgrams,
        "forwarded_bytes_per_update": per_update_bytes,
        "rank_message_wire_bytes": message_wire,
        "target_egress_bytes_per_step": 2 * n_peers * message_wire,  # target: <= 2·N·m
        "model_egress_bytes_per_step": model_egress,
        "relay_cpu_per_step_s": relay_cpu / steps,
        "latency_p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "latency_p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "exactly_once": bool(exactly_once and c1["applied"] == c1["updates_in"]),
        "relay_retransmits": c1["retransmits"] - c0["retransmits"],
        "peer_retransmits": sum(o["retransmits"] for o in outs),
        "relay_drops": c1["drops"],
    }


# --- heartbeats (protocol cores, simulated clock) ------------------------------------------------------

# --- driver ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.params < 1 or not 0 < args.density <= 1:
        raise ValueError(f"--params must be >= 1 and --density in (0, 1] (got {args.params}, {args.density})")
    if args.steps < 2 or args.procs < 1 or not args.seconds > 0:
        raise ValueError("--steps must be >= 2, --procs >= 1 and --seconds > 0")
    messages = rank_messages(args.params, args.density, 8, seed=0)
    # warm the relay's decode+apply kernels (Numba) so that no N pays for compilation
    default_apply_update(default_decode_update(messages[0], args.params), np.zeros(args.params, np.float32))
    rows = []
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.offload]
    for n in args.peers:
        for offload in modes:
            row = run_one(n, args, messages, offload)
            rows.append(row)
            print_row(
                row,
                header=len(rows) == 1,
                params=args.params,
                density=args.density,
                message_bytes=row["rank_message_wire_bytes"],
            )
    heartbeats = [heartbeat_traffic(n, datagram_size=args.datagram_size) for n in args.heartbeat_peers]
    # the model and the plot from the last mode's rows (with "both": offload on); "baseline" holds the others
    last = rows[len(modes) - 1 :: len(modes)]
    projection = project(last)
    out = {
        "params": args.params,
        "density": args.density,
        "forwarding": args.forwarding,
        "datagram_size": args.datagram_size,
        "aggregate_datagram_size": args.aggregate_datagram_size,
        "procs": args.procs,
        "offload": args.offload,
        "runs": last,
        "heartbeats": heartbeats,
        "projection": projection,
    }
    if len(modes) > 1:
        out["baseline"] = rows[0 :: len(modes)]
    print_tail(heartbeats, projection, args.forwarding)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(out, indent=2, default=str) + "\n")
    if args.png:
        plot(out, args.png)
    return 0


def rank_messages(n_params: int, density: float, count: int, seed: int) -> list[bytes]:
    """``count`` synthetic rank messages of ``density`` entries, each with its own τ (1e-3 · (1 + i/count)),
    as calibrated ranks have: with one τ for all, the relay's residual would hold nothing but exact ties,
    which no training produces (aggregate.py's tie rule would hold most of it back)."""
    rng = np.random.default_rng(seed)
    k = max(1, int(round(n_params * density)))
    out = []
    for i in range(count):
        tau = np.float32(1e-3 * (1 + i / count))
        r = np.zeros(n_params, np.float32)
        r[rng.choice(n_params, size=k, replace=False)] = tau * rng.choice(np.array([-1.5, 1.5], np.float32), size=k)
        out.append(encode(r, None, float(tau)).to_bytes())
    return out


def _wire_bytes(messages: list[bytes], datagram_size: int) -> float:
    """Mean bytes on the wire for one update (every chunk's header and AEAD tag included)."""
    return sum(sealed_size(len(encode_update_body(m, None)), datagram_size)[0] for m in messages) / len(messages)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))
