"""What a peer's parts hand the shell, sans I/O: datagrams sealed for the relay, events, the counters, and
the error that ends the peer (the core and each of its parts write here; none reads another's fields)."""

from __future__ import annotations

from collections import Counter, deque

from gradshare.errors import LocalProtocolError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.channel import Channel
from gradshare.transport.protocol.states import PeerState


class PeerOutbox:
    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.datagrams: list[bytes] = []
        self.events: deque[ev.PeerEvent] = deque()
        self.counts: Counter[str] = Counter()
        self.error: str | None = None  # set once the peer cannot go on; every later call raises it

    def send(self, msg: ev.ControlMessage) -> None:
        self.datagrams.append(self.chan.seal_control(msg))

    def emit(self, event: ev.PeerEvent) -> None:
        self.events.append(event)

    def fail_with(self, error: str, event: type[ev.Rejected | ev.SnapshotFailed] = ev.Rejected) -> None:
        """This peer cannot go on: every later call raises ``error``; the shell learns it from the event
        (a repeated cause, e.g. one STATUS page per heartbeat, is told once)."""
        if error != self.error:
            self.error = error
            self.events.append(event(error))

    def check_usable(self, state: PeerState, what: str) -> None:
        """An application call ``what`` needs a joined peer that has not failed."""
        if self.error:
            raise LocalProtocolError(f"{what}: {self.error}")
        if state != PeerState.JOINED:
            raise LocalProtocolError(f"{what} needs a joined peer (state {state}); call join() first")

    def take(self) -> list[bytes]:
        out, self.datagrams = self.datagrams, []
        self.counts["datagrams_out"] += len(out)
        self.counts["bytes_out"] += sum(len(d) for d in out)
        return out


__all__ = ["PeerOutbox"]
