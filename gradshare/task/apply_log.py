"""The apply log of one replica: delivered messages applied in canonical (step, sender) order, never
past a bound (docs/design.md, "Consistency model")."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

from gradshare.encoding import decode_update
from gradshare.encoding.step_cap import StepCap
from gradshare.errors import ProtocolError
from gradshare.replica.flat import FlatParams
from gradshare.task.profiling import OFF, Off, StepProfile
from gradshare.transport.protocol.events import AGGREGATE_ORIGIN, Update


class UpdateSource(Protocol):
    """What the log reads of its peer (transport.Peer; or a LogPeer, transport/testing/shared_log.py)."""

    def receive(self, until_step: int | None = None, timeout: float | None = None) -> list[Update]: ...


class ApplyLog:
    """Applies delivered messages to the replica in canonical (step, sender) order, never past a bound.

    `peer.receive` may hand over messages beyond the step we need; they wait in `pending` (bounded by
    the staleness window times the world size) until their turn, so applying is deterministic.
    """

    def __init__(
        self,
        peer: UpdateSource,
        flat: FlatParams,
        start_step: int,
        timeout: float,
        profile: StepProfile | Off | None = None,
        scale: float = 1.0,
        cap: StepCap | None = None,
    ) -> None:
        self.peer, self.flat, self.timeout = peer, flat, timeout  # flat.state: the live parameters + buffers
        # the same on every replica and the relay, so the replicas stay bit-identical
        # cap: the step cap (encoding/step_cap.py; this replica's own: it remembers the norms it read), None: none
        self.scale, self.cap = scale, None if cap is None else replace(cap)
        self.applied_through = start_step - 1  # the snapshot (or the initial params) covers the rest
        self.start_step = start_step
        self.pending: deque[Update] = deque()
        self.applied = 0
        self.last_key = (-1, -1)
        self.profile = OFF if profile is None else profile
        self.stop_epoch: int | None = None  # rank 0's early-stop decision, once the log has applied it

    def _take(self, updates: Iterable[Update]) -> None:
        for u in updates:
            key = (u.step, u.sender)
            if key <= self.last_key:  # the transport promises canonical order, each exactly once
                raise ProtocolError(f"update {key} delivered after {self.last_key}: not canonical order")
            self.last_key = key
            if u.step >= self.start_step:  # older ones are inside the snapshot we resumed from
                self.pending.append(u)
            else:
                # older than a resumed attempt's start: inside its snapshot. (The relay starts a new
                # attempt's log at its start; a stop decided before it comes in WELCOME's notes.)
                self._note_stop(u)

    def _note_stop(self, u: Update) -> None:
        """Rank 0's early-stop decision (stopping.py), taken in log order: the same step on every rank."""
        # aggregated forwarding: the relay's aggregate carries rank 0's decision (transport/protocol/relay/log.py)
        if u.sender in (0, AGGREGATE_ORIGIN) and u.meta is not None and self.stop_epoch is None:
            self.stop_epoch = u.meta.stop_epoch

    def apply_through(self, step: int) -> None:
        if step <= self.applied_through:
            return
        # Always ask: messages of `step` may already be pending from some senders but not from all.
        self._take(self.peer.receive(until_step=step, timeout=self.timeout))
        self.profile.lap("wait")
        flat = self.flat
        while self.pending and self.pending[0].step <= step:
            # one whole step at a time (receive returned every message through `step`): the step cap
            # scales a tensor by what the step's messages add up to
            t, row = self.pending[0].step, []
            while self.pending and self.pending[0].step == t:
                u = self.pending.popleft()
                self._note_stop(u)
                row.append(decode_update(u.payload, flat.n_state, n_params=flat.n_params))
            # the copies that follow P (its twin, the folded point) follow the log too (flat.py)
            flat.apply_step(row, self.scale, self.cap)
            self.applied += len(row)
        self.applied_through = step
        self.profile.lap("apply")
