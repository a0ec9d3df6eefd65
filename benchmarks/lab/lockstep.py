"""In-process lock-step N-worker training with the real Worker, ApplyLog and codec (no Spark, no UDP):
the engine of `python benchmarks/scaling.py`, and the cheap way to compare τ rules, densities and aggregation
per epoch before the full `python benchmarks/convergence.py`. Also a dense DDP reference in the same process:
one model, the mean loss of the N ranks' batches (the same shards and batch order as the workers), one
Adam step.

    python benchmarks/lockstep.py '{"workload": "mlp", "world": 2, "epochs": 12, "schedule": "constant"}'
    python benchmarks/lockstep.py '{"system": "ddp", "lr": 2e-3}'

Keys (all optional): workload, world, epochs, seed, lr, schedule, batch, system ("gradshare" | "ddp" |
"local": the dense equivalent of gradshare's design, each worker's own optimizer, the updates summed or
averaged by scale), rule ({"kind": "auto" | "adaptive" | "fixed", ...the rule's arguments}), scale (-1:
aggregate="mean"), view (local_view, default true), folded (the view folded into one buffer where it
applies, default true; false: the two-buffer view, local_view.py), device (the workers' device, default
"cpu"; gradshare only), follow_lr, clip, and three experiments: decay (multiply every residual by it after each step)
and cap (after the warm-up τ may not exceed cap × its value at the warm-up's end), which the lock-step table of
docs/benchmarks/convergence.md measured; step_cap, SharedTrainer's option ("auto", None or a share:
encoding/step_cap.py); lr_batch, SharedTrainer's lr_batch_size (the batch lr was tuned at: the workers'
lr × √(batch ÷ lr_batch), gradshare and "local"); tensor_state (the torch state and codec on the CPU, the
GPU's code path without a GPU); momentum, SharedTrainer's optimizer_momentum ("auto", "off", "keep" or
the most β1 each worker steps with: replica/momentum.py; gradshare only).

Prints one JSON line: test accuracy (%) after every epoch, the mean of the last 3, the payload ratio
(4 bytes × parameters ÷ message bytes per worker-step), silent steps, τ per epoch, and for gradshare
"replicas": how many distinct parameter hashes the N workers hold after the last step (1: one model).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from gradshare import encoding
from gradshare.config import SchedulerFactory, TrainConfig
from gradshare.config.options import OptimizerMomentum, Runtime
from gradshare.driver.plan import clipping, plan_steps
from gradshare.encoding.step_cap import StepCap
from gradshare.hashing import param_hash
from gradshare.replica.flat import FlatParams
from gradshare.task.apply_log import ApplyLog
from gradshare.task.config import DataPlan, JobIdentity, StepRule, UserCode, WorkerConfig
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from gradshare.transport.testing.shared_log import LogPeer, SharedLog
from gradshare.vectors import Vector
from lab.flat_options import in_groups
from lab.systems import adam, lr_scheduler_factory
from lab.workloads import Workload, load, model_factory, test_accuracy


class CappedRule(encoding.CalibratedThreshold):
    def __init__(self, cap: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.cap = cap
        self.ceiling: float | None = None

    def calibrate(self, sample: Vector, step: int, n_params: int) -> float:
        tau = super().calibrate(sample, step, n_params)
        if step >= self.warmup_steps:
            ceiling = self.ceiling = self.cap * tau if self.ceiling is None else self.ceiling
            self.tau = min(tau, ceiling)
        return self.tau


def trainer_options(
    rule: dict[str, Any] | None = None,
    *,
    scale: float = 1.0,
    step_cap: float | str | None = "auto",
    momentum: OptimizerMomentum = "auto",
    lr_batch: int | None = None,
    follow_lr: bool = True,
    view: bool = True,
    clip: float = 5.0,
) -> dict[str, Any]:
    """The SharedTrainer options a lock-step run's keys stand for (`rule`: {"kind": "auto" | "adaptive" |
    "fixed", and SharedTrainer's density, warmup_density, decay_from or threshold}); ValueError naming a
    rule key that is no SharedTrainer option."""
    spec = dict(rule or {"kind": "auto"})
    kind = spec.pop("kind", "auto")
    options: dict[str, Any] = {
        "step_cap": step_cap,
        "optimizer_momentum": momentum,
        "lr_batch_size": lr_batch,
        "follow_lr": follow_lr,
        "local_view": bool(view),
        "residual_clip": clip or None,
        "aggregate": "mean" if scale < 0 else "sum",
    }
    keys = {"auto": ("density", "warmup_density", "decay_from"), "fixed": ("threshold",), "adaptive": ("threshold",)}
    if kind not in keys or set(spec) - set(keys[kind]):
        raise ValueError(
            f"rule {rule!r}: the kind is one of {sorted(keys)}, with the SharedTrainer options {keys.get(kind, ())}"
        )
    if kind != "auto":
        options["threshold_algorithm"] = kind
    return {**options, **spec}


def run(
    workload: str = "mlp",
    world: int = 2,
    epochs: int = 12,
    seed: int = 0,
    rule: dict[str, Any] | None = None,
    lr: float = 1e-3,
    schedule: str = "constant",
    batch: int = 64,
    system: str = "gradshare",
    scale: float = 1.0,
    follow_lr: bool = True,
    clip: float = 5.0,
    decay: float = 1.0,
    cap: float | None = None,
    view: bool = True,
    folded: bool = True,
    device: str = "cpu",
    data: Workload | None = None,
    step_cap: float | str | None = "auto",
    lr_batch: int | None = None,
    tensor_state: bool = False,
    momentum: OptimizerMomentum = "auto",
) -> dict[str, Any]:
    """One lock-step run; `data` (the loaded `workload`) saves loading it again for every run."""
    torch.set_num_threads(1)
    wl = data if data is not None else load(workload, seed)
    torch.manual_seed(seed)
    model = model_factory(workload)()
    shards = [wl.shard(r, world) for r in range(world)]
    spe = tuple(math.ceil(len(s[1]) / batch) for s in shards)
    sched = None if schedule == "constant" else lr_scheduler_factory(schedule, max(spe) * epochs)
    config = TrainConfig(
        epochs=epochs,
        batch_size=batch,
        seed=seed,
        **in_groups(
            trainer_options(
                rule,
                scale=scale,
                step_cap=step_cap,
                momentum=momentum,
                lr_batch=lr_batch,
                follow_lr=follow_lr,
                view=view,
                clip=clip,
            )
        ),
    )
    plan = plan_steps(config, world, max(spe))  # what SharedTrainer.fit runs: the same planner
    rule_obj = (
        plan.rule
        if cap is None
        else CappedRule(
            cap, **{k: getattr(plan.rule, k) for k in ("density", "warmup_steps", "warmup_density", "min_entries")}
        )
    )
    flat = FlatParams(copy.deepcopy(model))
    caps = (
        None
        if plan.cap_share is None
        else StepCap.of([p.numel() for p in flat.params], flat.array, plan.cap_share, plan.cap_norm)
    )
    cfg = WorkerConfig(
        job=JobIdentity(("127.0.0.1", 1), bytes(32), 1, world),
        user=UserCode(model=model, optimizer=lambda p: adam(p, lr), loss=nn.CrossEntropyLoss(), lr_scheduler=sched),
        rule=StepRule(
            threshold_rule=rule_obj,
            residual_clip=clipping(config),
            lr_factor=plan.lr_factor,
            momentum_ceiling=plan.momentum_ceiling,
            apply_scale=plan.apply_scale if scale == 1.0 or scale < 0 else scale,  # else: an experiment
            step_cap=caps,
        ),
        data=DataPlan(steps_per_epoch=spe, epochs=epochs, batch_size=batch, seed=seed, label_dtype="int64"),
        compression=replace(config.compression, staleness=0),
        runtime=Runtime(
            device=device, worker_options={"folded_view": bool(folded), "tensor_state": bool(tensor_state)}
        ),
    )
    workers = [Worker(cfg, r, PartitionData(*shards[r])) for r in range(world)]
    taus: list[str] = []
    silent, replicas = 0, None
    if system == "ddp":
        accs, ratio = _run_ddp(model, workers, cfg, wl, lr, sched), 1.0
    elif system == "local":
        accs, ratio = _run_local(model, workers, cfg, wl, lr * cfg.rule.lr_factor, sched), 1.0
    else:
        accs, taus, silent, ratio, replicas = run_workers(
            workers, cfg, lambda m: test_accuracy(m, wl.X_test, wl.y_test), decay
        )
    return {
        "acc": [round(a * 100, 2) for a in accs],
        "final3": round(100 * float(np.mean(accs[-3:])), 2),
        "ratio": round(ratio),
        "silent": silent,
        "taus": taus,
        "n_params": workers[0].flat.n_params,
        "replicas": replicas,
        "device": str(workers[0].flat.buffer.device),
    }


def _run_ddp(
    model: nn.Module, workers: list[Worker], cfg: WorkerConfig, wl: Workload, lr: float, sched: SchedulerFactory | None
) -> list[float]:
    """Dense DDP in one process: one model, the mean loss of the ranks' batches, one Adam step."""
    spe, world = cfg.data.steps_per_epoch, len(workers)
    accs = []
    ddp = copy.deepcopy(model)
    opt = adam(list(ddp.parameters()), lr)
    scheduler = sched(opt) if sched else None
    loss_fn = nn.CrossEntropyLoss()
    for t in range(cfg.final_step + 1):
        epoch, b = divmod(t, spe[0])
        opt.zero_grad(set_to_none=True)
        for w in workers:
            *x, y = w.batches.read(epoch, b)
            (loss_fn(ddp(*x), y) / world).backward()
        opt.step()
        if scheduler:
            scheduler.step()
        if (t + 1) % spe[0] == 0:
            accs.append(test_accuracy(ddp, wl.X_test, wl.y_test))
    return accs


