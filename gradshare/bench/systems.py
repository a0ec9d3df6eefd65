"""The four systems of `gradshare bench train`, each run on the same workload, seed, batch size, epochs
and (for the distributed ones) the same two contiguous data halves and per-rank batch order
(`gradshare.spark.epoch_order`):

- "single":   one process, one thread, the whole training set, batch `batch_size` (no communication);
- "gradshare": `SharedTrainer` with 2 barrier tasks, the relay on the driver (loopback);
- "ddp":      pyspark `TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)`, DDP over
              Gloo, dense allreduce;
- "powersgd": the same with DDP's PowerSGD hook, rank 2, in ONE bucket (`bucket_cap_mb` ≥ model size:
              with the default 25 MB buckets the hook aborts on Gloo in torch 2.13, DESIGN.md "Measuring").

Every system uses Adam(lr=1e-3) (SharedTrainer's default optimizer) and one torch thread per process;
`lr_schedule="cosine"` anneals every system's lr to 0 over its own steps. Measured on the MLP (seeds 0-2,
16 epochs): single and DDP then end stable at 97.3-98.4 %, but gradshare drops by 1-7 pp in its last
epochs (e.g. 95.6 → 88.9 %): as the annealed updates stop crossing τ the adaptive rule lowers τ
(final τ 1.0e-2 → 6.2e-3; mean sparsity 0.30 % → 0.42 %). Our reading (not isolated by a run): a lower τ
releases residual mass accumulated under the old τ into a model that is otherwise barely moving.
Hence the constant default.
Each returns a `Measured`: per-step wall seconds (evaluation excluded), the test-accuracy curve against
training wall-clock (evaluated after every epoch, on rank 0), and the bytes transmitted on `lo` over the
steps (the namespace's loopback counter: every byte of every process in the namespace, once).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

SYSTEMS = ("gradshare", "ddp", "powersgd", "single")
LEARNING_RATE = 1e-3


@dataclass
class Measured:
    walls: list[float]
    curve: list[tuple[float, float]]
    lo_bytes: int | None
    n_params: int
    stopped_by_budget: bool = False
    extra: dict = field(default_factory=dict)


def cosine_factor(step: int, total_steps: int) -> float:
    """The lr multiplier after `step` of `total_steps` optimizer steps: 1 → 0 along half a cosine."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    return 0.5 * (1.0 + math.cos(math.pi * min(max(step, 0), total_steps) / total_steps))


def _adam(params, lr: float = LEARNING_RATE, total_steps: int | None = None):
    """Adam(lr); with `total_steps`, lr anneals to 0 over that many `.step()` calls (`cosine_factor`).

    The anneal counts this optimizer's own steps, so every system anneals over its own run (the single
    process over 2× the steps of a 2-worker system at equal epochs). A plain wrapper of `step`, not an
    LR scheduler object: the gradshare worker only ever calls `optimizer.step()`."""
    import torch

    opt = torch.optim.Adam(params, lr=lr)
    if total_steps is None:
        return opt
    plain_step, done = opt.step, [0]

    def step(closure=None):
        out = plain_step(closure)
        done[0] += 1
        for group in opt.param_groups:
            group["lr"] = lr * cosine_factor(done[0], total_steps)
        return out

    opt.step = step
    return opt


