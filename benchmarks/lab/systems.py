"""The systems of `python benchmarks/train.py` and `python benchmarks/convergence.py`, each run on the same
workload, seed, batch size (per worker), epochs and (for the distributed ones) the same N contiguous data
shards and per-rank batch order (`gradshare.driver.session.epoch_order`):

- "single":   one process, one thread, the whole training set, batch `batch_size` (no communication);
- "gradshare": `SharedTrainer` with N barrier tasks, the relay on the driver (loopback);
- "ddp":      pyspark `TorchDistributor(num_processes=N, local_mode=False, use_gpu=False)`, DDP over
              Gloo, dense allreduce;
- "powersgd": the same with DDP's PowerSGD hook, rank 2, in ONE bucket (`bucket_cap_mb` ≥ model size:
              with the default 25 MB buckets the hook aborts on Gloo in torch 2.13, docs/design.md "Measuring").
The two DDP systems run from lab/ddp.py; this module holds the rest and what they all share.

Every system uses Adam(lr=1e-3) (SharedTrainer's default optimizer), one torch thread per process, and
the same LR schedule: a torch `LambdaLR` built by `lr_scheduler_factory` and stepped once per optimizer
step, over each process's own steps ("constant", "cosine" to 0, "step" decay). With a fixed initial τ
of 1e-2 and the adaptive rule, cosine was measured on the MLP (seeds 0-2, 16 epochs): single and DDP end
stable at 97.3-98.4 %, but gradshare drops by 1-7 pp in its last epochs (e.g. 95.6 → 88.9 %) while the
adaptive rule lowers τ (final τ 1.0e-2 → 6.2e-3; mean sparsity 0.30 % → 0.42 %). Our reading (not
isolated by a run): a lower τ releases residual mass accumulated under the old τ into a model that is
otherwise barely moving. Hence `benchmarks/train.py`'s constant default; `benchmarks/convergence.py` measures all three.
Each returns a `Measured`: per-step wall seconds (evaluation excluded), the test-accuracy curve against
training wall-clock (evaluated after every epoch, on rank 0), and the bytes transmitted on `lo` over the
steps (the namespace's loopback counter: every byte of every process in the namespace, once).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray

from gradshare.config import TrainConfig
from gradshare.config.options import Aggregate, Compression, FaultTolerance, Network, OptimizerMomentum, Runtime
from lab import BENCHMARKS, ROOT
from lab.profile import lo_tx_bytes
from lab.workloads import Workload, model_factory, test_accuracy

if TYPE_CHECKING:
    import torch
    from pyspark import RDD, SparkContext
    from pyspark.sql import SparkSession
    from torch import nn

SYSTEMS = ("gradshare", "ddp", "powersgd", "single")
LEARNING_RATE = 1e-3


@dataclass
class Measured:
    walls: list[float]
    curve: list[tuple[float, float]]
    lo_bytes: int | None
    n_params: int
    stopped_by_budget: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


LR_SCHEDULES = ("constant", "cosine", "step")
# "step": classic step decay (He et al. 2016's ResNet recipe): lr × 0.1 once half the steps are done
# and × 0.1 again at three quarters, so the last quarter runs at 1 % of the initial lr.
STEP_DECAY_AT = (0.5, 0.75)
STEP_DECAY_GAMMA = 0.1


def lr_factor(schedule: str, step: int, total_steps: int) -> float:
    """The lr multiplier of optimizer step `step` (0-based) of a run of `total_steps` steps.

    constant: 1. cosine: 1 → 0 along half a cosine, 0 exactly from `total_steps` on (after the last step:
    no step of the run itself is taken at lr 0, but a rank that steps longer is). step: × STEP_DECAY_GAMMA
    at each of STEP_DECAY_AT (fractions of `total_steps`, rounded down to a step)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    step = min(max(step, 0), total_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    if schedule == "step":
        return STEP_DECAY_GAMMA ** sum(step >= int(f * total_steps) for f in STEP_DECAY_AT)
    return 1.0


def _lambda_lr(schedule: str, total_steps: int, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_factor_at, schedule, total_steps))


