"""`gradshare bench device`: the device-generic (torch) codec against the memory floor of its device.

For each size, on the same tensors in one run: the fused accumulate+encode (`encode(r, u, τ)` with torch
tensors, message built on the host included) against ``r.add_(u)`` on the chosen device, and the
decode-apply of that message. Beside it, on host arrays of the same values, the Numba path against
``numpy.add`` (the CPU default), so on a CPU the two paths are compared side by side. Medians of the
paired ratios over ``--repeat`` runs; the residual is zeroed before every timed call so every step
has the requested density. On CUDA every timing is bracketed by ``torch.cuda.synchronize()``.

The CLI imports this module only for its own command (gradshare/cli.py): torch and the codec load at
module level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from gradshare.bench.encoding import density_arg, positive_int
from gradshare.encoding import apply, encode
from gradshare.errors import ConsistencyError
from gradshare.replica.device import resolve_device

DEFAULT_SIZES = (1_000_000, 10_000_000, 50_000_000)
DEFAULT_DENSITY = 1e-3
DEFAULT_REPEAT = 7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        default=list(DEFAULT_SIZES),
        metavar="N",
        help="float32 parameters per vector, one row each (default 1e6 1e7 5e7; 5e7 takes ~1 GB of RAM)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N or auto (the GPU when torch has CUDA, else the CPU; default auto)",
    )
    parser.add_argument(
        "--density",
        type=density_arg,
        default=DEFAULT_DENSITY,
        metavar="D",
        help=f"fraction of parameters crossing τ per step (default {DEFAULT_DENSITY:g})",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=DEFAULT_REPEAT,
        metavar="R",
        help=f"timed repeats; medians are reported (default {DEFAULT_REPEAT})",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="T",
        help="torch intra-op threads on the CPU (default 1, as the Numba path's single thread)",
    )
    parser.add_argument("--no-numba", dest="numba", action="store_false", help="skip the Numba/numpy.add columns")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed of the update vector (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _timer(device: torch.device) -> Callable[[], float]:
    """A perf_counter reading that waits for the device's queued work first (CUDA runs asynchronously)."""
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
    else:
        now = time.perf_counter
    return now


def _row(params: int, density: float, repeat: int, device: torch.device, numba: bool, seed: int) -> dict[str, Any]:
    # τ such that a standard normal update crosses it with probability `density` (both tails).
    tau = statistics.NormalDist().inv_cdf(1.0 - density / 2.0)
    host_u = np.random.default_rng(seed).standard_normal(params, dtype=np.float32)
    u = torch.from_numpy(host_u).to(device)
    r = torch.zeros(params, dtype=torch.float32, device=device)
    target = torch.zeros(params, dtype=torch.float32, device=device)
    now = _timer(device)
    m = encode(r, u, tau)  # warm-up: allocator, kernels, pages
    r.add_(u)
    apply(m, target)
    t_enc, t_add, t_apply = [], [], []
    for _ in range(repeat):
        r.zero_()
        t0 = now()
        m = encode(r, u, tau)
        t_enc.append(now() - t0)
        r.zero_()
        t0 = now()
        r.add_(u)
        t_add.append(now() - t0)
        t0 = now()
        apply(m, target)
        t_apply.append(now() - t0)
    row = {
        "params": params,
        "entries": m.n_entries,
        "form": m.form,
        "torch_encode_s": statistics.median(t_enc),
        "torch_add_s": statistics.median(t_add),
        "torch_encode_over_add": statistics.median(e / a for e, a in zip(t_enc, t_add)),
        "torch_apply_s": statistics.median(t_apply),
        "numba_encode_s": None,
        "numpy_add_s": None,
        "numba_encode_over_numpy_add": None,
    }
    del r, u, target
    if numba:
        hr = np.zeros(params, np.float32)
        encode(hr, host_u, tau)
        n_enc, n_add = [], []
        for _ in range(repeat):
            hr.fill(0.0)
            t0 = time.perf_counter()
            hm = encode(hr, host_u, tau)
            n_enc.append(time.perf_counter() - t0)
            hr.fill(0.0)
            t0 = time.perf_counter()
            np.add(hr, host_u, out=hr)
            n_add.append(time.perf_counter() - t0)
        if hm.to_bytes() != m.to_bytes():  # the benchmark doubles as an end-to-end check of the contract
            raise ConsistencyError(f"the torch and Numba encodes built different messages at {params} params")
        row.update(
            numba_encode_s=statistics.median(n_enc),
            numpy_add_s=statistics.median(n_add),
            numba_encode_over_numpy_add=statistics.median(e / a for e, a in zip(n_enc, n_add)),
        )
    return row


def measure(
    sizes: Iterable[int],
    density: float = DEFAULT_DENSITY,
    repeat: int = DEFAULT_REPEAT,
    device: object = "auto",
    threads: int = 1,
    numba: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark and return the result dict (the --json object)."""
    dev = resolve_device(device)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = [_row(n, density, repeat, dev, numba, seed) for n in sizes]
    finally:
        torch.set_num_threads(saved)
    return {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "density_requested": density,
        "repeat": repeat,
        "threads": threads,
        "rows": rows,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def _table(res: dict[str, Any]) -> str:
    def ms(s: float | None) -> str:
        return f"{s * 1e3:9.3f}" if s is not None else "        -"

    def x(v: float | None) -> str:
        return f"{v:7.2f}x" if v is not None else "       -"

    lines = [
        f"gradshare bench device: {res['device']} ({res['device_name']}), density {res['density_requested']:g}, "
        f"{res['threads']} CPU thread(s), median of {res['repeat']}; times in ms",
        "      params   entries  torch enc   .add_  enc/add  torch apply |  numba enc  np.add  enc/add",
    ]
    for row in res["rows"]:
        lines.append(
            f"{row['params']:>12,} {row['entries']:>9,} {ms(row['torch_encode_s'])} {ms(row['torch_add_s'])}"
            f" {x(row['torch_encode_over_add'])}    {ms(row['torch_apply_s'])} | {ms(row['numba_encode_s'])}"
            f" {ms(row['numpy_add_s'])} {x(row['numba_encode_over_numpy_add'])}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    res = measure(args.sizes, args.density, args.repeat, args.device, args.threads, args.numba, args.seed)
    print(json.dumps(res, indent=2) if args.json else _table(res))
    return 0
