"""A WorkerConfig for the tests that run a Worker by hand, from the few fields each sets, named flat
(``worker_config(world_size=2, staleness=1, precision="bf16-mixed")``): each goes to its record or group,
the rest are a one-worker job's defaults."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from gradshare.config.options import Compression, FaultTolerance, Network, Runtime
from gradshare.task.config import DataPlan, JobIdentity, StepRule, UserCode, WorkerConfig

FLAGS = ("profile", "direct_update", "tensor_state", "step_in_backward", "folded_view")
RUNTIME = {"scheduler_interval": "scheduler_interval", "precision": "precision", "device": "device"}
DEFAULTS: dict[str, Any] = {
    "relay_address": ("127.0.0.1", 1),
    "key": bytes(32),
    "job_id": 1,
    "world_size": 1,
    "residual_clip": None,
    "seed": 0,
    "label_dtype": "int64",
    "staleness": 0,
}


def _names(record: type) -> set[str]:
    return {f.name for f in fields(record) if f.init}


def worker_config(**given: Any) -> WorkerConfig:
    options = {**DEFAULTS, **given}
    taken: set[str] = set()

    def part(record: type) -> dict[str, Any]:  # the records first: a group's field of the same name is the option
        names = (_names(record) & set(options)) - taken
        taken.update(names)
        return {k: options[k] for k in names}

    job, user, rule, data = (part(r) for r in (JobIdentity, UserCode, StepRule, DataPlan))
    compression, network, fault = (part(g) for g in (Compression, Network, FaultTolerance))
    runtime = {k: options[k] for k in RUNTIME if k in options}
    flags = {k: options[k] for k in FLAGS if k in options and options[k] is not None}
    taken.update(runtime, (k for k in FLAGS if k in options))
    top = part(WorkerConfig)
    unknown = sorted(set(options) - taken)
    if unknown:
        raise TypeError(f"worker_config: no field {unknown}")
    return WorkerConfig(
        **{
            **top,
            "job": JobIdentity(**job),
            "user": UserCode(**user),
            "rule": StepRule(**rule),
            "data": DataPlan(**data),
            "compression": Compression(**compression),
            "network": Network(**network),
            "fault_tolerance": FaultTolerance(**fault),
            "runtime": Runtime(**runtime, worker_options=flags or None),
        }
    )