def _run_local(
    model: nn.Module, workers: list[Worker], cfg: WorkerConfig, wl: Workload, lr: float, sched: SchedulerFactory | None
) -> list[float]:
    """The design without compression: every worker steps its own optimizer (DESIGN.md: local optimizer
    state, the post-updater update) from the shared parameters on its own batch, and the updates are
    combined densely by "sum" (scale 1) or "mean" (scale -1): what gradshare would do with no τ at all."""
    spe, world = cfg.data.steps_per_epoch, len(workers)
    accs = []
    shared = copy.deepcopy(model)
    local = [copy.deepcopy(model) for _ in range(world)]
    opts = [adam(list(m.parameters()), lr) for m in local]
    scheds = [sched(o) for o in opts] if sched else []
    loss_fn = nn.CrossEntropyLoss()
    for t in range(cfg.final_step + 1):
        epoch, b = divmod(t, spe[0])
        total = [torch.zeros_like(p) for p in shared.parameters()]
        for w, m, opt in zip(workers, local, opts):
            with torch.no_grad():
                for pm, ps in zip(m.parameters(), shared.parameters()):
                    pm.copy_(ps)
            opt.zero_grad(set_to_none=True)
            *x, y = w.batches.read(epoch, b)
            loss_fn(m(*x), y).backward()
            opt.step()
            with torch.no_grad():
                for acc, pm, ps in zip(total, m.parameters(), shared.parameters()):
                    acc.add_(pm - ps)
        with torch.no_grad():
            for acc, ps in zip(total, shared.parameters()):
                ps.add_(acc, alpha=cfg.rule.apply_scale)
        for s in scheds:
            s.step()
        if (t + 1) % spe[0] == 0:
            accs.append(test_accuracy(shared, wl.X_test, wl.y_test))
    return accs


