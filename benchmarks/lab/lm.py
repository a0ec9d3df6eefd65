"""`python benchmarks/lm.py`: a small causal language model, gradshare against DDP.

Models (`--model`, lab/lm_models.py): "tiny", a hand-written `nn.TransformerEncoder` LM with PyTorch's
init, and the Hugging Face "llama" and "gpt2" built from configs with the library's own init (the
`[hf]` extra), each at its recipe (AdamW, a warm-up then a cosine, the gradient norm clipped to 1) on
byte-level text of Python's own standard library sources. Systems, for each N of `--workers` and each seed:
- "gradshare": `SharedTrainer` with N barrier tasks on an embedded `local[N]` Spark (relay on loopback),
  validation loss per epoch from `validation_data` with a (sum, count) metric (`val_loss_sums`); an HF
  model trains through ``train_step=hf_train_step`` (the model computes its own loss);
- "ddp": DDP's arithmetic in one process: the same contiguous shards, each step the mean loss of the N
  ranks' batches, one clipped AdamW step (what DDP's averaged all-reduce gives every rank), so the same
  epochs and global batch as gradshare without N processes on a 2-core machine.
Per epoch: validation loss (nats per token). Checks: gradshare's last-epoch validation loss ≤ DDP's +
`LOSS_SLACK` (mean over seeds) and traffic ≥ `TRAFFIC_TARGET`× less than dense. Writes
bench-lm[-MODEL].json/.png ("tiny" keeps the plain name).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradshare.config.options import FaultTolerance, Network, Runtime
from lab import report
from lab.lm_models import (
    FACTORIES,
    HEADS,
    HF_MODELS,
    LAYERS,
    MODELS,
    RECIPES,
    SEQ,
    TRAIN_MODULES,
    VAL_MODULES,
    VOCAB,
    WARMUP_SHARE,
    WIDTH,
    LmData,
    causal_lm,
    check_transformers,
    hf_train_step,
    lm_data,
    optimizer_for,
    scheduler_factory,
    train_step_for,
    val_loss,
    val_loss_sums,
)
from lab.train import comma_list

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOSS_SLACK = 0.05  # nats: gradshare's validation loss at most this above DDP's
TRAFFIC_TARGET = 100.0
DEFAULTS: dict[str, Any] = {"seeds": "0,1,2", "workers": "2,4"}  # epochs, rows, batch: the model's recipe
QUICK: dict[str, Any] = {"epochs": 1, "seeds": "0", "workers": "2", "rows": 256, "batch_size": 32}
__all__ = ["causal_lm", "lm_data", "SEQ", "VOCAB", "run_ddp", "run_gradshare"]  # the names tests and scripts use


def steps_per_epoch(rows: int, world: int, batch: int) -> int:
    """The longest shard's steps (contiguous shards, the last batch kept short)."""
    return max(math.ceil(((r + 1) * rows // world - r * rows // world) / batch) for r in range(world))


# ------------------------------------------------------------------------------------ systems
def run_ddp(data: LmData, *, workers: int, epochs: int, batch: int, seed: int, model: str = "tiny") -> dict[str, Any]:
    """DDP's step in one process: the mean loss of the N ranks' batches, one clipped AdamW step."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    ids, labels, v_ids, v_labels = data
    net = FACTORIES[model]()
    params = list(net.parameters())
    opt = optimizer_for(model)(params)
    step = train_step_for(model)
    spe = steps_per_epoch(len(ids), workers, batch)
    sched = scheduler_factory(spe * epochs)(opt)
    n = len(ids)
    shards = [(r * n // workers, (r + 1) * n // workers) for r in range(workers)]
    rng = np.random.default_rng(seed)
    curve, t0 = [], time.monotonic()
    for _ in range(epochs):
        orders = [lo + rng.permutation(hi - lo) for lo, hi in shards]
        for b in range(spe):
            opt.zero_grad(set_to_none=True)
            parts = [o[b * batch : (b + 1) * batch] for o in orders]
            parts = [p for p in parts if len(p)]
            for p in parts:
                (step(net, (torch.from_numpy(ids[p]), torch.from_numpy(labels[p]))) / len(parts)).backward()
            torch.nn.utils.clip_grad_norm_(params, RECIPES[model].clip)
            opt.step()
            sched.step()
        curve.append(val_loss(net, v_ids, v_labels))
    return {
        "val_loss": curve,
        "traffic_ratio": 1.0,
        "seconds": time.monotonic() - t0,
        "n_params": sum(p.numel() for p in params),
    }


def run_gradshare(
    spark: SparkSession, data: LmData, *, workers: int, epochs: int, batch: int, seed: int, model: str = "tiny"
) -> dict[str, Any]:
    from gradshare.driver.trainer import SharedTrainer
    from gradshare.replica.losses import clip_grad_norm

    ids, labels, v_ids, v_labels = data
    n = len(ids)
    shards = [
        list(zip(ids[r * n // workers : (r + 1) * n // workers], labels[r * n // workers : (r + 1) * n // workers]))
        for r in range(workers)
    ]
    rdd = spark.sparkContext.parallelize(shards, workers).flatMap(lambda rows: rows)
    total = steps_per_epoch(n, workers, batch) * epochs
    trainer = SharedTrainer(
        FACTORIES[model],
        optimizer=clip_grad_norm(optimizer_for(model), RECIPES[model].clip),
        train_step=hf_train_step if model in HF_MODELS else None,
        lr_scheduler=scheduler_factory(total),
        num_workers=workers,
        port=0,
        batch_size=batch,
        epochs=epochs,
        seed=seed,
        verbose=0,
        validation_data=(v_ids, v_labels),
        metric=val_loss_sums,
        runtime=Runtime(scheduler_interval="step"),
        network=Network(bind="127.0.0.1", advertise_host="127.0.0.1"),
        fault_tolerance=FaultTolerance(timeout=300.0),
    )
    result = trainer.fit(rdd)
    return {
        "val_loss": [h["val_metric"] for h in result.history],
        "traffic_ratio": result.traffic_ratio,
        "seconds": result.seconds,
        "n_params": result.n_params,
        "param_hash": result.param_hash,
    }


# ------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default=None, help=f"comma list of N >= 2 (default {DEFAULTS['workers']})")
    parser.add_argument("--seeds", default=None, help=f"comma list of seeds (default {DEFAULTS['seeds']})")
    parser.add_argument(
        "--model",
        default="tiny",
        choices=MODELS,
        help="tiny (PyTorch init), or Hugging Face's llama / gpt2 (the [hf] extra); default tiny",
    )
    parser.add_argument("--epochs", type=int, default=None, help="default: the model's recipe (tiny 4, HF 2)")
    parser.add_argument("--rows", type=int, default=None, help="training windows (default: tiny 4096, HF 6000)")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per step per worker (tiny 32, HF 16)")
    parser.add_argument("--systems", default="gradshare,ddp", help="comma list of gradshare,ddp")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument(
        "--out-dir", default=None, help="where bench-lm.json/.png go (default docs/; --quick: a temp dir)"
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    base = QUICK if args.quick else DEFAULTS
    ints = {}
    for key, value in (("workers", args.workers), ("seeds", args.seeds)):
        text = value if value is not None else base[key]
        try:
            ints[key] = sorted({int(v) for v in text.split(",") if v.strip()})
        except ValueError:
            raise ValueError(f"--{key} takes a comma list of integers, got {text!r}") from None
    if not ints["workers"] or min(ints["workers"]) < 2:
        raise ValueError(f"--workers must be integers >= 2, got {ints['workers']}")
    model = args.model
    check_transformers(model)
    recipe = RECIPES[model]
    quick = QUICK if args.quick else {}
    cfg = {
        "model": model,
        "workers": ints["workers"],
        "seeds": ints["seeds"],
        "systems": comma_list(args.systems, ("gradshare", "ddp"), "systems"),
        "epochs": args.epochs or quick.get("epochs", recipe.epochs),
        "rows": args.rows or quick.get("rows", recipe.rows),
        "batch_size": args.batch_size or quick.get("batch_size", recipe.batch),
        "quick": bool(args.quick),
    }
    for key in ("epochs", "rows", "batch_size"):
        if cfg[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {cfg[key]}")
    return cfg


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for workers, system in sorted({(r["workers"], r["system"]) for r in rows}):
        group = [r for r in rows if (r["workers"], r["system"]) == (workers, system) and "val_loss" in r]
        last = [r["val_loss"][-1] for r in group]
        out.append(
            {
                "workers": workers,
                "system": system,
                "seeds": [r["seed"] for r in group],
                "mean": [statistics.fmean(c) for c in zip(*(r["val_loss"] for r in group))],
                "last_mean": statistics.fmean(last) if last else None,
                "last_std": statistics.stdev(last) if len(last) > 1 else None,
                "traffic_ratio": statistics.fmean(r["traffic_ratio"] for r in group) if group else None,
                "seconds": statistics.fmean(r["seconds"] for r in group) if group else None,
            }
        )
    return out


def checks(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for workers in sorted({s["workers"] for s in summary}):
        gs = next((s for s in summary if s["workers"] == workers and s["system"] == "gradshare"), None)
        dd = next((s for s in summary if s["workers"] == workers and s["system"] == "ddp"), None)
        if gs and dd and gs["last_mean"] is not None and dd["last_mean"] is not None:
            diff = gs["last_mean"] - dd["last_mean"]
            found.append(
                {
                    "workers": workers,
                    "check": "val loss gradshare − DDP (nats)",
                    "value": diff,
                    "limit": LOSS_SLACK,
                    "met": diff <= LOSS_SLACK,
                }
            )
        if gs and gs["traffic_ratio"] is not None:
            found.append(
                {
                    "workers": workers,
                    "check": "dense ÷ gradshare traffic",
                    "value": gs["traffic_ratio"],
                    "limit": TRAFFIC_TARGET,
                    "met": gs["traffic_ratio"] >= TRAFFIC_TARGET,
                }
            )
    return found


def plot(path: str, summary: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for s in summary:
        ax.plot(
            range(1, len(s["mean"]) + 1),
            s["mean"],
            marker=".",
            label=f"{s['system']} N={s['workers']}",
            color={"gradshare": "tab:green", "ddp": "tab:red"}[s["system"]],
            linestyle="-" if s["workers"] == 2 else "--",
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    report.save_figure(fig, path, title)


def run(args: argparse.Namespace) -> int:
    from lab import systems

    cfg = settings(args)
    out_dir = args.out_dir or (tempfile.mkdtemp(prefix="gradshare-lm-") if cfg["quick"] else "docs/benchmarks/data")
    systems.local_spark_env()
    spark = systems.local_spark(max(cfg["workers"]), "gradshare-bench-lm") if "gradshare" in cfg["systems"] else None
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for seed in cfg["seeds"]:
            data = lm_data(seed, cfg["rows"])
            for workers in cfg["workers"]:
                for system in cfg["systems"]:
                    kw = dict(
                        workers=workers, epochs=cfg["epochs"], batch=cfg["batch_size"], seed=seed, model=cfg["model"]
                    )
                    row = {"system": system, "workers": workers, "seed": seed}
                    try:
                        if system == "ddp":
                            row.update(run_ddp(data, **kw))
                        else:
                            assert spark is not None  # started above whenever gradshare runs
                            row.update(run_gradshare(spark, data, **kw))
                    except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(
                        f"[lm] seed {seed} N={workers} {system}: "
                        + (row.get("error") or f"val loss {row['val_loss']}, {row['seconds']:.0f} s"),
                        flush=True,
                    )
                    rows.append(row)
    finally:
        if spark is not None:
            spark.stop()
    summary = summarise(rows)
    doc: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": report.machine(),
        "command": report.command_line("lm"),
        "config": cfg,
        "recipe": {
            "model": cfg["model"],
            "size": f"{LAYERS} layers, width {WIDTH}, {HEADS} heads, vocab {VOCAB}, T {SEQ}",
            "optimizer": f"AdamW {RECIPES[cfg['model']]}",
            "schedule": f"linear warm-up {WARMUP_SHARE:.0%} of steps, cosine to 0",
            "text": {"train": TRAIN_MODULES, "val": VAL_MODULES},
        },
        "summary": summary,
        "checks": checks(summary),
        "rows": rows,
        "total_seconds": time.monotonic() - t0,
    }
    os.makedirs(out_dir, exist_ok=True)
    name = "bench-lm" if cfg["model"] == "tiny" else f"bench-lm-{cfg['model']}"
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(doc, f, indent=1, default=float)
    plot(os.path.join(out_dir, name + ".png"), summary, f"{doc['date']}, {cfg['model']} LM on stdlib text")
    for s in summary:
        print(
            f"N={s['workers']} {s['system']:<9} seeds {s['seeds']}: last val loss "
            f"{s['last_mean']:.4f} ± {s['last_std'] or 0:.4f}, traffic {s['traffic_ratio']:,.0f}x, {s['seconds']:.0f} s"
        )
    for c in doc["checks"]:
        print(
            f"  N={c['workers']} {c['check']}: {c['value']:.3f} (limit {c['limit']}) {'met' if c['met'] else 'MISSED'}"
        )
    print(f"wrote {out_dir}/{name}.json and .png in {doc['total_seconds']:.0f} s")
    return 0 if all("error" not in r for r in rows) else 1
