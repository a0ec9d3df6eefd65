"""The frozen records the fit's stages (fit.py) hand each other: what `prepare_data` leaves (Prepared), what
`plan_run` decides (RunPlan), the relay `start_relay` runs (Started) and what `run_job` brings back (Outcome)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import nn

from gradshare.config import Metric
from gradshare.driver.checkpoint import Manifest, Stores
from gradshare.driver.history import Tallies
from gradshare.driver.job import FrameJob, RddJob
from gradshare.driver.plan import StepPlan
from gradshare.encoding import ResidualClipping
from gradshare.encoding.aggregate import AggregateState
from gradshare.encoding.step_cap import StepCap
from gradshare.replica.flat import FlatParams
from gradshare.replica.losses import LossPlan
from gradshare.reports import Counters, WorkerReport
from gradshare.task.batches import InputLayout
from gradshare.task.config import CheckpointPlan
from gradshare.task.partition import PartitionSummary
from gradshare.transport import Relay
from gradshare.transport.protocol.events import Incident


@dataclass(frozen=True)
class Prepared:
    """What `prepare_data` leaves: the job, the pre-pass's checked layout, the model and its loss plan."""

    job: RddJob | FrameJob
    summaries: list[PartitionSummary]
    load_seconds: float  # the slowest partition's read in the pre-pass
    features: InputLayout
    model: nn.Module
    plan: LossPlan
    validation: tuple[tuple[np.ndarray, ...], np.ndarray] | None  # the in-memory pair, as arrays
    shards: bool  # validation shards are zipped into the training rows
    metric: Metric | None
    stores: Stores
    resume: Manifest | None


@dataclass(frozen=True)
class RunPlan:
    """What `plan_run` decides: the shared state, the steps, the rule, checkpoints and forwarding."""

    flat: FlatParams
    initial: np.ndarray  # the relay's first state: the model's, or the resumed checkpoint's
    shipped: nn.Module  # the model's skeleton (meta tensors) that the job ships
    drop_last: str
    steps_per_epoch: tuple[int, ...]
    steps: StepPlan  # the step rule: τ, the cap's share, the momentum, the apply scale, the lr factor
    clip: ResidualClipping | None
    saving: CheckpointPlan | None
    first_epoch: int
    epochs: int
    forwarding: str
    aggregator: AggregateState | None
    step_cap: StepCap | None = None  # the step cap (encoding/step_cap.py), None: none
    inherited: tuple[tuple[str, float], ...] = ()  # a re-formed job's: rank 0's early-stopping state


@dataclass(frozen=True)
class Started:
    """The running relay, the job's key and id, and the host the workers reach the driver at."""

    relay: Relay
    key: bytes
    job_id: int
    host: str


@dataclass(frozen=True)
class Outcome:
    """What `run_job` brings back from the stage and the relay."""

    reports: list[WorkerReport]
    final: np.ndarray
    relay_hash: str
    counters: Counters
    tallies: Tallies
    incidents: list[Incident]
    rolled_back: list[dict[str, int]]
    service_errors: list[str]
    resume: Manifest | None  # with the checkpoint service's address where there is one
    statuses: int | None = None  # relay="in-job": the relay's statuses this process received


__all__ = ["Outcome", "Prepared", "RunPlan", "Started"]
