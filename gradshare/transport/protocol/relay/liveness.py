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

from collections.abc import Callable

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.relay.attempt import Attempt
from gradshare.transport.protocol.relay.outbox import RelayOutbox
from gradshare.transport.protocol.relay.ranks import RankState
from gradshare.transport.protocol.tuning import RelayTuning

MAX_INCIDENTS = 256

# the update log's rule for a rank that is gone (relay/log.py RelayLog.declare_gone): handed to check(),
# as the log reports its own cuts through incident()
DeclareGone = Callable[[Attempt, RankState, str, float, float], None]


def owed_step(att: Attempt, rs: RankState) -> int:
    """The step of this rank the attempt's log waits for next."""
    return rs.received.contiguous_from(att.cursor.start_step)


class Liveness:
    """The rules over the current attempt's ranks (passed in each call); it owns the incidents."""

    def __init__(self, tuning: RelayTuning, io: RelayOutbox) -> None:
        self.io = io
        self.on_rank_loss = tuning.on_rank_loss
        self.liveness_timeout = float(tuning.liveness_timeout)
        self.give_up_after = float(tuning.give_up_after)
        self.join_window = tuning.join_seconds
        self.step_timeout = tuning.step_timeout
        self.incidents: list[ev.Incident] = []  # the first MAX_INCIDENTS, in order

    def first_cause(self) -> ev.Incident | None:
        return ev.first_cause(self.incidents)

    def fatal_incident(self) -> ev.Incident | None:
        return ev.first_fatal(self.incidents)

    def heard(self, att: Attempt, rs: RankState, now: float) -> None:
        p = rs.presence
        if p.suspected_since is not None:
            self.incident(att, "back", rs, now - p.suspected_since, now)
            p.suspected_since = None
        p.heard = True
        p.last_heard = now

    def incident(
        self,
        att: Attempt,
        kind: str,
        rs: RankState,
        seconds: float,
        now: float,
        detail: str = "",
        step: int | None = None,
    ) -> ev.Incident:
        step = owed_step(att, rs) if step is None else step
        inc = ev.Incident(kind, rs.rank, max(att.number, 0), min(step, ev.MAX_STEP), max(seconds, 0.0), now, detail)
        if len(self.incidents) < MAX_INCIDENTS:
            self.incidents.append(inc)
        else:
            self.io.counts["incidents_dropped"] += 1
        self.io.counts[f"incident_{kind}"] += 1
        self.io.emit(inc)
        return inc

    def check(self, att: Attempt, now: float, declare_gone: DeclareGone) -> None:
        """The timer's pass over the ranks of the current attempt."""
        started = att.started
        if started is None:
            return
        if att.restart_reason is not None:  # resent every tick: a REJECT is one datagram, and may be lost
            for r in att.ranks:
                if r.connected and r.ended is None and r.presence.suspected_since is None:
                    self.io.send(r, ev.Reject(att.restart_reason))
        for rs in att.ranks:
            if rs.ended is None:
                self._check_rank(att, rs, now, started, declare_gone)

    def _check_rank(self, att: Attempt, rs: RankState, now: float, started: float, declare_gone: DeclareGone) -> None:
        p = rs.presence
        # progress, not presence: a process that answers but whose training thread has been in the
        # same step for step_timeout (a paused process is the silence rule's, below)
        if (
            self.step_timeout is not None
            and p.computing >= 0
            and not p.given_up
            and now - p.computing_since > self.step_timeout
            and now - p.last_heard < self.liveness_timeout
        ):
            p.given_up = True
            self.incident(
                att,
                "stuck",
                rs,
                now - p.computing_since,
                now,
                f"step_timeout={self.step_timeout:g} s; its process still answers",
                p.computing,
            )
        if p.heard:
            silent, bound, what = now - p.last_heard, self.liveness_timeout, "liveness_timeout"
        else:  # never heard in this attempt: the join window runs from the attempt's start
            silent, bound, what = now - started, self.join_window, "join_window"
        if silent <= bound:
            return
        if p.suspected_since is None:
            p.suspected_since = p.last_heard if p.heard else started
            self.incident(att, "suspected", rs, silent, now, f"{what}={bound:g} s")
            if self.on_rank_loss == "continue":
                declare_gone(
                    att, rs, f"silent for more than {bound:g} s ({what}); on_rank_loss='continue'", now, silent
                )
                return
            if self.on_rank_loss == "restart" and att.restart_reason is None:
                self._restart(att, rs, silent, now)
        if self.on_rank_loss == "wait" and silent > max(bound, self.give_up_after) and not p.given_up:
            p.given_up = True  # one fatal incident per rank
            self.incident(att, "silent", rs, silent, now, f"on_rank_loss='wait' waits at most {self.give_up_after:g} s")

    def _restart(self, att: Attempt, rs: RankState, silent: float, now: float) -> None:
        """on_rank_loss="restart": reject every live rank of the attempt, so their tasks fail and Spark
        retries the barrier stage; the new attempt resumes after complete_through (nothing skipped)."""
        self.incident(att, "restart", rs, silent, now, "on_rank_loss='restart'")
        att.restart_reason = (
            f"stage restart: rank {rs.rank} silent for {silent:.1f} s at step "
            f"{owed_step(att, rs)} (on_rank_loss='restart')"
        )


__all__ = ["MAX_INCIDENTS", "DeclareGone", "Liveness", "owed_step"]
