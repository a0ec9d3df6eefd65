"""A relay core and its peer cores joined over a perfect in-memory link (no sockets, no clock).

For measuring the cores alone (``gradshare bench transport``) and for tests that move every datagram by
hand; the seeded lossy harness for tests lives in ``tests/harness.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradshare.transport.protocol.events import Address
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE
from gradshare.transport.sockets.relay import RelayPlugins

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Unpack  # in typing from Python 3.11 on; 3.10 is supported


def joined_cores(
    world_size: int,
    n_params: int,
    key: bytes | None,
    job_id: int | str,
    *,
    insecure: bool = False,
    datagram_size: int = DEFAULT_DATAGRAM_SIZE,
    tuning: RelayTuning = RelayTuning(),
    defer_apply: bool = False,
    **plugins: Unpack[RelayPlugins],
) -> tuple[RelayCore, list[PeerCore]]:
    """(relay, peers): every peer has sent JOIN and received WELCOME at time 0; peer r's address is r."""
    relay = RelayCore(
        np.zeros(n_params, np.float32),
        world_size,
        key,
        job_id,
        now=0.0,
        insecure=insecure,
        datagram_size=datagram_size,
        tuning=tuning,
        defer_apply=defer_apply,
        **plugins,
    )
    peers = [
        PeerCore(r, world_size, 0, key, job_id, n_params, now=0.0, insecure=insecure, datagram_size=datagram_size)
        for r in range(world_size)
    ]
    for r, p in enumerate(peers):
        p.join(0.0)
        for d in p.datagrams_to_send():
            relay.receive_datagram(d, r, 0.0)
    by_address: dict[Address, PeerCore] = dict(enumerate(peers))  # the addresses here are ranks
    for d, addr in relay.datagrams_to_send():
        by_address[addr].receive_datagram(d, "relay", 0.0)
    not_joined = [p.rank for p in peers if p.state != "joined"]
    if not_joined:
        raise RuntimeError(f"ranks {not_joined} did not join over the in-memory link")
    return relay, peers
