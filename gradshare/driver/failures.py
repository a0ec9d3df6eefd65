"""The one error a failed fit raises on the driver, naming the rank and the cause: the worker's own error
that it reported to the relay (a FAIL), the relay's incident (a rank silent or stuck), or, when neither
arrived, the root cause read from Spark's job failure.
"""

from __future__ import annotations

import re
from typing import Protocol

from gradshare.errors import GradshareError, TrainingError, TransportTimeout
from gradshare.reports import WorkerFailure
from gradshare.transport.protocol.events import Fail, Incident


class RelayReads(Protocol):
    """What the driver reads of a relay while its job runs: the `Relay` in this process, or the in-job
    relay's pushed status (in_job.JobRelay)."""

    def progress(self) -> dict[str, object]: ...

    def failure(self) -> Fail | None: ...

    def reported_failure(self) -> Fail | None: ...

    def first_cause(self) -> Incident | None: ...

    def fatal_incident(self) -> Incident | None: ...


# the closing line of a Python traceback: "ModuleNotFoundError: No module named 'x'" (dotted names too)
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): (.*)$", re.M)


def failure_of(fail: Fail) -> WorkerFailure:
    """The WorkerFailure a FAIL carried (transport.events.Fail: its msgpack fields)."""
    return WorkerFailure(
        fail.rank,
        None if fail.step < 0 else fail.step,
        fail.error_type,
        fail.message,
        fail.error_class,
        fail.cause or None,
        fail.attempt,
    )


def reported_error(failed: Fail) -> Exception:
    """The error for a fatal FAIL a worker reported to the relay: the class the worker raised."""
    return failure_of(failed).error()


def incident_error(incident: Incident) -> Exception:
    """The error for an incident after which the relay gave up on a rank (transport.events.Incident)."""
    return incident_class(incident)(f"worker {incident.describe()}")


def incident_class(incident: Incident) -> type[GradshareError]:
    """A rank that went silent is a timeout; any other incident a training error."""
    return TransportTimeout if incident.kind == "silent" else TrainingError


def driver_error(exc: BaseException, relay: RelayReads | None, reported: Fail | None = None) -> Exception:
    """Turn Spark's job failure into one clear error naming the rank and the cause: the relay's first
    incident (the rank it suspected, cut or gave up on first, with its step) before the
    tasks' errors, which are often symptoms of it (a rank rejected because another was cut).

    The worker's error (reports.WorkerFailure) comes from the relay, which the failing task reported it
    to (FAIL, retryable or not: `reported`, Relay.reported_failure); only when none arrived (the relay unreachable, the
    report lost) from its text form in Spark's error. It is raised as the class the worker raised, or, after an
    incident, as the incident's class (the worker's error is then a symptom; it stays in the message and in
    the error's `worker_failure`)."""
    text = str(exc)
    failure = failure_of(reported) if reported is not None else WorkerFailure.from_text(text)
    cause = None if relay is None else relay.first_cause()
    first = "" if cause is None else f"first cause: {cause.describe()}; "
    if failure is not None:
        return failure.error(first, None if cause is None else incident_class(cause))
    if cause is not None:
        return incident_class(cause)(f"{first}the Spark training job failed: {_first_line(text)}")
    if isinstance(exc, GradshareError):
        return exc
    # Spark failed the task before our code ran (e.g. unpickling the closure): the root cause is the
    # LAST line of the Python traceback in its text; the first lines are Spark's own wrappers.
    tail = text[text.rfind("Traceback (most recent call last)") :]
    causes = _PY_ERROR.findall(tail)
    if causes:
        kind, message = causes[-1]
        return TrainingError(f"the Spark training job failed: {kind}: {message.strip()[:500]}")
    return TrainingError(f"the Spark training job failed: {_first_line(text)}")


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if "Exception" in line or "Error" in line), text[:300]).strip()[
        :500
    ]
