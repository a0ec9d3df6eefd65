"""`SharedTrainer.fit`'s one loop: a fit is a run of jobs, each the five stages (fit.py) in this order,

    prepare_data -> plan_run -> start_relay -> run_job -> collect_result

(with the relay in the job, `run_in_job` runs the stage and its relay together). A job ends with a value:
an `Outcome` (it finished), `Reformed` (an elastic fit's watch stopped it) or `Retry` (an in-job stage
failed in a way a new run may pass). What comes next is its mode's (`Runs`): a plain fit's one job
(`OneJob`), the in-job relay's runs again (in_job.InJobRuns), or an elastic fit's re-forms
(elastic.ElasticRuns), which turns each end into the next job's start or raises when none is left.

What does not compose yet, and why: an elastic fit with the relay in the job (a re-form needs the relay's
state after the job is cancelled, which lives in a task that is gone then) and with staleness > 0 (the
re-form restarts an epoch from a complete log step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from gradshare.driver.collect import collect_result
from gradshare.driver.elastic import ElasticRuns
from gradshare.driver.fit import plan_run, prepare_data, run_job, start_relay
from gradshare.driver.in_job import InJobRuns, in_job, run_in_job
from gradshare.driver.plan import FitSpec
from gradshare.driver.records import Outcome, Prepared, RunPlan, Started
from gradshare.driver.reform import JobStart, Reformed, Retry, Stop
from gradshare.driver.result import FitResult


class Runs(Protocol):
    """A fit's mode: where its jobs start and what follows each one's end."""

    relay: str  # "client" or "in-job"

    @property
    def restarts(self) -> list[dict[str, str | None]] | tuple[dict[str, str | None], ...]: ...

    def first(self) -> JobStart: ...

    def planned(self, prep: Prepared, start: JobStart) -> None: ...

    def watch(self, prep: Prepared, started: Started, run: RunPlan) -> Callable[[], Stop | None] | None: ...

    def after(self, end: Retry | Reformed, prep: Prepared, run: RunPlan) -> JobStart: ...

    def finish(self, result: FitResult) -> FitResult: ...


class OneJob:
    """A plain fit: one job with the relay in this process; no job of it ends but by finishing or raising."""

    relay = "client"
    restarts: tuple[dict[str, str | None], ...] = ()

    def __init__(self, spec: FitSpec, resume_from: str | None) -> None:
        self.config, self.resume_from = spec.config, resume_from

    def first(self) -> JobStart:
        return JobStart(self.config, self.resume_from)

    def planned(self, prep: Prepared, start: JobStart) -> None:
        pass

    def watch(self, prep: Prepared, started: Started, run: RunPlan) -> None:
        return None

    def after(self, end: Retry | Reformed, prep: Prepared, run: RunPlan) -> JobStart:
        raise AssertionError(f"a plain fit's job ended with {end!r}: it has no watch and no retries")

    def finish(self, result: FitResult) -> FitResult:
        return result


def runs_for(spec: FitSpec, data: object, resume_from: str | None) -> Runs:
    """The mode of a fit: the relay in the job, an elastic fit, or one job."""
    if in_job(spec.config, data):
        return InJobRuns(spec.config, data, resume_from)
    if spec.config.elastic is not None:
        return ElasticRuns(spec.config, data, resume_from)
    return OneJob(spec, resume_from)


def fit_loop(
    spec: FitSpec,
    data: object,
    features_col: str | list[str] | None,
    label_col: str | None,
    resume_from: str | None,
    t_start: float,
) -> FitResult:
    """Run a fit's jobs until one finishes; its result, as the fit's mode completes it."""
    runs = runs_for(spec, data, resume_from)
    start = runs.first()
    while True:
        job = replace(spec, config=start.config)
        prep = prepare_data(job, data, features_col, label_col, start.resume_from, start.restart)
        runs.planned(prep, start)
        run = plan_run(start.config, prep, start.restart)
        end: Outcome | Retry | Reformed
        if runs.relay == "in-job":
            end = run_in_job(job, prep, run)
        else:
            started = start_relay(start.config, prep, run)
            end = run_job(job, prep, run, started, runs.watch(prep, started, run))  # closes the relay
        if isinstance(end, Outcome):
            result = collect_result(prep, run, end, t_start, relay=runs.relay, restarts=list(runs.restarts))
            return runs.finish(result)
        start = runs.after(end, prep, run)
