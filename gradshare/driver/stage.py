"""The fit's barrier stage, run from the driver: Spark's collect blocks, so it runs on a thread while the
driver follows the relay (a progress bar; a worker's reported error or a rank the relay gave up on
cancels the job at once instead of waiting out Spark's stage retries).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tqdm.auto import tqdm

from gradshare.driver.failures import RelayReads, driver_error, incident_error, reported_error
from gradshare.driver.job import FrameJob, RddJob
from gradshare.reports import Progress, WorkerReport
from gradshare.task.config import WorkerConfig


def run_stage(job: RddJob | FrameJob, cfg: WorkerConfig, relay: RelayReads, window: float, verbose: int) -> list[WorkerReport]:
    """Run the barrier stage in a thread (Spark's collect blocks) while the bar follows the relay."""
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
    bar = ProgressBar(cfg.final_step + 1, enabled=verbose > 0)
    try:
        while thread.is_alive():
            thread.join(0.25)
            bar.update(relay.progress())
            failed = relay.failure()
            if failed is not None:  # a worker's deterministic error: retries would repeat it
                raise reported_error(failed)  # the handler below cancels the job
            given_up = relay.fatal_incident()
            if given_up is not None:  # a rank silent past `timeout`, or stuck past step_timeout
                raise incident_error(given_up)
            job.check_started(relay, time.monotonic() - t_job, window)  # FrameJob: slots it could not count
    except BaseException:
        job.cancel()
        thread.join(30.0)
        job.settle(30.0)
        raise
    finally:
        bar.close()
    if errors:
        failed = relay.failure()  # a task fails only after its FAIL was acknowledged (or given up)
        if failed is not None:
            raise reported_error(failed) from errors[0]
        raise driver_error(errors[0], relay, relay.reported_failure()) from errors[0]
    return collected[0]



class ProgressBar:
    """tqdm on the driver: step (the relay's complete_through + 1), loss, sparsity, τ, KB/step."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: tqdm | None = None
        if enabled:
            self.bar = tqdm(total=total, desc="gradshare", unit="step")

    def update(self, progress: Mapping[str, Any]) -> None:
        """`progress`: Relay.progress(); each rank's latest step summary is the worker's `Progress`."""
        if self.bar is None or not progress:
            return
        done = int(progress.get("complete_through", -1)) + 1
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        ranks = (progress.get("ranks") or {}).values()
        latest = [p for r in ranks if isinstance(r, dict) and (p := Progress.from_meta(r.get("meta"))) is not None]
        if latest:
            def mean(values: list[float | None]) -> float:
                vals = [v for v in values if v is not None]
                return sum(vals) / len(vals) if vals else float("nan")

            self.bar.set_postfix(loss=f"{mean([p.loss for p in latest]):.4f}",
                                 sparsity=f"{mean([p.sparsity for p in latest]):.2e}",
                                 tau=f"{mean([p.tau for p in latest]):.2e}",
                                 kb_step=f"{mean([p.bytes for p in latest]) / 1024:.2f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

