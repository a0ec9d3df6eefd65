"""The transport's part of N ranks in one process, in lock step: every message a rank sends is delivered to
every rank (itself included) in (step, rank) order, as the relay's log does, with no sockets, threads or
clock. For stepping real workers and apply logs by hand: the lab's lock-step harness (benchmarks/lab/lockstep.py)
and tests of the worker.
"""

from __future__ import annotations

from gradshare.transport import Update
from gradshare.transport.protocol.step_meta import StepMeta


class SharedLog:
    """The relay of a lock-step run: every rank's message of a step, delivered to every rank in (step,
    rank) order. A step is dropped once every rank has read it, so memory stays at about one step's
    messages and a read costs what it returns (a scan of the whole history made a 64-worker run of
    4,800 steps quadratic: over an hour, most of it in that scan)."""

    def __init__(self, world: int) -> None:
        self.steps: dict[int, list[tuple[int, bytes]]] = {}
        self.read = [-1] * world  # per rank: the last step delivered to it
        self.dropped = -1  # steps up to this one every rank has read

    def send(self, step: int, rank: int, payload: bytes) -> None:
        if step <= max(self.read):  # lock step: no rank reads a step before every rank has sent it
            raise RuntimeError(f"rank {rank}'s message of step {step} came after a rank had read that step")
        self.steps.setdefault(step, []).append((rank, payload))

    def take(self, rank: int, until_step: int) -> list[Update]:
        first = self.read[rank] + 1
        out = [
            Update(s, r, p, None)
            for s in range(first, until_step + 1)
            for r, p in sorted(self.steps.get(s, ()), key=lambda m: m[0])
        ]
        self.read[rank] = max(self.read[rank], until_step)
        for s in range(self.dropped + 1, min(self.read) + 1):
            self.steps.pop(s, None)
        self.dropped = max(self.dropped, min(self.read))
        return out


class LogPeer:
    """A peer whose relay is a `SharedLog`: every message sent is delivered to every rank in order."""

    def __init__(self, log: SharedLog, rank: int) -> None:
        self.log, self.rank = log, rank

    def send_update(self, step: int, payload: bytes, meta: StepMeta | None = None) -> None:
        self.log.send(step, self.rank, payload)

    def receive(self, until_step: int | None = None, timeout: float | None = None) -> list[Update]:
        if until_step is None:  # a lock-step log has no "whatever came": ApplyLog always names the step
            raise ValueError(f"rank {self.rank}: LogPeer.receive needs until_step (the last step to deliver)")
        return self.log.take(self.rank, until_step)

    def counters(self) -> dict[str, int]:
        return {}
