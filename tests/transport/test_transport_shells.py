"""The socket shells act on the cores' events and call only the cores' methods."""

from __future__ import annotations

import ast
import inspect

import pytest

from gradshare.errors import LocalProtocolError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.sockets import peer, relay
from harness import Sim, drive

# the cores' read-only properties, the only attribute reads a shell makes that are not method calls
PROPERTIES = {"complete_through"}


@pytest.mark.parametrize("module", [peer, relay])
def test_shells_read_no_core_field(module):
    tree = ast.parse(inspect.getsource(module))
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    reads = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "_core"
        and id(n) not in calls
    }
    # a bound method handed on to be called (self._call(self._core.join)) is a call too
    methods = {
        name for name, _ in inspect.getmembers(PeerCore if module is peer else relay.RelayCore, inspect.isfunction)
    }
    assert reads - methods <= PROPERTIES, f"{module.__name__} reads core fields {sorted(reads - methods)}"


def _events(p: PeerCore) -> list:
    out = []
    while (e := p.next_event()) is not None:
        out.append(e)
    return out


def test_a_welcome_for_another_job_is_a_rejected_event():
    p = PeerCore(0, 2, 0, b"k" * 32, 42, 100, now=0.0)
    p.join(0.0)
    relay_chan = Channel(
        key=b"k" * 32,
        insecure=False,
        job=wire.job_id_to_int(42),
        sender=wire.RELAY_ID,
        attempt=0,
        datagram_size=wire.DEFAULT_DATAGRAM_SIZE,
        max_chunks=16,
        max_windows=4,
    )
    p.receive_datagram(relay_chan.seal_control(ev.Welcome(101, 2, 0, -1)), "relay", 0.01)
    (e,) = _events(p)
    assert isinstance(e, ev.Rejected) and "n_params=101" in e.reason and e.reason == p.io.error
    with pytest.raises(LocalProtocolError, match="n_params=101"):
        p.send_update(0, b"", None, 0.02)


def test_a_rank_declared_gone_hears_it_once_as_a_rejected_event():
    sim = Sim(world_size=2, seed=4, liveness_timeout=0.3, on_rank_loss="continue")
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))
    for p in sim.peers.values():
        _events(p)
    sim.silent.add(1)
    drive(sim, lambda: sim.relay.counts["gone"] == 1)
    sim.silent.discard(1)  # it comes back and hears STATUS pages saying it is gone
    drive(sim, lambda: sim.peers[1].io.error is not None)
    for _ in range(50):
        sim.step_time()
    rejected = [e for e in _events(sim.peers[1]) if isinstance(e, ev.Rejected)]
    assert [e.reason for e in rejected] == ["the relay declared rank 1 gone at step -1"]