def steps_per_epoch(n_rows: int, world: int, batch_size: int) -> int:
    """Steps every rank takes per epoch: the smallest shard decides (DDP ranks must step together)."""
    smallest = min((r + 1) * n_rows // world - r * n_rows // world for r in range(world))
    return math.ceil(smallest / batch_size)


LR_SCHEDULES = ("constant", "cosine")


def _anneal_steps(lr_schedule: str, total_steps: int) -> int | None:
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
    return total_steps if lr_schedule == "cosine" else None


# ---------------------------------------------------------------------------------------- single
def run_single(wl, *, epochs: int, batch_size: int, seed: int, budget: float,
               lr_schedule: str = "constant") -> Measured:
    import torch

    from gradshare.bench.profile import lo_tx_bytes
    from gradshare.bench.workloads import model_factory, test_accuracy
    from gradshare.spark import epoch_order

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = model_factory(wl.name)()
    spe = steps_per_epoch(len(wl.y_train), 1, batch_size)
    opt = _adam(model.parameters(), total_steps=_anneal_steps(lr_schedule, spe * epochs))
    loss_fn = torch.nn.CrossEntropyLoss()
    X, y = torch.from_numpy(wl.X_train), torch.from_numpy(wl.y_train)
    walls, curve, clock, stopped = [], [], 0.0, False
    lo0 = lo_tx_bytes()
    for epoch in range(epochs):
        order = epoch_order(len(y), seed, 0, epoch)
        for b in range(spe):
            t0 = time.perf_counter()
            idx = torch.from_numpy(np.sort(order[b * batch_size : (b + 1) * batch_size]))
            opt.zero_grad(set_to_none=True)
            loss_fn(model(X[idx]), y[idx]).backward()
            opt.step()
            walls.append(time.perf_counter() - t0)
            clock += walls[-1]
            if clock > budget:
                stopped = True
                break
        curve.append((clock, test_accuracy(model, wl.X_test, wl.y_test)))
        if stopped:
            break
    lo1 = lo_tx_bytes()
    n = sum(p.numel() for p in model.parameters())
    return Measured(walls, curve, None if lo0 is None or lo1 is None else lo1 - lo0, n, stopped)


# ---------------------------------------------------------------------------------------- gradshare
def run_gradshare(spark, wl, *, epochs: int, batch_size: int, seed: int, budget: float,
                  threshold: float, max_sparsity: float | None = None, staleness: int = 0,
                  lr: float = LEARNING_RATE, residual_clip: float | None = 5.0,
                  lr_schedule: str = "constant", timeout: float = 120.0) -> Measured:
    """SharedTrainer on `spark`; the job is cancelled (and reported as such) after `budget` seconds.

    `max_sparsity`: the upper end of the adaptive rule's band (τ rises while a step sends more than this
    share of entries); None: SharedTrainer's default adaptive rule. Both start at `threshold`."""
    from gradshare.bench.workloads import model_factory
    from gradshare.encoding import AdaptiveThreshold
    from gradshare.trainer import SharedTrainer

    sc = spark.sparkContext
    rows = list(zip(wl.X_train, wl.y_train.tolist()))
    rdd = sc.parallelize(rows, 2)
    rule = "adaptive" if max_sparsity is None else AdaptiveThreshold(initial=threshold, max_sparsity=max_sparsity)
    trainer = SharedTrainer(model_factory(wl.name), optimizer=functools.partial(
                                _adam, lr=lr, total_steps=_anneal_steps(
                                    lr_schedule, steps_per_epoch(len(wl.y_train), 2, batch_size) * epochs)),
                            threshold=threshold, port=0, threshold_algorithm=rule, staleness=staleness,
                            residual_clip=residual_clip,
                            bind="127.0.0.1", advertise_host="127.0.0.1", batch_size=batch_size,
                            epochs=epochs, seed=seed, verbose=0, validation_data=(wl.X_test, wl.y_test),
                            timeout=timeout, worker_options={"profile": True})
    with _cancel_after(sc, budget) as fired:
        try:
            result = trainer.fit(rdd)
        except Exception:
            if fired.is_set():
                raise TimeoutError(f"gradshare exceeded the {budget:g} s budget and was cancelled") from None
            raise
    rank0 = next(r for r in result.worker_reports if r["rank"] == 0)
    prof = rank0["profile"]
    c = result.counters
    return Measured(
        walls=prof["steps"]["wall"], curve=[(t, a) for t, a in prof["curve"]], lo_bytes=prof["lo_tx_bytes"],
        n_params=result.n_params,
        extra={
            "profile_steps": {k: v for k, v in prof["steps"].items()},
            "relay_bytes": int(c.get("bytes_in", 0)) + int(c.get("bytes_out", 0)),
            "worker_udp_bytes": result.bytes_sent + result.bytes_received,
            "mean_sparsity": float(np.mean([h["sparsity"] for h in result.history])),
            "final_tau": result.history[-1]["tau"],
            "param_hash": result.param_hash,
            "drops": c.get("drops", {}),
        },
    )


class _cancel_after:
    """Cancel every Spark job of `sc` if the block runs longer than `seconds` (a bounded run)."""

    def __init__(self, sc, seconds: float):
        self.sc, self.seconds, self.fired = sc, seconds, threading.Event()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired.set()
        self.sc.cancelAllJobs()

    def __enter__(self) -> threading.Event:
        self._timer.start()
        return self.fired

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


# ---------------------------------------------------------------------------------------- DDP
def ddp_train(spec: dict) -> dict | None:
    """The TorchDistributor training function (runs in each torchrun process; env:// rendezvous).

    Rank 0 decides when the time budget is spent; a one-element allreduce after every step (outside the
    timed part) makes both ranks stop at the same step, as DDP requires.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradshare.bench.profile import lo_tx_bytes
    from gradshare.bench.workloads import load, model_factory, test_accuracy
    from gradshare.spark import epoch_order

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        wl = load(spec["workload"], spec["seed"], spec["target"], spec["rows"])
        torch.manual_seed(spec["seed"])
        model = model_factory(wl.name)()
        n_params = sum(p.numel() for p in model.parameters())
        if spec["powersgd"]:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            # One bucket holding the whole model: PowerSGD on Gloo aborts with several (DESIGN.md).
            bucket_mb = n_params * 4 / 2**20 + 1
            ddp = DDP(model, bucket_cap_mb=bucket_mb)
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=2, random_seed=spec["seed"])
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            ddp = DDP(model)
        spe = steps_per_epoch(len(wl.y_train), world, spec["batch_size"])
        opt = _adam(ddp.parameters(), total_steps=_anneal_steps(spec["lr_schedule"], spe * spec["epochs"]))
        loss_fn = torch.nn.CrossEntropyLoss()
        Xs, ys = wl.shard(rank, world)
        X, y = torch.from_numpy(np.ascontiguousarray(Xs)), torch.from_numpy(np.ascontiguousarray(ys))
        bs, budget = spec["batch_size"], spec["budget"]
        walls, curve, clock, stop = [], [], 0.0, False
        flag = torch.zeros(1)
        dist.barrier()
        lo0 = lo_tx_bytes()
        for epoch in range(spec["epochs"]):
            order = epoch_order(len(y), spec["seed"], rank, epoch)
            for b in range(spe):
                t0 = time.perf_counter()
                idx = torch.from_numpy(np.sort(order[b * bs : (b + 1) * bs]))
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp(X[idx]), y[idx]).backward()  # DDP allreduces (or compresses) in backward
                opt.step()
                walls.append(time.perf_counter() - t0)
                clock += walls[-1]
                flag[0] = float(rank == 0 and clock > budget)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag[0] > 0:
                    stop = True
                    break
            if rank == 0:
                curve.append((clock, test_accuracy(model, wl.X_test, wl.y_test)))
            if stop:
                break
        lo1 = lo_tx_bytes()
        dist.barrier()
        if rank != 0:
            return None
        return {"walls": walls, "curve": curve, "n_params": n_params, "stopped": stop,
                "lo_bytes": None if lo0 is None or lo1 is None else lo1 - lo0}
    finally:
        dist.destroy_process_group()


def run_ddp(spark, wl, *, powersgd: bool, epochs: int, batch_size: int, seed: int, budget: float,
            rows: int | None, hard_timeout: float, lr_schedule: str = "constant") -> Measured:
    from pyspark.ml.torch.distributor import TorchDistributor

    spec = {"workload": wl.name, "seed": seed, "target": wl.target, "rows": rows, "powersgd": powersgd,
            "epochs": epochs, "batch_size": batch_size, "budget": budget, "lr_schedule": lr_schedule}
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with _cancel_after(spark.sparkContext, hard_timeout) as fired:
        try:
            out = dist.run(ddp_train, spec)
        except Exception:
            if fired.is_set():
                raise TimeoutError(f"DDP exceeded the hard limit of {hard_timeout:g} s and was cancelled") from None
            raise
    return Measured(out["walls"], [tuple(p) for p in out["curve"]], out["lo_bytes"], out["n_params"],
                    out["stopped"])
