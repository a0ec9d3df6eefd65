"""The fit's barrier stage, run from the driver: Spark's collect blocks, so it runs on a thread while the
driver follows the relay (a progress bar; a worker's reported error or a rank the relay gave up on
cancels the job at once instead of waiting out Spark's stage retries).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tqdm.auto import tqdm

from gradshare.driver.failures import RelayReads, driver_error, incident_error, reported_error
from gradshare.driver.job import FrameJob, RddJob
from gradshare.driver.reform import Stop
from gradshare.reports import EpochLine, Progress, WorkerReport
from gradshare.task.config import WorkerConfig


def run_stage(
    job: RddJob | FrameJob,
    cfg: WorkerConfig,
    relay: RelayReads,
    window: float,
    verbose: int,
    lines: Callable[[], list[EpochLine]] | None = None,
    watch: Callable[[], Stop | None] | None = None,
) -> list[WorkerReport] | Stop:
    """Run the barrier stage in a thread (Spark's collect blocks) while the bar follows the relay, and
    prints each finished epoch of `lines` (the applied log's). `watch`: called as often, before the
    failure checks; a `Stop` it returns cancels the job, which then returns it (an elastic fit's re-form,
    elastic.py)."""
    # what the job's thread leaves: collect's list, or the error it raised
    collected: list[list[WorkerReport]] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            collected.append(job.collect(cfg))
        except BaseException as e:  # noqa: BLE001 - handed to the driver thread below
            errors.append(e)

    thread = job.thread(target)
    t_job = time.monotonic()
    thread.start()
    bar = ProgressBar(
        cfg.final_step + 1,
        enabled=verbose > 0,
        first_epoch=cfg.data.first_epoch,
        scored=cfg.data.validation is not None or cfg.data.shards,
        lines=lines,
    )
    try:
        while thread.is_alive():
            thread.join(0.25)
            bar.update(relay.progress())
            stop = None if watch is None else watch()
            if stop is not None:
                cancel(job, thread)
                return stop
            failed = relay.failure()
            if failed is not None:  # a worker's deterministic error: retries would repeat it
                raise reported_error(failed)  # the handler below cancels the job
            given_up = relay.fatal_incident()
            if given_up is not None:  # a rank silent past `timeout`, or stuck past step_timeout
                raise incident_error(given_up)
            job.check_started(relay, time.monotonic() - t_job, window)  # FrameJob: slots it could not count
    except BaseException:
        cancel(job, thread)
        raise
    finally:
        bar.close()
    if errors:
        failed = relay.failure()  # a task fails only after its FAIL was acknowledged (or given up)
        if failed is not None:
            raise reported_error(failed) from errors[0]
        raise driver_error(errors[0], relay, relay.reported_failure()) from errors[0]
    return collected[0]


def cancel(job: RddJob | FrameJob, thread: threading.Thread) -> None:
    """Cancel the job and wait (at most CANCEL_WAIT s each) for its thread and its tasks to be gone."""
    job.cancel()
    thread.join(CANCEL_WAIT)
    job.settle(CANCEL_WAIT)


CANCEL_WAIT = 30.0  # s: a cancelled job's collect thread returns, and its tasks end, within this
LINES_EVERY = 1.0  # s between reads of the finished epochs (the client relay's tallies take its lock)


class ProgressBar:
    """tqdm on the driver: step (the relay's complete_through + 1), loss, sparsity, τ, KB/step; and a line
    per finished epoch (its mean loss, and its score with validation, once rank 0's score came or the
    next epoch finished), from `lines`."""

    def __init__(
        self,
        total: int,
        enabled: bool,
        first_epoch: int = 0,
        scored: bool = False,
        lines: Callable[[], list[EpochLine]] | None = None,
    ) -> None:
        self.bar: tqdm | None = None
        if enabled:
            self.bar = tqdm(total=total, desc="gradshare", unit="step")
        self.first_epoch, self.scored, self.lines = first_epoch, scored, lines
        self.printed = -1  # the last epoch printed
        self.read_at = 0.0

    def update(self, progress: Mapping[str, Any]) -> None:
        """`progress`: Relay.progress(); each rank's latest step summary is the worker's `Progress`."""
        if self.bar is None or not progress:
            return
        if self.lines is not None and time.monotonic() - self.read_at >= LINES_EVERY:
            self.read_at = time.monotonic()
            self._print(self.lines(), final=False)
        done = int(progress.get("complete_through", -1)) + 1
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        ranks = (progress.get("ranks") or {}).values()
        latest = [p for r in ranks if isinstance(r, dict) and (p := Progress.from_meta(r.get("meta"))) is not None]
        if latest:

            def mean(values: list[float | None]) -> float:
                vals = [v for v in values if v is not None]
                return sum(vals) / len(vals) if vals else float("nan")

            self.bar.set_postfix(
                loss=f"{mean([p.loss for p in latest]):.4f}",
                sparsity=f"{mean([p.sparsity for p in latest]):.2e}",
                tau=f"{mean([p.tau for p in latest]):.2e}",
                kb_step=f"{mean([p.bytes for p in latest]) / 1024:.2f}",
                refresh=False,
            )

    def _print(self, lines: list[EpochLine], final: bool) -> None:
        assert self.bar is not None
        finished = {line.epoch for line in lines}
        for line in lines:
            if line.epoch <= self.printed:
                continue
            waiting = self.scored and line.val_metric is None and line.epoch + 1 not in finished
            if waiting and not final:
                break
            score = "" if line.val_metric is None else f", val_metric {line.val_metric:.4f}"
            self.bar.write(f"epoch {line.epoch + self.first_epoch}: loss {line.loss:.4f}{score}")
            self.printed = line.epoch

    def close(self) -> None:
        if self.bar is not None:
            if self.lines is not None:
                self._print(self.lines(), final=True)
            self.bar.close()