def _factor_at(schedule: str, total_steps: int, step: int) -> float:
    return lr_factor(schedule, step, total_steps)


def lr_scheduler_factory(
    schedule: str, total_steps: int
) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """`callable(optimizer) -> torch LambdaLR` for `schedule` over `total_steps` optimizer steps; the
    caller steps the scheduler once after every `optimizer.step()`. One factory for every system
    (single and DDP build the scheduler themselves, gradshare ships it to its workers as
    `SharedTrainer(lr_scheduler=..., runtime=Runtime(scheduler_interval="step"))`), so all anneal by the same formula
    over their own steps (the single process over N× the steps of an N-worker system at equal
    epochs). A `functools.partial` of module functions: it pickles, as a Spark task closure must."""
    lr_factor(schedule, 0, total_steps)  # validates both arguments here, not on an executor
    return functools.partial(_lambda_lr, schedule, int(total_steps))


def adam(params: Iterable[torch.Tensor], lr: float = LEARNING_RATE) -> torch.optim.Adam:
    """Adam(lr, fused): every system's optimizer (SharedTrainer's default optimizer)."""
    import torch

    return torch.optim.Adam(params, lr=lr, fused=True)


def shard_sizes(n_rows: int, world: int) -> list[int]:
    """Rows of each of `world` contiguous shards (`parallelize(rows, world)`, `Workload.shard`)."""
    return [(r + 1) * n_rows // world - r * n_rows // world for r in range(world)]


def steps_per_epoch(n_rows: int, world: int, batch_size: int) -> int:
    """Steps every DDP rank takes per epoch: the smallest shard decides (DDP ranks must step together)."""
    return math.ceil(min(shard_sizes(n_rows, world)) / batch_size)


def gradshare_steps_per_epoch(n_rows: int, world: int, batch_size: int) -> int:
    """Steps of the longest gradshare rank per epoch (each rank runs its own shard to the end)."""
    return math.ceil(max(shard_sizes(n_rows, world)) / batch_size)


def local_spark_env() -> None:
    """Everything on loopback: Spark's driver, executors' Python workers (this interpreter, this tree's
    gradshare and the lab first on PYTHONPATH), Gloo."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    first = [ROOT, BENCHMARKS]  # this tree's gradshare, and the lab, whose functions Spark pickles by reference
    paths = first + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def local_spark(slots: int, app_name: str) -> SparkSession:
    """An embedded `local[slots]` SparkSession on loopback (`local_spark_env`); the caller stops it."""
    local_spark_env()
    from gradshare.driver.session import session_builder

    spark = session_builder(f"local[{slots}]", app_name=app_name).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# ---------------------------------------------------------------------------------------- local loop
def _train_steps(
    module: nn.Module,
    evaluated: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    test: tuple[NDArray[Any], NDArray[Any]] | None,
    *,
    rank: int,
    epochs: int,
    spe: int,
    batch_size: int,
    seed: int,
    lr_schedule: str,
    stop: Callable[[float], bool],
) -> tuple[list[float], list[tuple[float, float]], bool]:
    """The step loop of the single process and of every DDP rank: Adam + the shared LR scheduler
    (stepped once per optimizer step), rank `rank`'s seeded batch order (`epoch_order`), `spe` steps per
    epoch. After every step `stop(training seconds so far)` says whether to stop (DDP: agreed by every
    rank). With `test` = (X, y), `evaluated` is evaluated after every epoch (outside the timed part).
    Returns (per-step wall seconds, [(training seconds, test accuracy)] per epoch, stopped early)."""
    import torch

    from gradshare.task.partition import epoch_order

    opt = adam(module.parameters())
    scheduler = lr_scheduler_factory(lr_schedule, spe * epochs)(opt)
    loss_fn = torch.nn.CrossEntropyLoss()
    walls: list[float] = []
    curve: list[tuple[float, float]] = []
    clock, stopped = 0.0, False
    for epoch in range(epochs):
        order = epoch_order(len(y), seed, rank, epoch)
        for b in range(spe):
            t0 = time.perf_counter()
            idx = torch.from_numpy(np.sort(order[b * batch_size : (b + 1) * batch_size]))
            opt.zero_grad(set_to_none=True)
            loss_fn(module(X[idx]), y[idx]).backward()  # DDP allreduces (or compresses) in backward
            opt.step()
            scheduler.step()
            walls.append(time.perf_counter() - t0)
            clock += walls[-1]
            if stop(clock):
                stopped = True
                break
        if test is not None:
            curve.append((clock, test_accuracy(evaluated, *test)))
        if stopped:
            break
    return walls, curve, stopped


def _lo_delta(lo0: int | None, lo1: int | None) -> int | None:
    return None if lo0 is None or lo1 is None else lo1 - lo0


# ---------------------------------------------------------------------------------------- single
def run_single(
    wl: Workload, *, epochs: int, batch_size: int, seed: int, budget: float, lr_schedule: str = "constant"
) -> Measured:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = model_factory(wl.name)()
    lo0 = lo_tx_bytes()
    walls, curve, stopped = _train_steps(
        model,
        model,
        torch.from_numpy(wl.X_train),
        torch.from_numpy(wl.y_train),
        (wl.X_test, wl.y_test),
        rank=0,
        epochs=epochs,
        spe=steps_per_epoch(len(wl.y_train), 1, batch_size),
        batch_size=batch_size,
        seed=seed,
        lr_schedule=lr_schedule,
        stop=lambda clock: clock > budget,
    )
    n = sum(p.numel() for p in model.parameters())
    return Measured(walls, curve, _lo_delta(lo0, lo_tx_bytes()), n, stopped)


# ---------------------------------------------------------------------------------------- gradshare
def run_gradshare(
    spark: SparkSession,
    wl: Workload,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    budget: float,
    threshold: float | Literal["auto"] = TrainConfig.threshold,
    max_sparsity: float | None = None,
    staleness: int = Compression.staleness,
    lr: float = LEARNING_RATE,
    residual_clip: float | None = Compression.residual_clip,
    lr_schedule: str = "constant",
    workers: int = 2,
    timeout: float = 120.0,
    aggregate: Aggregate = Compression.aggregate,
    step_cap: float | Literal["auto"] | None = Compression.step_cap,
    optimizer_momentum: OptimizerMomentum = Compression.optimizer_momentum,
) -> Measured:
    """SharedTrainer with `workers` barrier tasks on `spark`; the job is cancelled (and reported as such)
    after `budget` seconds.

    threshold: "auto" (SharedTrainer's τ calibrated per worker to a target density) or the initial τ
    of the adaptive rule. `max_sparsity`: the upper end of the adaptive rule's band (τ rises while a step
    sends more than this share of entries), starting at `threshold`; None: SharedTrainer's default rule.
    The LR schedule reaches the workers as `lr_scheduler=` (stepped once per optimizer step) over the
    longest rank's steps."""
    from gradshare.driver.trainer import SharedTrainer
    from gradshare.encoding import AdaptiveThreshold

    sc = spark.sparkContext
    rdd = sharded_rdd(sc, wl, workers)
    total = gradshare_steps_per_epoch(len(wl.y_train), workers, batch_size) * epochs
    options: dict[str, Any] = {}
    if max_sparsity is not None:
        if threshold == "auto":
            raise ValueError("max_sparsity tunes the adaptive rule of a numeric threshold, not threshold='auto'")
        options["threshold_algorithm"] = AdaptiveThreshold(initial=threshold, max_sparsity=max_sparsity)
    trainer = SharedTrainer(
        model_factory(wl.name),
        optimizer=functools.partial(adam, lr=lr),
        lr_scheduler=lr_scheduler_factory(lr_schedule, total),
        threshold=threshold,
        num_workers=workers,
        port=0,
        batch_size=batch_size,
        epochs=epochs,
        seed=seed,
        verbose=0,
        validation_data=(wl.X_test, wl.y_test),
        runtime=Runtime(scheduler_interval="step", worker_options={"profile": True}),
        compression=Compression(
            staleness=staleness,
            aggregate=aggregate,
            residual_clip=residual_clip,
            optimizer_momentum=optimizer_momentum,
            step_cap=step_cap,
            **options,
        ),
        network=Network(bind="127.0.0.1", advertise_host="127.0.0.1"),
        fault_tolerance=FaultTolerance(timeout=timeout),
    )
    with _cancel_after(sc, budget) as fired:
        try:
            result = trainer.fit(rdd)
        except Exception:
            if fired.is_set():
                raise TimeoutError(f"gradshare exceeded the {budget:g} s budget and was cancelled") from None
            raise
    rank0 = next(r for r in result.worker_reports if r.rank == 0)
    prof = rank0.profile
    if prof is None:
        raise ValueError("gradshare's worker reports carry no profile: the fit needs worker_options={'profile': True}")
    c = result.counters
    worker_steps = sum(r.last_step + 1 for r in result.worker_reports)
    return Measured(
        walls=prof["steps"]["wall"],
        curve=[(t, a) for t, a in prof["curve"]],
        lo_bytes=prof["lo_tx_bytes"],
        n_params=result.n_params,
        extra={
            "profile_steps": {k: v for k, v in prof["steps"].items()},
            # training traffic: the relay's snapshot sends (the workers' initial download) apart
            "relay_bytes": c.bytes_in + c.bytes_out - c.get("snapshot_bytes_out", 0),
            "snapshot_bytes": result.snapshot_bytes,
            "worker_udp_bytes": result.bytes_sent + result.bytes_received,
            # per worker-step, sent + received (FitResult's dense_bytes counts the same way)
            "worker_udp_bytes_per_step": (result.bytes_sent + result.bytes_received) / max(worker_steps, 1),
            "traffic_ratio": result.traffic_ratio,
            "fit_seconds": result.seconds,
            "mean_sparsity": float(np.mean([h["sparsity"] for h in result.history])),
            "final_tau": result.history[-1]["tau"],
            "epochs_history": [
                {
                    k: h[k]
                    for k in (
                        "epoch",
                        "steps",
                        "silent_steps",
                        "sparsity",
                        "tau",
                        "lr",
                        "bytes_sent",
                        "bytes_received",
                        "seconds",
                        "val_metric",
                    )
                }
                for h in result.history
            ],
            "param_hash": result.param_hash,
            "drops": dict(c.drops),
        },
    )


def sharded_rdd(sc: SparkContext, wl: Workload, world: int) -> RDD[tuple[NDArray[Any], int]]:
    """An RDD of (features, label) rows whose partition r is exactly `wl.shard(r, world)`, the rows DDP's
    rank r trains on. (`sc.parallelize(rows, world)` slices whole serialisation batches of up to 1,024
    rows: 6,000 rows in 4 slices come out as 1,024/2,048/1,024/1,904 rows.)"""
    shards = [list(zip(X, y.tolist())) for X, y in (wl.shard(r, world) for r in range(world))]
    return sc.parallelize(shards, world).flatMap(lambda rows: rows)


class _cancel_after:
    """Cancel every Spark job of `sc` if the block runs longer than `seconds` (a bounded run)."""

    def __init__(self, sc: SparkContext, seconds: float) -> None:
        self.sc, self.seconds, self.fired = sc, seconds, threading.Event()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired.set()
        self.sc.cancelAllJobs()

    def __enter__(self) -> threading.Event:
        self._timer.start()
        return self.fired

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
