"""A peer's own updates, sans I/O: the next step it must send, each update kept until the relay
acknowledges it (``outstanding.py``: retransmitted after the RTO, re-sent chunk by chunk on a NAK), and
its FINISHED until the relay's STATUS confirms its end."""

from __future__ import annotations

from gradshare.errors import LocalProtocolError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.peer.outbox import PeerOutbox
from gradshare.transport.protocol.peer.outstanding import Outstanding
from gradshare.transport.protocol.tuning import PeerTuning
from gradshare.transport.protocol.wire import Kind


class OwnLog:
    def __init__(self, rank: int, tuning: PeerTuning, io: PeerOutbox) -> None:
        self.rank = rank
        self.io = io
        self.unacked = Outstanding(tuning.max_unacked, tuning.max_unacked_bytes, tuning.rto)
        self.max_unacked = tuning.max_unacked
        self.next_step: int | None = None  # WELCOME's start step, then one past the last sent
        self.finish_step: int | None = None
        self.finish_acked = False

    def check_next(self, step: int) -> None:
        """``step`` may be sent now: every step produces exactly one message, in order."""
        if self.finish_step is not None:
            raise LocalProtocolError(f"rank {self.rank} already sent FINISHED({self.finish_step})")
        if type(step) is not int or step != self.next_step:
            raise LocalProtocolError(
                f"rank {self.rank} must send step {self.next_step} next (got {step!r}): "
                f"every step produces exactly one message, in order"
            )
        if len(self.unacked) >= self.max_unacked:
            raise LocalProtocolError(
                f"the relay has not acknowledged {len(self.unacked)} updates of rank "
                f"{self.rank}; refusing to buffer more"
            )

    def finish(self, last_step: int) -> bool:
        """FINISHED(``last_step``) may be sent: it names our last sent step. True the first time (our end
        is new to the log)."""
        assert self.next_step is not None  # WELCOME set it: joined states come after it
        if last_step != self.next_step - 1:
            raise LocalProtocolError(
                f"FINISHED({last_step}) but rank {self.rank}'s last sent step is {self.next_step - 1}"
            )
        if self.finish_step is not None:
            return False
        self.finish_step = last_step
        return True

    def send(self, step: int, body: bytes, now: float) -> None:
        self.unacked.add(step, body, now)
        self.io.datagrams.extend(self.io.chan.seal_chunks(Kind.UPDATE, body, self.rank, step))
        self.next_step = step + 1
        self.io.counts["updates_sent"] += 1

    def on_nak(self, items: tuple[ev.NakItem, ...]) -> None:
        """Re-send what the relay is missing of ours, only the chunks it names."""
        for item in items:
            body = self.unacked.get(item.step) if item.origin == self.rank else None
            if body is None:
                continue
            ds = self.io.chan.seal_chunks(Kind.UPDATE, body, self.rank, item.step, item.chunks or None)
            self.io.datagrams.extend(ds)
            self.unacked.repaired(item.step)  # Karn: no RTT sample from a repaired step
            self.io.counts["retransmits"] += len(ds)

    def on_end(self, ended: ev.Ended) -> None:
        """Our own end, as STATUS says it: declared gone, or our FINISHED confirmed."""
        if ended.gone:
            self.io.fail_with(f"the relay declared rank {self.rank} gone at step {ended.last_step}")
        elif self.finish_step == ended.last_step:
            self.finish_acked = True

    def retransmit_due(self, now: float) -> None:
        for step in self.unacked.due(now):  # exponential backoff
            body = self.unacked.get(step)
            assert body is not None  # due() names only the steps it holds
            ds = self.io.chan.seal_chunks(Kind.UPDATE, body, self.rank, step)
            self.io.datagrams.extend(ds)
            self.io.counts["retransmits"] += len(ds)
            self.io.counts["timeouts"] += 1

    def waiting(self) -> bool:
        """Something of ours awaits the relay's acknowledgement (a retransmit timeout may come due)."""
        return bool(len(self.unacked)) or (self.finish_step is not None and not self.finish_acked)


__all__ = ["OwnLog"]
