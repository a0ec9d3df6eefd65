"""`gradshare bench lm`: a small causal transformer language model, gradshare against DDP.

The model is what people write today: token and position embeddings, `nn.TransformerEncoder` (pre-norm,
GELU) under a causal -inf mask kept as a non-persistent buffer, a linear head giving (B, T, V) logits
against (B, T) next-token labels with the default loss. It trains with AdamW (weight decay 0.1 on the
matrices, betas 0.9/0.95), a linear warm-up over the first 5 % of the steps then a cosine to zero
(a LambdaLR stepped per step) and the gradient norm clipped to 1 (`gradshare.replica.losses.clip_grad_norm`).

The text needs no download: characters of Python's own standard library sources (`TRAIN_MODULES`,
`VAL_MODULES`, ASCII), cut into windows of `SEQ` tokens. Systems, for each N of `--workers` and each seed:
- "gradshare": `SharedTrainer` with N barrier tasks on an embedded `local[N]` Spark (relay on loopback),
  validation loss per epoch from `validation_data` with a (sum, count) metric (`val_loss_sums`);
- "ddp": DDP's arithmetic in one process: the same contiguous shards, each step the mean loss of the N
  ranks' batches, one clipped AdamW step (what DDP's averaged all-reduce gives every rank), so the same
  epochs and global batch as gradshare without N processes on a 2-core machine.
Per epoch: validation loss (nats per token). Checks: gradshare's last-epoch validation loss ≤ DDP's +
`LOSS_SLACK` (mean over seeds) and traffic ≥ `TRAFFIC_TARGET`× less than dense. Writes bench-lm.json/.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sysconfig
import tempfile
import time
from datetime import datetime, timezone
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradshare.bench import report
from gradshare.bench.train import comma_list

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LmData = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (ids, labels, validation ids, its labels)

TRAIN_MODULES = ("argparse", "difflib", "shutil", "pathlib", "functools", "dataclasses", "statistics", "fractions")
VAL_MODULES = ("textwrap", "heapq")
VOCAB, SEQ, WIDTH, LAYERS, HEADS = 128, 64, 96, 2, 4
LR, WEIGHT_DECAY, CLIP, WARMUP_SHARE = 3e-3, 0.1, 1.0, 0.05
LOSS_SLACK = 0.05  # nats: gradshare's validation loss at most this above DDP's
TRAFFIC_TARGET = 100.0
DEFAULTS: dict[str, Any] = {"epochs": 4, "seeds": "0,1,2", "workers": "2,4", "rows": 4096, "batch_size": 32}
QUICK: dict[str, Any] = {"epochs": 1, "seeds": "0", "workers": "2", "rows": 256, "batch_size": 32}


# ------------------------------------------------------------------------------------ data and model
def text_windows(modules: tuple[str, ...], limit: int | None = None) -> np.ndarray:
    """int64 (n, SEQ + 1) windows over the ASCII characters of stdlib modules' sources (others → '?')."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in modules:
        with open(os.path.join(stdlib, name + ".py"), "rb") as f:
            chunks.append(f.read())
    codes = np.frombuffer(b"\n".join(chunks), np.uint8).astype(np.int64)
    codes[codes >= VOCAB] = ord("?")
    n = (len(codes) - 1) // SEQ
    windows = np.lib.stride_tricks.sliding_window_view(codes, SEQ + 1)[: n * SEQ : SEQ]
    return np.ascontiguousarray(windows[:limit])


def lm_data(seed: int, rows: int | None = None) -> LmData:
    """(train ids, train labels, val ids, val labels), (n, SEQ) int64; training windows in a seeded order."""
    train = text_windows(TRAIN_MODULES)
    train = train[np.random.default_rng(seed).permutation(len(train))][:rows]
    val = text_windows(VAL_MODULES, None if rows is None else max(rows // 4, 64))
    return train[:, :-1], train[:, 1:], val[:, :-1], val[:, 1:]


class CausalLM(nn.Module):
    """The benchmark's model: token and position embeddings, pre-norm GELU encoder layers under a causal
    -inf mask kept as a non-persistent buffer, a linear head giving (B, T, VOCAB) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        mask = self.get_buffer("mask")  # typed: nn.Module's attribute reads are Tensor | Module
        out: torch.Tensor = self.head(self.norm(self.blocks(x, mask=mask[:n, :n], is_causal=True)))
        return out


def causal_lm() -> CausalLM:
    """The model factory (module level: Spark pickles it by reference)."""
    return CausalLM()


def adamw(params: Iterable[torch.Tensor]) -> torch.optim.AdamW:
    """AdamW, weight decay on the matrices only (GPT-2's recipe); `run_gradshare` clips the gradient norm."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def warmup_cosine(total_steps: int, step: int) -> float:
    """lr factor: linear warm-up over WARMUP_SHARE of the steps, then a cosine to 0."""
    warm = max(1, round(WARMUP_SHARE * total_steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm))))


def scheduler_factory(total_steps: int) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    def factory(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_cosine, total_steps))

    return factory


