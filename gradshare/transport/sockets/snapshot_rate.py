"""How fast and in what datagrams the relay sends the model's snapshot to the workers: it depends on the
host they reach it at (loopback or a network), so the relay's owner (the driver, or rank 0's task with the
relay in the job) sets it through these RelayTuning fields."""

from __future__ import annotations

import ipaddress
import socket
from typing import TypedDict

from gradshare.transport.protocol.wire import MAX_DATAGRAM_SIZE

# Every worker takes the initial weights from the relay's snapshot (task/shipping.py), so its speed is
# start-up time: 50 MB/s in 1.4 kB datagrams made a 206 MB model wait 9-14 s on loopback with 2 workers.
SNAPSHOT_RATE_LOOPBACK = 1e9  # the CPU (sealing, opening) is the limit there, not the link
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
