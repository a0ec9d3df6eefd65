"""Lock-step N-worker training of the language models of `lab/lm_models.py` (the Hugging Face Llama and
GPT-2, and the lm study's own "tiny"), with the real Worker, ApplyLog and codec in one process, the step rule
from the planner `fit` runs (driver/plan.py), and the DDP equivalent beside it: one model, each step the mean
loss of the N ranks' batches (the same shards and batch order as the workers), one clipped AdamW step.

    python benchmarks/lockstep.py '{"lm": "llama", "world": 4}'
    python benchmarks/lockstep.py '{"lm": "gpt2", "world": 2, "system": "ddp", "seed": 1}'

Keys (all optional): lm (a model of lab/lm_models.py's MODELS), world, epochs, seed, rows (training
windows), batch (per worker; default the model's recipe), system ("gradshare" | "ddp"), options (SharedTrainer
options as a dict, e.g. {"optimizer_momentum": "keep"}), scale (an apply scale to try instead of the
planned one: an experiment, not an option). Prints one JSON line: validation loss (nats per token) after
every epoch, the payload ratio, and how many distinct replicas the workers end with.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from gradshare.config import TrainConfig
from gradshare.driver.plan import clipping, plan_steps
from gradshare.encoding.step_cap import StepCap
from gradshare.replica.flat import FlatParams
from gradshare.replica.losses import HookStep, clip_grad_norm
from gradshare.task.config import DataPlan, JobIdentity, StepRule, UserCode, WorkerConfig
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from lab.flat_options import in_groups
from lab.lm_models import (
    FACTORIES,
    RECIPES,
    check_transformers,
    lm_data,
    optimizer_for,
    scheduler_factory,
    train_step_for,
)
from lab.lockstep import run_workers


def val_loss(model: nn.Module, step: HookStep, ids: np.ndarray, labels: np.ndarray, batch: int = 128) -> float:
    """Mean validation loss of `step` over the windows `ids` with their next tokens `labels` (every window
    the same length: a mean of batch means weighted by rows is the per-token mean)."""
    total = 0.0
    model.eval()
    with torch.no_grad():
        for b in range(0, len(ids), batch):
            part = (torch.from_numpy(ids[b : b + batch]), torch.from_numpy(labels[b : b + batch]))
            total += float(step(model, part)) * len(part[0])
    model.train()
    return total / len(ids)


def run(
    lm: str = "llama",
    world: int = 2,
    epochs: int | None = None,
    seed: int = 0,
    rows: int | None = None,
    batch: int | None = None,
    system: str = "gradshare",
    options: dict[str, Any] | None = None,
    scale: float | None = None,
) -> dict[str, Any]:
    check_transformers(lm)
    torch.set_num_threads(1)
    recipe = RECIPES[lm]  # what a key leaves out
    batch, epochs = batch or recipe.batch, epochs or recipe.epochs
    ids, labels, v_ids, v_labels = lm_data(seed, rows or recipe.rows)
    n = len(ids)
    shards = [
        (ids[r * n // world : (r + 1) * n // world], labels[r * n // world : (r + 1) * n // world])
        for r in range(world)
    ]
    spe = tuple(math.ceil(len(s[0]) / batch) for s in shards)
    torch.manual_seed(seed)
    model = FACTORIES[lm]()
    step = HookStep(train_step_for(lm))
    config = TrainConfig(epochs=epochs, batch_size=batch, seed=seed, **in_groups(options or {}))
    plan = plan_steps(config, world, max(spe))  # what SharedTrainer.fit runs: the same planner
    flat = FlatParams(copy.deepcopy(model))
    caps = (
        None
        if plan.cap_share is None
        else StepCap.of([p.numel() for p in flat.params], flat.array, plan.cap_share, plan.cap_norm)
    )
    cfg = WorkerConfig(
        job=JobIdentity(("127.0.0.1", 1), bytes(32), 1, world),
        user=UserCode(
            model=model,
            optimizer=clip_grad_norm(optimizer_for(lm), recipe.clip),
            train_step=step,
            lr_scheduler=scheduler_factory(max(spe) * epochs),
        ),
        rule=StepRule(
            threshold_rule=plan.rule,
            residual_clip=clipping(config),
            lr_factor=plan.lr_factor,
            momentum_ceiling=plan.momentum_ceiling,
            apply_scale=plan.apply_scale if scale is None else scale,
            step_cap=caps,
        ),
        data=DataPlan(steps_per_epoch=spe, epochs=epochs, batch_size=batch, seed=seed, label_dtype="int64"),
        compression=replace(config.compression, staleness=0),
        runtime=config.runtime,
    )
    workers = [Worker(cfg, r, PartitionData(*shards[r])) for r in range(world)]

    def evaluate(m: nn.Module) -> float:
        return val_loss(m, step, v_ids, v_labels)

    if system == "ddp":
        curve, ratio, replicas, taus = run_ddp(model, workers, cfg, step, evaluate, lm), 1.0, None, list[str]()
    else:
        curve, taus, _, ratio, replicas = run_workers(workers, cfg, evaluate)
    return {
        "lm": lm,
        "world": world,
        "system": system,
        "seed": seed,
        "val_loss": [round(v, 4) for v in curve],
        "ratio": round(ratio),
        "taus": taus,
        "replicas": replicas,
        "apply_scale": cfg.rule.apply_scale,
        "momentum_ceiling": cfg.rule.momentum_ceiling,
        "n_params": flat.n_params,
    }


def run_ddp(
    model: nn.Module, workers: list[Worker], cfg: WorkerConfig, step: HookStep, evaluate: Any, lm: str
) -> list[float]:
    """DDP's arithmetic in one process: each step the mean loss of the ranks' batches (a rank whose shard
    is done sits out), the gradient norm clipped, one AdamW step, the schedule stepped."""
    ddp = copy.deepcopy(model)
    params = list(ddp.parameters())
    opt = optimizer_for(lm)(params)
    assert cfg.code.lr_scheduler is not None
    scheduler = cfg.code.lr_scheduler(opt)
    curve = []
    for t in range(cfg.final_step + 1):
        epoch, b = divmod(t, max(cfg.data.steps_per_epoch))
        opt.zero_grad(set_to_none=True)
        ranks = [w for r, w in enumerate(workers) if b < cfg.data.steps_per_epoch[r]]
        for w in ranks:
            (step(ddp, w.batches.read(epoch, b)) / len(ranks)).backward()
        torch.nn.utils.clip_grad_norm_(params, RECIPES[lm].clip)
        opt.step()
        scheduler.step()
        if (t + 1) % max(cfg.data.steps_per_epoch) == 0:
            curve.append(evaluate(ddp))
    return curve
