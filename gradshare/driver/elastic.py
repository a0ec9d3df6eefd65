"""An elastic fit (`SharedTrainer(elastic=Elastic(min_workers, max_workers))`): the job follows the cluster.

The fit runs as a sequence of jobs, each one barrier stage at a fixed number of workers. A job ends in
one of three ways:

    finished    the last epoch's step: the fit's result, with every job's history and re-form
    shrink      a task of the stage failed (an executor lost: Spark then fails the whole barrier stage), or
                a rank went silent past its bound. The driver cancels the job, waits at most `slot_wait`
                s for the slots to come back, and starts the next job at the free slots (>= min_workers)
    grow        more slots are free than the job uses, and the log reached an epoch's end: the driver
                cancels the job there and starts the next one larger (<= max_workers)

The next job starts from the relay's parameters as the cancelled job left them: every message the log
applied, so what is lost is the lost rank's step in flight. It runs the interrupted epoch again from its
start on the data partitioned for the new number of workers, so no row of it is skipped (the steps of it
done before are counted as `steps_redone`: their updates are kept and their rows are seen again). Each
rank's residual and optimizer state start fresh, as they do in a retried stage without a checkpoint:
the processes that held them are gone (Spark kills a barrier stage's every task when one fails); the lr
schedule and BatchNorm's batch counters are brought to the whole training's step (worker.py).

Why not Spark's own retry: a barrier stage needs all its slots at once, and Spark waits for them (about
10 minutes with the default barrier checks) before it fails the job, and never uses a slot that arrives.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from gradshare.checks import is_dataframe
from gradshare.config import TrainConfig
from gradshare.config.options import Elastic
from gradshare.driver.collect import regrouped
from gradshare.driver.history import merge_history
from gradshare.driver.job import RddJob
from gradshare.driver.records import Prepared, RunPlan, Started
from gradshare.driver.reform import JobStart, Reformed, Restart, Retry, Stop, shifted
from gradshare.driver.result import FitResult
from gradshare.driver.session import busy_slots, is_connect, total_slots
from gradshare.errors import TrainingError

SLOTS_EVERY = 2.0  # s between counts of the cluster's free slots (a JVM call each)
POLL = 0.5  # s between slot counts while a re-formed job waits for slots
STEADY = 1.0  # s between the two equal slot counts a re-form takes as the cluster's size


def check_elastic(config: TrainConfig, data: object) -> None:
    """What an elastic fit needs, refused before any Spark job, naming the option."""
    if is_dataframe(data) and is_connect(data):
        raise ValueError(
            "elastic= needs a classic Spark session: a Spark Connect client cannot count the cluster's "
            "free task slots or see a task fail; train without elastic= there"
        )
    if config.network.relay == "in-job":
        raise ValueError(
            "elastic= needs relay='client' (or 'auto' on a classic session): the relay's parameters "
            "are what a re-formed job starts from, and a relay in a task dies with the stage"
        )
    if config.compression.staleness:
        raise ValueError(
            f"elastic= needs staleness=0 (a re-formed job starts at an epoch's start with the whole "
            f"log applied); got staleness={config.compression.staleness}"
        )


def free_slots(sc: Any) -> int:
    return max(total_slots(sc) - busy_slots(sc), 0)


def slots_for(sc: Any, elastic: Elastic, wanted: int, wait: float, timeout: float, reform: bool = True) -> int:
    """The workers the next job gets: `wanted` (capped at max_workers) once that many slots are free within
    `wait` s; otherwise as many as are free then, once at least min_workers are (within `timeout` s more);
    else a clear error naming both numbers. `reform`: after a job was cancelled (the count settles first)."""
    wanted = min(wanted, elastic.max_workers)
    start = time.monotonic()
    if reform:
        steady(sc)
    while True:
        free = free_slots(sc)
        waited = time.monotonic() - start
        if free >= wanted or (waited >= wait and free >= elastic.min_workers):
            return min(free, wanted)
        if waited >= wait + timeout:
            raise ValueError(
                f"elastic fit: {free} free task slot(s) after {waited:.0f} s, below min_workers="
                f"{elastic.min_workers} (master {sc.master!r} has {total_slots(sc)} slots)"
            )
        time.sleep(POLL)


def steady(sc: Any, bound: float = 10.0) -> None:
    """Until the cluster's slot count is the same on two counts STEADY s apart (at most `bound` s): an
    executor that was lost leaves Spark's count a moment after its task failed, and a job started on it
    would fail again."""
    deadline = time.monotonic() + bound
    last = total_slots(sc)
    while time.monotonic() < deadline:
        time.sleep(STEADY)
        now = total_slots(sc)
        if now == last:
            return
        last = now


class Watch:
    """run_stage's watch for one job: a `Stop` when a task failed, a rank is given up, or (every
    SLOTS_EVERY s) slots are free for a larger job and the log just reached an epoch's end. Notes when the
    job's first step completed, which is what a re-form cost in seconds ends at."""

    def __init__(
        self,
        job: RddJob,
        relay: Any,
        run: RunPlan,
        elastic: Elastic,
        world: int,
        after: dict[str, Any] | None = None,
        verbose: int = 0,
    ) -> None:
        """`after`: the re-form this job follows (its "seconds" are set at this job's first step)."""
        self.job, self.relay, self.elastic, self.world = job, relay, elastic, world
        self.after, self.verbose = after, verbose
        self.epoch_steps = max(run.steps_per_epoch)
        self.last_step = run.epochs * self.epoch_steps - 1
        self.slots_at = 0.0
        self.grow_after: int | None = None  # the log step whose epoch end a grow waits for
        self.free_seen = 0  # slot counts in a row that found a free slot
        self.first_step_at: float | None = None
        self.ends = [time.monotonic()]  # when the log completed each epoch of this job (its start first)

    def __call__(self) -> Stop | None:
        now = time.monotonic()
        done = int(self.relay.complete_through)
        if self.first_step_at is None and done >= 0:
            self.first_step_at = now
            if self.after is not None:  # this job follows a re-form: say what it cost
                self.after["seconds"] = round(now - float(self.after["detected_at"]), 2)
                if self.verbose:
                    print(
                        f"gradshare: {self.world} workers took their first step {self.after['seconds']:.1f} s "
                        f"after the {self.after['kind']} was detected",
                        flush=True,
                    )
        while (done + 1) // self.epoch_steps >= len(self.ends):  # an epoch of the log completed
            self.ends.append(now)
        failed = self._failed_tasks()
        if failed:
            return Stop("shrink", f"{failed} task(s) of the stage failed (an executor lost?)", now)
        given_up = self.relay.fatal_incident()
        if given_up is not None:
            return Stop("shrink", given_up.describe(), now)
        if self.world >= self.elastic.max_workers or done < 0:
            return None
        if now - self.slots_at >= SLOTS_EVERY:
            self.slots_at = now
            # two counts in a row: an executor being removed or registered counts for a moment
            free = self._spare()
            self.free_seen = self.free_seen + 1 if free > 0 else 0
            end = (done // self.epoch_steps + 1) * self.epoch_steps - 1  # the end of the epoch the log is in
            if self.grow_after is None and self.free_seen >= 2 and end < self.last_step:
                self.grow_after = end
        if self.grow_after is not None and done >= self.grow_after and self.free_seen >= 2:
            if self._spare() > 0:  # still there: a grow never re-forms at the same size
                return Stop("grow", "free task slots at an epoch's end", now)
            self.grow_after, self.free_seen = None, 0
        return None

    def seconds(self, epoch: int) -> float:
        """How long the log took over this job's `epoch` (0.0: it ended after the watch last looked)."""
        return round(self.ends[epoch + 1] - self.ends[epoch], 3) if epoch + 1 < len(self.ends) else 0.0

    def _spare(self) -> int:
        """Slots neither this job (its `world` tasks, whatever Spark's status tracker says of them yet: it
        counts a task active only once its start event was processed, seconds late under load) nor another
        job's running tasks take."""
        ours = self._stages()
        if ours is None:
            return 0
        tracker = self.job.spark_context.statusTracker()
        others = sum(
            info.numActiveTasks
            for s in tracker.getActiveStageIds()
            if s not in ours and (info := tracker.getStageInfo(s)) is not None
        )
        return max(int(total_slots(self.job.spark_context)) - self.world - int(others), 0)

    def _failed_tasks(self) -> int:
        """Tasks of this job's stages that failed, or 1 for a stage Spark already runs again after a failure."""
        tracker = self.job.spark_context.statusTracker()
        infos = [tracker.getStageInfo(s) for s in self._stages() or ()]
        return sum(max(info.numFailedTasks, int(info.currentAttemptId > 0)) for info in infos if info is not None)

    def _stages(self) -> set[int] | None:
        """The stage ids of this job's Spark jobs (its job group); None before the job is submitted."""
        if not self.job.group:
            return None
        tracker = self.job.spark_context.statusTracker()
        return {
            s
            for j in tracker.getJobIdsForGroup(self.job.group)
            if (info := tracker.getJobInfo(j)) is not None
            for s in info.stageIds
        }


class ElasticRuns:
    """The jobs of an elastic fit (driver/loop.py): each at the cluster's size, re-formed from the relay's
    state when its watch stops it, at most max_reforms times; the result's history, steps and re-forms are
    the whole training's."""

    relay = "client"
    restarts: tuple[dict[str, str | None], ...] = ()

    def __init__(self, config: TrainConfig, data: object, resume_from: str | None) -> None:
        elastic = config.elastic
        assert elastic is not None  # the loop builds this for an elastic fit only
        check_elastic(config, data)
        self.config, self.elastic, self.resume_from = config, elastic, resume_from
        self.sc = _spark_context(data)
        # a cluster master's executors may still be registering; a local master's slots are all there
        settle = 0.0 if str(self.sc.master).startswith("local") else config.fault_tolerance.timeout
        self.start_world = config.num_workers or slots_for(self.sc, elastic, elastic.max_workers, 0.0, settle, False)
        self.world = self.start_world
        self.rows: list[dict[str, Any]] = []  # the finished epochs of the jobs before this one
        self.reforms: list[dict[str, Any]] = []
        self.steps_before = 0  # the log steps the jobs before this one completed (their work, redone or not)
        self.watching: Watch | None = None

    def first(self) -> JobStart:
        return self._start(self.resume_from, None)

    def _start(self, resume: str | None, restart: Restart | None) -> JobStart:
        batch = self.elastic.batch_size(self.config.batch_size, self.start_world, self.world)
        return JobStart(replace(self.config, num_workers=self.world, batch_size=batch), resume, restart)

    def planned(self, prep: Prepared, start: JobStart) -> None:
        if start.resume_from is not None:  # a resume_from at another world size is the first re-form
            self.reforms += [{**r, "detected_at": None} for r in regrouped(prep.resume, self.world)]

    def watch(self, prep: Prepared, started: Started, run: RunPlan) -> Watch:
        assert isinstance(prep.job, RddJob)  # check_elastic: a classic session (a DataFrame runs on its RDD)
        reforms = self.reforms
        after = reforms[-1] if reforms and reforms[-1]["detected_at"] is not None else None
        self.watching = Watch(prep.job, started.relay, run, self.elastic, self.world, after, self.config.verbose)
        return self.watching

    def after(self, end: Retry | Reformed, prep: Prepared, run: RunPlan) -> JobStart:
        assert isinstance(end, Reformed) and self.watching is not None  # a client relay's job: no Retry
        elastic, stop, left, watch = self.elastic, end.stop, end.left, self.watching
        if len(self.reforms) >= elastic.max_reforms:
            raise TrainingError(
                f"elastic fit: {len(self.reforms) + 1} re-forms, more than max_reforms="
                f"{elastic.max_reforms} (an executor that keeps being lost and coming back?); the last: {stop}"
            )
        spe = watch.epoch_steps
        # (a job lost after its last step runs its last epoch again: a job has at least one epoch)
        local_done = min((left.complete_through + 1) // spe, run.epochs - 1)
        epochs_done = run.first_epoch + local_done
        finished, _ = merge_history([], left.tallies, run.steps_per_epoch, local_done)
        # a cancelled job's rows come from the relay's tally; their seconds from the watch's clock
        self.rows += [
            replace(
                row,
                epoch=row.epoch + run.first_epoch,
                loss_fn=prep.plan.name,
                workers=self.world,
                seconds=watch.seconds(row.epoch),
            ).as_dict()
            for row in finished
        ]
        # a shrink waits for the lost slot to come back; a grow takes what is free
        wanted = elastic.max_workers if stop.kind == "grow" else self.world
        wait = elastic.slot_wait if stop.kind == "shrink" else 0.0
        new_world = slots_for(self.sc, elastic, wanted, wait, self.config.fault_tolerance.timeout)
        self.reforms.append(
            {
                "kind": stop.kind,
                "reason": stop.reason,
                "epoch": epochs_done,
                "from": self.world,
                "to": new_world,
                "at_step": left.complete_through,
                "steps_redone": left.complete_through + 1 - local_done * spe,
                "rows_skipped": 0,
                "detected_at": stop.detected_at,
                "seconds": None,
            }
        )
        if self.config.verbose:
            last = self.reforms[-1]
            print(
                f"gradshare: re-forming at epoch {epochs_done}, log step {last['at_step']} ({stop.kind}: "
                f"{stop.reason}): {self.world} -> {new_world} workers, {last['steps_redone']} steps of the "
                "epoch run again, 0 rows skipped",
                flush=True,
            )
        restart = Restart(left.params, epochs_done, run.step_cap, shifted(left.notes, run.first_epoch - epochs_done))
        self.steps_before += left.complete_through + 1
        self.world = new_world
        return self._start(None, restart)

    def finish(self, result: FitResult) -> FitResult:
        result.history = self.rows + [{**row, "workers": self.world} for row in result.history]
        result.steps += self.steps_before  # the whole training's, not the last job's alone
        reforms = [{k: v for k, v in r.items() if k != "detected_at"} for r in self.reforms]
        result.extra = replace(result.extra, reforms=reforms)
        return result


def _spark_context(data: object) -> Any:
    if is_dataframe(data):
        return data.sparkSession.sparkContext
    return data.context  # type: ignore[attr-defined]
