"""The DDP systems of lab/systems.py, "ddp" and "powersgd": pyspark `TorchDistributor(num_processes=N,
local_mode=False, use_gpu=False)` running `ddp_train` in N torchrun processes, DDP over Gloo (dense allreduce,
or DDP's PowerSGD hook), each rank on its contiguous shard with the single process's step loop (Adam, the
shared LR schedule, the seeded batch order). A batch of runs (`ddp_spec`) shares one TorchDistributor launch
(`run_ddp_batch`); `run_ddp` is a batch of one. torch and pyspark are imported inside the functions.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from lab.profile import lo_tx_bytes
from lab.systems import Measured, _cancel_after, _lo_delta, _train_steps, steps_per_epoch
from lab.workloads import Workload, load, model_factory

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def ddp_spec(
    workload: str,
    *,
    seed: int,
    epochs: int,
    batch_size: int,
    budget: float,
    lr_schedule: str = "constant",
    rows: int | None = None,
    target: float | None = None,
    powersgd: bool = False,
) -> dict[str, Any]:
    """One DDP run of a `ddp_train` batch (plain data: it travels to the torchrun processes)."""
    return {
        "workload": workload,
        "seed": seed,
        "target": target,
        "rows": rows,
        "powersgd": powersgd,
        "epochs": epochs,
        "batch_size": batch_size,
        "budget": budget,
        "lr_schedule": lr_schedule,
    }


def ddp_train(specs: list[dict[str, Any]], gloo_ifname: str | None = None) -> list[dict[str, Any]] | None:
    """The TorchDistributor training function (runs in each torchrun process; env:// rendezvous): every
    run of `specs` in turn, in ONE process group. TorchDistributor's start-up (per rank: a Spark task,
    the wrapper and torchrun interpreters, torch and the workload imported, ~15-20 s on the 2-core VM)
    is paid once per batch, not once per run. Rank 0 returns one result per run. `gloo_ifname`: the
    driver's GLOO_SOCKET_IFNAME (executor processes started before the driver set it do not have it)."""
    import torch
    import torch.distributed as dist

    if gloo_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = [_ddp_run(spec, dist.get_rank(), dist.get_world_size()) for spec in specs]
        return out if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def _ddp_run(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One DDP run. Rank 0 decides when the time budget is spent; a one-element allreduce after every
    step (outside the timed part) makes every rank stop at the same step, as DDP requires."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    t0 = time.monotonic()
    wl = load(spec["workload"], spec["seed"], spec["target"], spec["rows"])
    torch.manual_seed(spec["seed"])
    model = model_factory(wl.name)()
    n_params = sum(p.numel() for p in model.parameters())
    if spec["powersgd"]:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # One bucket holding the whole model: PowerSGD on Gloo aborts with several (docs/design.md).
        bucket_mb = n_params * 4 / 2**20 + 1
        ddp = DDP(model, bucket_cap_mb=bucket_mb)
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=spec["seed"]
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        ddp = DDP(model)
    Xs, ys = wl.shard(rank, world)
    X, y = torch.from_numpy(np.ascontiguousarray(Xs)), torch.from_numpy(np.ascontiguousarray(ys))
    flag = torch.zeros(1)

    def stop(clock: float) -> bool:
        flag[0] = float(rank == 0 and clock > spec["budget"])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0] > 0)

    dist.barrier()
    lo0 = lo_tx_bytes()
    walls, curve, stopped = _train_steps(
        ddp,
        model,
        X,
        y,
        (wl.X_test, wl.y_test) if rank == 0 else None,
        rank=rank,
        epochs=spec["epochs"],
        spe=steps_per_epoch(len(wl.y_train), world, spec["batch_size"]),
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        lr_schedule=spec["lr_schedule"],
        stop=stop,
    )
    lo1 = lo_tx_bytes()
    dist.barrier()
    return {
        "walls": walls,
        "curve": curve,
        "n_params": n_params,
        "stopped": stopped,
        "lo_bytes": _lo_delta(lo0, lo1),
        "seconds": time.monotonic() - t0,
    }


def run_ddp_batch(
    spark: SparkSession, specs: list[dict[str, Any]], *, workers: int, hard_timeout: float
) -> tuple[list[Measured], float]:
    """DDP over Gloo in `workers` processes (pyspark `TorchDistributor(num_processes=workers,
    local_mode=False)`, one barrier task each) for every run of `specs` (`ddp_spec`), in order. Each run
    stops after its `budget` seconds of training (every rank at the same step); the Spark job is cancelled
    after `hard_timeout` seconds (start-up included), which fails the whole batch.
    Returns one `Measured` per run (extra["seconds"]: the run's own time in rank 0, start-up excluded)
    and the batch's wall seconds."""
    from pyspark.ml.torch.distributor import TorchDistributor

    t0 = time.monotonic()
    dist = TorchDistributor(num_processes=workers, local_mode=False, use_gpu=False)
    with _cancel_after(spark.sparkContext, hard_timeout) as fired:
        try:
            out = dist.run(ddp_train, specs, os.environ.get("GLOO_SOCKET_IFNAME"))
        except Exception:
            if fired.is_set():
                raise TimeoutError(f"DDP exceeded the hard limit of {hard_timeout:g} s and was cancelled") from None
            raise
    if out is None:  # TorchDistributor returns rank 0's value, which is never None (ddp_train)
        raise RuntimeError("DDP's rank 0 returned no results")
    measured = [
        Measured(
            r["walls"],
            [tuple(p) for p in r["curve"]],
            r["lo_bytes"],
            r["n_params"],
            r["stopped"],
            extra={"seconds": r["seconds"]},
        )
        for r in out
    ]
    return measured, time.monotonic() - t0


def run_ddp(
    spark: SparkSession,
    wl: Workload,
    *,
    powersgd: bool,
    epochs: int,
    batch_size: int,
    seed: int,
    budget: float,
    rows: int | None,
    hard_timeout: float,
    lr_schedule: str = "constant",
    workers: int = 2,
) -> Measured:
    """One DDP run (`run_ddp_batch` of one)."""
    spec = ddp_spec(
        wl.name,
        seed=seed,
        target=wl.target,
        rows=rows,
        powersgd=powersgd,
        epochs=epochs,
        batch_size=batch_size,
        budget=budget,
        lr_schedule=lr_schedule,
    )
    return run_ddp_batch(spark, [spec], workers=workers, hard_timeout=hard_timeout)[0][0]
