"""What one stage attempt of the relay holds (``Attempt``): its rank table, log cursor, the updates
decoded and not yet applied, the bounded history, reassembly and the acknowledgements due.

A higher attempt is a retried stage (admission.py): the log is cut at ``complete_through`` (or where the
training observer rolls the parameters back to) and restarts after the cut from a fresh ``Attempt``, so
nothing of the old one's log, repair state or liveness verdicts survives but what the core carries over on
purpose (the parameters, the failures, the observer's notes). The parts that work on it (the update log,
liveness, admission) are handed the current one in each call.
"""

from __future__ import annotations

from typing import Any

from gradshare.transport.protocol.cursor import LogCursor
from gradshare.transport.protocol.history import History, StepKeys
from gradshare.transport.protocol.reassembly import Reassembler
from gradshare.transport.protocol.relay.ranks import RankTable
from gradshare.transport.protocol.step_meta import StepMeta
from gradshare.transport.protocol.tuning import RelayTuning

# Any, for a decoded update: the core only holds it between decode_update and apply_update, which come as
# a pair (the encoding package's StepUpdate by default; tests plug in a toy codec)
Decoded = Any


def total_len(datagrams: tuple[bytes, ...]) -> int:
    return sum(len(d) for d in datagrams)


class Attempt:
    __slots__ = (
        "number",
        "started",
        "notes",
        "cursor",
        "ranks",
        "pending",
        "pending_meta",
        "restart_reason",
        "evicted",
        "trim_floor",
        "history",
        "reasm",
        "recent",
        "acks",
        "log_complete_sent",
    )

    def __init__(
        self,
        number: int,
        started: float | None,
        base: int,
        notes: tuple[tuple[str, float], ...],
        world_size: int,
        tuning: RelayTuning,
        max_message: int,
        now: float,
    ) -> None:
        self.number = number  # -1: no attempt yet; the first JOIN or LOADING starts one
        self.started = started  # when (None: no attempt yet)
        self.notes = notes  # what this attempt's WELCOME hands over
        self.cursor = LogCursor(world_size, base)
        self.ranks = RankTable(world_size, now, tuning.nak_delay)
        self.pending: dict[tuple[int, int], Decoded] = {}  # (step, rank) -> decoded, validated, not applied
        self.pending_meta: dict[tuple[int, int], StepMeta] = {}  # their meta, accounted when applied
        self.restart_reason: str | None = None  # on_rank_loss="restart" fired in this attempt
        self.evicted = StepKeys()  # history entries lost to the caps (NAK → error)
        self.trim_floor = -2  # the floor the last trim dropped through
        # the origin's sealed datagrams are kept and forwarded unchanged: every peer holds the job key, so
        # re-sealing each chunk would cost an AEAD operation per chunk and buy nothing (the origin's
        # authentication covers the header, origin and step included)
        self.history: History[tuple[int, int], tuple[bytes, ...]] = History(
            tuning.history_entries, tuning.history_bytes, size=total_len, by_step=True
        )
        self.reasm: Reassembler[tuple[int, int]] = Reassembler(
            tuning.reassembly_messages, tuning.reassembly_bytes, max_message, keep_raw=True
        )
        self.recent: dict[tuple[int, int], float] = {}  # (step, origin) -> forwarded at, the last nak_delay
        self.acks: dict[int, list[int]] = {}  # rank -> steps to acknowledge
        self.log_complete_sent = False


__all__ = ["Attempt", "Decoded", "total_len"]