def run_workers(
    workers: list[Worker], cfg: WorkerConfig, evaluate: Callable[[nn.Module], float], decay: float = 1.0
) -> tuple[list[float], list[str], int, float, int]:
    """The real workers and apply logs over a shared list: (rank 0's model scored by `evaluate` after
    every epoch, τ per epoch, silent steps, ratio, distinct replicas at the end: 1 = every worker holds
    the same bits)."""
    spe, world = cfg.data.steps_per_epoch, len(workers)
    accs, taus, nbytes, silent, steps = [], [], 0, 0, 0
    log = SharedLog(world)
    peers = [LogPeer(log, r) for r in range(world)]
    logs = [
        ApplyLog(peers[r], w.flat, 0, 10.0, scale=cfg.rule.apply_scale, cap=cfg.rule.step_cap)
        for r, w in enumerate(workers)
    ]
    for w, apply_log in zip(workers, logs):
        w.log = apply_log
    for t in range(cfg.final_step + 1):
        for r, w in enumerate(workers):
            if t >= cfg.total_steps(r):
                continue
            logs[r].apply_through(t - 1)
            _, entries, nb = w.step(peers[r], t)
            if decay != 1.0:  # experiment: leaky error feedback
                w.state.rescale(decay)
            nbytes += nb
            silent += entries == 0
            steps += 1
        if (t + 1) % spe[0] == 0:
            logs[0].apply_through(t)
            accs.append(evaluate(workers[0].model))
            taus.append(f"{workers[0].state.tau:.1e}")
    for apply_log in logs:  # every rank through the last step: the replicas must be one model
        apply_log.apply_through(cfg.final_step)
    replicas = len({param_hash(w.flat.host_state()) for w in workers})
    return accs, taus, silent, 4 * workers[0].flat.n_params / (nbytes / steps), replicas


def main(runner: Callable[..., dict[str, Any]] = run) -> None:
    """One run of `runner` with the JSON keys of the first argument; one JSON line out."""
    spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    t0 = time.time()
    out = runner(**spec)
    print(json.dumps({"spec": spec, **out, "sec": round(time.time() - t0)}), flush=True)
