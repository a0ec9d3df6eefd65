"""The relay's liveness rules, sans I/O: who is suspected, cut or given up on, and the incidents that say
so (docs/design.md, Liveness).

A rank silent for ``liveness_timeout`` is *suspected*; what follows is the ``on_rank_loss`` policy:
"wait" (the log waits; after ``give_up_after`` s of silence a fatal incident), "continue" (declared gone,
cut at the last step it holds contiguously) or "restart" (every live rank of the attempt is rejected, so
Spark retries the stage, which resumes with nothing skipped). A rank not heard at all in an attempt has
``join_window`` s from the attempt's start instead; a task still materialising its partition says
LOADING. A heartbeat naming the same ``computing`` step for ``step_timeout`` s is a fatal "stuck"
incident. Every suspicion, cut and give-up is an ``Incident`` in ``incidents`` (bounded), the first cause
the driver reports.
"""

from __future__ import annotations

from typing import Protocol

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.relay.ranks import RankState
from gradshare.transport.protocol.relay.attempt import RelayParts

MAX_INCIDENTS = 256


class _Log(Protocol):
    """relay/log.py RelayLog, as liveness uses it (that module reads ``Liveness``: it imports this one)."""

    def declare_gone(self, rs: RankState, reason: str, now: float | None = None, silent: float = 0.0) -> None: ...


class LivenessCore(RelayParts, Protocol):
    """What the liveness rules use of the relay besides `RelayParts`."""

    @property
    def log(self) -> _Log: ...

    def owed_step(self, rs: RankState) -> int: ...


class Liveness:
    """Owned by a RelayCore: its rules read the core's attempt and act through its log and sends."""

    def __init__(self, core: LivenessCore) -> None:
        self.core = core
        tuning = core.tuning
        self.on_rank_loss = tuning.on_rank_loss
        self.liveness_timeout = float(tuning.liveness_timeout)
        self.give_up_after = float(tuning.give_up_after)
        self.join_window = tuning.join_seconds
        self.step_timeout = tuning.step_timeout
        self.incidents: list[ev.Incident] = []           # the first MAX_INCIDENTS, in order

    def heard(self, rs: RankState, now: float) -> None:
        if rs.suspected_since is not None:
            self.incident("back", rs, now - rs.suspected_since, now)
            rs.suspected_since = None
        rs.heard = True
        rs.last_heard = now

    def incident(self, kind: str, rs: RankState, seconds: float, now: float, detail: str = "",
                 step: int | None = None) -> ev.Incident:
        core = self.core
        step = core.owed_step(rs) if step is None else step
        inc = ev.Incident(kind, rs.rank, max(core.attempt, 0), min(step, ev.MAX_STEP), max(seconds, 0.0), now,
                          detail)
        if len(self.incidents) < MAX_INCIDENTS:
            self.incidents.append(inc)
        else:
            core.c["incidents_dropped"] += 1
        core.c[f"incident_{kind}"] += 1
        core.emit(inc)
        return inc

    def check(self, now: float) -> None:
        """The timer's pass over the ranks of the current attempt."""
        att = self.core.att
        if att.started is None:
            return
        if att.restart_reason is not None:      # resent every tick: a REJECT is one datagram, and may be lost
            for r in att.ranks:
                if r.connected and r.ended is None and r.suspected_since is None:
                    self.core.send(r, ev.Reject(att.restart_reason))
        for rs in att.ranks:
            if rs.ended is None:
                self._check_rank(rs, now, att.started)

    def _check_rank(self, rs: RankState, now: float, started: float) -> None:
        # progress, not presence: a process that answers but whose training thread has been in the
        # same step for step_timeout (a paused process is the silence rule's, below)
        if (self.step_timeout is not None and rs.computing >= 0 and not rs.given_up
                and now - rs.computing_since > self.step_timeout and now - rs.last_heard < self.liveness_timeout):
            rs.given_up = True
            self.incident("stuck", rs, now - rs.computing_since, now,
                          f"step_timeout={self.step_timeout:g} s; its process still answers", rs.computing)
        if rs.heard:
            silent, bound, what = now - rs.last_heard, self.liveness_timeout, "liveness_timeout"
        else:   # never heard in this attempt: the join window runs from the attempt's start
            silent, bound, what = now - started, self.join_window, "join_window"
        if silent <= bound:
            return
        if rs.suspected_since is None:
            rs.suspected_since = rs.last_heard if rs.heard else started
            self.incident("suspected", rs, silent, now, f"{what}={bound:g} s")
            if self.on_rank_loss == "continue":
                self.core.log.declare_gone(
                    rs, f"silent for more than {bound:g} s ({what}); on_rank_loss='continue'", now, silent)
                return
            if self.on_rank_loss == "restart" and self.core.att.restart_reason is None:
                self._restart(rs, silent, now)
        if self.on_rank_loss == "wait" and silent > max(bound, self.give_up_after) and not rs.given_up:
            rs.given_up = True        # one fatal incident per rank
            self.incident("silent", rs, silent, now, f"on_rank_loss='wait' waits at most {self.give_up_after:g} s")

    def _restart(self, rs: RankState, silent: float, now: float) -> None:
        """on_rank_loss="restart": reject every live rank of the attempt, so their tasks fail and Spark
        retries the barrier stage; the new attempt resumes after complete_through (nothing skipped)."""
        self.incident("restart", rs, silent, now, "on_rank_loss='restart'")
        self.core.att.restart_reason = (f"stage restart: rank {rs.rank} silent for {silent:.1f} s at step "
                                        f"{self.core.owed_step(rs)} (on_rank_loss='restart')")


__all__ = ["MAX_INCIDENTS", "Liveness", "LivenessCore"]
