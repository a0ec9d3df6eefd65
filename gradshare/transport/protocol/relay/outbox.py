"""What the relay's parts hand the shell, sans I/O: datagrams with their addresses, events and the
counters (the core and each of its parts write here; none reads another's fields)."""

from __future__ import annotations

from collections import Counter, deque

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.relay.ranks import RankState


class RelayOutbox:
    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.datagrams: list[tuple[bytes, ev.Address]] = []
        self.events: deque[ev.RelayEvent] = deque()
        self.counts: Counter[str] = Counter()  # counters (drops live in chan.drops)

    def send(self, rs: RankState, msg: ev.ControlMessage) -> None:
        if rs.addr is not None:
            self.datagrams.append((self.chan.seal_control(msg), rs.addr))

    def send_to(self, addr: ev.Address, msg: ev.ControlMessage) -> None:
        self.datagrams.append((self.chan.seal_control(msg), addr))

    def emit(self, event: ev.RelayEvent) -> None:
        self.events.append(event)

    def take(self) -> list[tuple[bytes, ev.Address]]:
        if not self.datagrams:
            return []  # the common case: the shell asks after every datagram it feeds in
        out, self.datagrams = self.datagrams, []
        self.counts["datagrams_out"] += len(out)
        self.counts["bytes_out"] += sum(len(data) for data, _ in out)
        return out


__all__ = ["RelayOutbox"]