def val_loss_sums(out: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(summed next-token cross-entropy, tokens): the validation metric, exact to add across batches."""
    return float(F.cross_entropy(out.flatten(0, -2), labels.flatten(), reduction="sum")), float(labels.numel())


def val_loss(model: nn.Module, ids: np.ndarray, labels: np.ndarray, batch: int = 256) -> float:
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for b in range(0, len(ids), batch):
            s, c = val_loss_sums(model(torch.from_numpy(ids[b : b + batch])), torch.from_numpy(labels[b : b + batch]))
            total, count = total + s, count + c
    model.train()
    return total / count


def steps_per_epoch(rows: int, world: int, batch: int) -> int:
    """The longest shard's steps (contiguous shards, the last batch kept short)."""
    return max(math.ceil(((r + 1) * rows // world - r * rows // world) / batch) for r in range(world))


# ------------------------------------------------------------------------------------ systems
def run_ddp(data: LmData, *, workers: int, epochs: int, batch: int, seed: int) -> dict[str, Any]:
    """DDP's step in one process: the mean loss of the N ranks' batches, one clipped AdamW step."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    ids, labels, v_ids, v_labels = data
    model = causal_lm()
    opt = adamw(model.parameters())
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
                out = model(torch.from_numpy(ids[p]))
                (F.cross_entropy(out.flatten(0, -2), torch.from_numpy(labels[p]).flatten()) / len(parts)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
        curve.append(val_loss(model, v_ids, v_labels))
    return {"val_loss": curve, "traffic_ratio": 1.0, "seconds": time.monotonic() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}


def run_gradshare(spark: SparkSession, data: LmData, *, workers: int, epochs: int, batch: int, seed: int) -> dict[str, Any]:
    from gradshare.replica.losses import clip_grad_norm
    from gradshare.driver.trainer import SharedTrainer

    ids, labels, v_ids, v_labels = data
    n = len(ids)
    shards = [list(zip(ids[r * n // workers : (r + 1) * n // workers], labels[r * n // workers : (r + 1) * n // workers]))
              for r in range(workers)]
    rdd = spark.sparkContext.parallelize(shards, workers).flatMap(lambda rows: rows)
    total = steps_per_epoch(n, workers, batch) * epochs
    trainer = SharedTrainer(causal_lm, optimizer=clip_grad_norm(adamw, CLIP), lr_scheduler=scheduler_factory(total),
                            scheduler_interval="step", num_workers=workers, port=0, bind="127.0.0.1",
                            advertise_host="127.0.0.1", batch_size=batch, epochs=epochs, seed=seed, verbose=0,
                            validation_data=(v_ids, v_labels), metric=val_loss_sums, timeout=300.0)
    result = trainer.fit(rdd)
    return {"val_loss": [h["val_metric"] for h in result.history], "traffic_ratio": result.traffic_ratio,
            "seconds": result.seconds, "n_params": result.n_params, "param_hash": result.param_hash}


# ------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default=None, help=f"comma list of N >= 2 (default {DEFAULTS['workers']})")
    parser.add_argument("--seeds", default=None, help=f"comma list of seeds (default {DEFAULTS['seeds']})")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {DEFAULTS['epochs']}")
    parser.add_argument("--rows", type=int, default=None, help=f"training windows (default {DEFAULTS['rows']})")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per step per worker (default 32)")
    parser.add_argument("--systems", default="gradshare,ddp", help="comma list of gradshare,ddp")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out-dir", default=None, help="where bench-lm.json/.png go (default docs/; --quick: a temp dir)")


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
    cfg = {"workers": ints["workers"], "seeds": ints["seeds"], "systems": comma_list(args.systems, ("gradshare", "ddp"), "systems"),
           "epochs": args.epochs or base["epochs"], "rows": args.rows or base["rows"],
           "batch_size": args.batch_size or base["batch_size"], "quick": bool(args.quick)}
    for key in ("epochs", "rows", "batch_size"):
        if cfg[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {cfg[key]}")
    return cfg


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for workers, system in sorted({(r["workers"], r["system"]) for r in rows}):
        group = [r for r in rows if (r["workers"], r["system"]) == (workers, system) and "val_loss" in r]
        last = [r["val_loss"][-1] for r in group]
        out.append({"workers": workers, "system": system, "seeds": [r["seed"] for r in group],
                    "mean": [statistics.fmean(c) for c in zip(*(r["val_loss"] for r in group))],
                    "last_mean": statistics.fmean(last) if last else None,
                    "last_std": statistics.stdev(last) if len(last) > 1 else None,
                    "traffic_ratio": statistics.fmean(r["traffic_ratio"] for r in group) if group else None,
                    "seconds": statistics.fmean(r["seconds"] for r in group) if group else None})
    return out


def checks(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for workers in sorted({s["workers"] for s in summary}):
        gs = next((s for s in summary if s["workers"] == workers and s["system"] == "gradshare"), None)
        dd = next((s for s in summary if s["workers"] == workers and s["system"] == "ddp"), None)
        if gs and dd and gs["last_mean"] is not None and dd["last_mean"] is not None:
            diff = gs["last_mean"] - dd["last_mean"]
            found.append({"workers": workers, "check": "val loss gradshare − DDP (nats)", "value": diff,
                          "limit": LOSS_SLACK, "met": diff <= LOSS_SLACK})
        if gs and gs["traffic_ratio"] is not None:
            found.append({"workers": workers, "check": "dense ÷ gradshare traffic", "value": gs["traffic_ratio"],
                          "limit": TRAFFIC_TARGET, "met": gs["traffic_ratio"] >= TRAFFIC_TARGET})
    return found


def plot(path: str, summary: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for s in summary:
        ax.plot(range(1, len(s["mean"]) + 1), s["mean"], marker=".", label=f"{s['system']} N={s['workers']}",
                color={"gradshare": "tab:green", "ddp": "tab:red"}[s["system"]],
                linestyle="-" if s["workers"] == 2 else "--")
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    report.save_figure(fig, path, title)


def run(args: argparse.Namespace) -> int:
    from gradshare.bench import systems

    cfg = settings(args)
    out_dir = args.out_dir or (tempfile.mkdtemp(prefix="gradshare-lm-") if cfg["quick"] else "docs")
    systems.local_spark_env()
    spark = systems.local_spark(max(cfg["workers"]), "gradshare-bench-lm") if "gradshare" in cfg["systems"] else None
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for seed in cfg["seeds"]:
            data = lm_data(seed, cfg["rows"])
            for workers in cfg["workers"]:
                for system in cfg["systems"]:
                    kw = dict(workers=workers, epochs=cfg["epochs"], batch=cfg["batch_size"], seed=seed)
                    row = {"system": system, "workers": workers, "seed": seed}
                    try:
                        if system == "ddp":
                            row.update(run_ddp(data, **kw))
                        else:
                            assert spark is not None  # started above whenever gradshare runs
                            row.update(run_gradshare(spark, data, **kw))
                    except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"[lm] seed {seed} N={workers} {system}: "
                          + (row.get("error") or f"val loss {row['val_loss']}, {row['seconds']:.0f} s"), flush=True)
                    rows.append(row)
    finally:
        if spark is not None:
            spark.stop()
    summary = summarise(rows)
    doc: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": report.machine(),
           "command": report.command_line("lm"), "config": cfg,
           "recipe": {"model": f"{LAYERS} pre-norm layers, width {WIDTH}, {HEADS} heads, vocab {VOCAB}, T {SEQ}",
                      "optimizer": f"AdamW lr {LR}, betas 0.9/0.95, wd {WEIGHT_DECAY} (matrices), clip {CLIP}",
                      "schedule": f"linear warm-up {WARMUP_SHARE:.0%} of steps, cosine to 0",
                      "text": {"train": TRAIN_MODULES, "val": VAL_MODULES}},
           "summary": summary, "checks": checks(summary), "rows": rows, "total_seconds": time.monotonic() - t0}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench-lm.json"), "w") as f:
        json.dump(doc, f, indent=1, default=float)
    plot(os.path.join(out_dir, "bench-lm.png"), summary, f"{doc['date']}, causal LM on stdlib text")
    for s in summary:
        print(f"N={s['workers']} {s['system']:<9} seeds {s['seeds']}: last val loss "
              f"{s['last_mean']:.4f} ± {s['last_std'] or 0:.4f}, traffic {s['traffic_ratio']:,.0f}x, {s['seconds']:.0f} s")
    for c in doc["checks"]:
        print(f"  N={c['workers']} {c['check']}: {c['value']:.3f} (limit {c['limit']}) {'met' if c['met'] else 'MISSED'}")
    print(f"wrote {out_dir}/bench-lm.json and .png in {doc['total_seconds']:.0f} s")
    return 0 if all("error" not in r for r in rows) else 1
