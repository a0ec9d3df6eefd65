"""A sender's outstanding updates: kept until acknowledged, re-sent on a retransmit timeout with
exponential backoff, and the timeout itself from RFC 6298 round-trip estimates (a small
bookkeeping class with its own tests). No clock here: every call takes ``now``.

Karn's rule: a step whose datagrams were re-sent (timeout, or the relay's NAK) gives no RTT sample, else
the estimate would include loss repair and inflate every later timeout.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradshare.transport.protocol.history import History

MAX_RTO = 10.0
MAX_BACKOFF_DOUBLINGS = 6


class Outstanding:
    """``min_rto``: the configured retransmit timeout, the floor under the estimate. Under load the round
    trip grows (queues); a fixed timeout would then retransmit what is merely late."""

    def __init__(self, max_entries: int, max_bytes: int, min_rto: float) -> None:
        self.bodies: History[int, bytes] = History(max_entries, max_bytes)
        self.min_rto = min_rto
        self.sent_at: dict[int, float] = {}  # step -> when it was (re)sent
        self.first_sent: dict[int, float] = {}  # step -> first send, while it may still give an RTT sample
        self.tries: dict[int, int] = {}  # step -> retransmit timeouts so far
        self.srtt: float | None = None  # smoothed RTT / variation -> retransmit timeout
        self.rttvar = 0.0

    def add(self, step: int, body: bytes, now: float) -> None:
        self.bodies.put(step, body)
        self.sent_at[step] = self.first_sent[step] = now
        self.tries[step] = 0

    def get(self, step: int) -> bytes | None:
        return self.bodies.get(step)

    def acked(self, step: int, now: float) -> None:
        """The relay's ACK: an RTT sample unless the step was re-sent (Karn)."""
        first = self.first_sent.get(step)
        if first is not None and self.tries.get(step) == 0:
            self._sample(now - first)
        self.drop(step)

    def acked_through(self, step: int) -> None:
        """STATUS says the relay holds every step through ``step``: no RTT sample (it is not an answer)."""
        for s in [s for s in self.bodies if s <= step]:
            self.drop(s)

    def repaired(self, step: int) -> None:
        """Its datagrams were re-sent on the relay's NAK: no RTT sample from it (Karn)."""
        self.first_sent.pop(step, None)

    def drop(self, step: int) -> None:
        self.bodies.pop(step)
        self.sent_at.pop(step, None)
        self.first_sent.pop(step, None)
        self.tries.pop(step, None)

    def rto(self) -> float:
        """RFC 6298 from ACK round trips, never below ``min_rto``, never above MAX_RTO."""
        if self.srtt is None:
            return self.min_rto
        return min(max(self.min_rto, self.srtt + 4 * self.rttvar), MAX_RTO)

    def due(self, now: float) -> list[int]:
        """The steps whose timeout (rto, doubled per try) has passed; they count as re-sent now."""
        rto = self.rto()
        out = []
        for step in list(self.bodies):
            tries = self.tries.get(step, 0)
            if now - self.sent_at.get(step, now) >= rto * (1 << min(tries, MAX_BACKOFF_DOUBLINGS)):
                self.sent_at[step] = now
                self.tries[step] = tries + 1
                out.append(step)
        return out

    def _sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def __len__(self) -> int:
        return len(self.bodies)

    def __iter__(self) -> Iterator[int]:
        return iter(self.bodies)
