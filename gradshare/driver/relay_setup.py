"""The relay's tunables that depend on the fit: how long it waits for a rank it has not heard at all
(the join window), and how fast and in what datagrams it sends the model's snapshot to the workers."""

from __future__ import annotations

import ipaddress
import socket
from typing import TypedDict

from gradshare.transport.protocol.wire import MAX_DATAGRAM_SIZE

JOIN_LOAD_FACTOR = 4.0  # join window = timeout + this × the slowest pre-pass partition read (join_window)


def join_window(timeout: float, liveness_timeout: float, load_seconds: float) -> float:
    """How long after a stage attempt starts the relay waits for a rank it has not heard at all:
    `timeout`, plus a generous multiple of the slowest partition's read in the pre-pass
    (the training read also builds arrays or a spill file). A task that is loading says so anyway."""
    return max(timeout, liveness_timeout) + JOIN_LOAD_FACTOR * load_seconds


# Every worker takes the initial weights from the relay's snapshot (task/shipping.py), so its speed is
# start-up time: 50 MB/s in 1.4 kB datagrams made a 206 MB model wait 9-14 s on loopback with 2 workers.
SNAPSHOT_RATE_LOOPBACK = 1e9   # the CPU (sealing, opening) is the limit there, not the link
SNAPSHOT_RATE_NETWORK = 100e6  # about what 1 Gbit/s Ethernet carries


class SnapshotOptions(TypedDict):
    """The relay's snapshot tunables (RelayTuning) that depend on how the workers reach it."""

    snapshot_rate: float
    snapshot_datagram_size: int


def snapshot_options(host: str, datagram_size: int) -> SnapshotOptions:
    """Relay options for snapshot transfers to workers that reach it at `host`: on loopback (MTU 64 kB,
    nothing to fragment) the largest datagrams and a CPU-bound rate; otherwise `datagram_size` and a rate
    a gigabit link carries (a lost fragment would lose a whole large datagram)."""
    try:
        loopback = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0][4][0]).is_loopback
    except (OSError, ValueError):
        loopback = False
    if loopback:
        return {"snapshot_rate": SNAPSHOT_RATE_LOOPBACK, "snapshot_datagram_size": MAX_DATAGRAM_SIZE}
    return {"snapshot_rate": SNAPSHOT_RATE_NETWORK, "snapshot_datagram_size": datagram_size}
