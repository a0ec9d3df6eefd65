"""Worker memory: peak RSS of a gradshare worker vs a single process, as multiples of the
model's parameter bytes (4 B x parameters), for SGD and Adam, measured side by side in one run.

    PYTHONPATH=$PWD SPARK_LOCAL_IP=127.0.0.1 python benchmarks/worker_memory.py [--widths 512,4950,4950,4950,10]
        [--optimizers sgd,adam] [--steps 4] [--json out.json] [--no-local-view] [--model mlp|gpt2]
        [--threshold 1e-3] [--step-cap auto|none|SHARE]

--threshold 1e-3 holds τ fixed at first, so the first steps' messages are dense (the warm-up's density):
the capped apply's worst case. The driver's row is the relay's process (its copy of the parameters and
every step it applies), its peak counted from the big fit's start.

Every measurement runs in a fresh process: each gradshare run in its own driver with its own local[2]
session (2 workers, fresh Python workers), the single process as a plain `python` child. A worker
reports its RSS at the task's start (after malloc_trim; interpreter, torch, pyspark) and its peak
(VmHWM, reset at the task's start). A tiny fit runs first in the same Spark workers so that the big
fit's baseline includes gradshare's imports and kernels, as a long job's does; a worker's baseline is
the warm-up task's peak RSS (the same Python worker), before the big job's closure arrived, and
"task start" is its RSS when the big job's task began (the closure unpickled). The single process
trains the same model with the same optimizer on the same batch size and reports the same two figures.

The default MLP (512-4950-4950-4950-10) has 51.6 M parameters (206 MB). The table also accounts the
peak with the buffers a step holds: parameters, gradients (the largest parameter's share when the
worker steps each parameter in backward, capture.py; all of them otherwise), optimizer state (Adam,
fused or not: 2 moments), the residual (on the direct path folded into the local view's point P + r,
local_view.py, so the view adds nothing there), the twin and the local view (general update path
only), snapshot transfer (0:
downloaded into the flat buffer), and single-tensor Adam's temporaries (sqrt and division over the
largest parameter: 2 x its share). A worker's baseline holds, besides the interpreter, pyspark's
worker, torch and gradshare with Numba and its loaded kernels, the ~75 MB of torch._dynamo (and
sympy) that torch imports on any optimizer's first step: the single process imports it after its
"start", so there it is part of peak - start.
"""

import argparse
import json
import os
import subprocess
import sys

from step_overhead import SEQ, lm_step, make_model, make_rows  # noqa: E402 - benchmarks/ is this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_optimizer(name):
    import torch

    if name == "adamw":  # the Hugging Face recipes' optimizer
        return lambda params: torch.optim.AdamW(params, lr=1e-4)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.01)
    if name == "adam-fused":  # one kernel per parameter: no temporaries the size of a layer
        return lambda params: torch.optim.Adam(params, lr=1e-3, fused=True)
    return lambda params: torch.optim.Adam(params, lr=1e-3)


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child_single(widths, optimizer, steps, batch, model_name="mlp"):
    """Plain torch in this process: the baseline a worker is compared with."""
    import torch

    from gradshare.task.memory import reset_peak_rss

    torch.set_num_threads(1)
    start = reset_peak_rss()
    torch.manual_seed(0)
    model = make_model(model_name, widths)
    opt = make_optimizer(optimizer)(list(model.parameters()))
    loss = torch.nn.CrossEntropyLoss()
    if model_name == "gpt2":
        x = y = torch.randint(0, 50257, (batch, SEQ))
        step = lambda: lm_step(model, (x,))  # noqa: E731
    else:
        x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
        step = lambda: loss(model(x), y)  # noqa: E731
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        step().backward()
        opt.step()
    largest = max(p.numel() for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    return {"start_rss_bytes": start, "peak_rss_bytes": _status("VmHWM"), "n_params": n, "largest": largest}


def child_gradshare(
    widths, optimizer, steps, batch, local_view=True, threshold=None, step_cap="auto", model_name="mlp"
):
    from gradshare import SharedTrainer
    from gradshare.config.options import Compression, FaultTolerance, Network
    from gradshare.driver.session import session_builder
    from gradshare.task.memory import reset_peak_rss

    spark = session_builder("local[2]", extra_conf={"spark.driver.memory": "1g"}).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        import numpy as np

        rows = make_rows(model_name, widths, 2 * steps * batch, np.random.default_rng(0))
        rdd = spark.sparkContext.parallelize(rows, 2).cache()
        rdd.count()
        common = dict(
            port=0,
            network=Network(bind="127.0.0.1"),
            verbose=0,
            batch_size=batch,
            fault_tolerance=FaultTolerance(timeout=300.0),
            optimizer=make_optimizer(optimizer),
            compression=Compression(local_view=local_view, step_cap=step_cap),
            **({} if threshold is None else {"threshold": threshold}),
            **({"train_step": lm_step} if model_name == "gpt2" else {}),
        )
        warm = SharedTrainer(lambda: make_model(model_name, widths, small=True), **common).fit(rdd)  # imports, kernels
        driver_start = reset_peak_rss()  # the driver's peak from here: the relay's copy and its applies
        result = SharedTrainer(lambda: make_model(model_name, widths), **common).fit(rdd)
        driver = {"start_rss_bytes": driver_start, "peak_rss_bytes": _status("VmHWM")}
        # the process's baseline: the warm-up task's peak (imports and kernels loaded, a tiny model), taken
        # before this job's closure (which once carried the model's weights) was unpickled; None if Spark
        # started a fresh Python worker for this job
        before = {r["pid"]: r["peak_rss_bytes"] for r in warm.worker_reports}
        keep = (
            "rank",
            "pid",
            "start_rss_bytes",
            "peak_rss_bytes",
            "snapshot_seconds",
            "update_path",
            "step_in_backward",
        )
        workers = [
            dict({k: r.get(k) for k in keep}, process_rss_bytes=before.get(r["pid"])) for r in result.worker_reports
        ]
        largest = max(p.numel() for p in result.model.parameters())
        return {
            "workers": workers,
            "driver": driver,
            "n_params": result.n_params,
            "largest": largest,
            "seconds": result.seconds,
            "step_cap": result.extra.get("step_cap"),
        }
    finally:
        spark.stop()


def accounted(optimizer, twin, largest_share, in_backward=False, local_view=True):
    """Buffers a worker step holds, in multiples of parameter bytes."""
    rows = {"params": 1.0, "grads": largest_share if in_backward else 1.0}
    if optimizer in ("adam", "adam-fused", "adamw"):
        rows["adam moments"] = 2.0
    if optimizer in ("adam", "adamw"):  # single-tensor Adam: temporaries over the parameter it steps
        rows["adam temporaries"] = 2 * largest_share
    # the direct path folds the residual into the local view's point (local_view.py: one buffer, P + r);
    # the general path keeps r and the point apart
    rows["residual"] = 1.0
    rows["twin"] = 1.0 if twin else 0.0
    rows["local view"] = 1.0 if local_view and twin else 0.0  # P + residual, the point forward/backward run at
    rows["snapshot transfer"] = 0.0
    return rows


def run_child(kind, args, optimizer):
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--optimizer",
        optimizer,
        "--widths",
        args.widths,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--model",
        args.model,
        "--local-view" if args.local_view else "--no-local-view",
        "--step-cap",
        args.step_cap,
        *(["--threshold", str(args.threshold)] if args.threshold is not None else []),
    ]
    # benchmarks/ too: the executors unpickle lm_step (step_overhead.py) by reference
    here = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [ROOT, here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{kind}/{optimizer} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="512,4950,4950,4950,10", help="MLP layer widths")
    parser.add_argument("--optimizers", default="sgd,adam")
    parser.add_argument("--steps", type=int, default=4, help="steps per worker (and for the single process)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--local-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Compression(local_view=...): the default keeps a P + residual buffer (4 B/param)",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        choices=("mlp", "gpt2"),
        help="the MLP of --widths, or GPT-2 small (124 M; needs transformers)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="SharedTrainer(threshold=...): a fixed "
        "first τ keeps the first steps dense (the capped apply's worst case)",
    )
    parser.add_argument("--step-cap", default="auto", help="Compression(step_cap=...): auto, none or a share")
    parser.add_argument("--child", choices=("single", "gradshare"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adam", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        if args.child == "single":
            out = child_single(widths, args.optimizer, args.steps, args.batch_size, args.model)
        else:
            cap = (
                None if args.step_cap == "none" else args.step_cap if args.step_cap == "auto" else float(args.step_cap)
            )
            out = child_gradshare(
                widths, args.optimizer, args.steps, args.batch_size, args.local_view, args.threshold, cap, args.model
            )
        print(json.dumps(out), flush=True)
        return

    results = {}
    mib = 1 << 20
    for optimizer in args.optimizers.split(","):
        single = run_child("single", args, optimizer)
        shared = run_child("gradshare", args, optimizer)
        pb = 4 * shared["n_params"]
        share = shared["largest"] / shared["n_params"]
        print(
            f"\n{optimizer}: {shared['n_params'] / 1e6:.1f} M parameters = {pb / mib:.0f} MiB; "
            f"largest parameter {share:.0%} of them"
        )
        print(f"{'':24}{'baseline':>10}{'peak':>10}{'peak/P':>8}{'(peak-base)/P':>15}")
        s_base, s_peak = single["start_rss_bytes"], single["peak_rss_bytes"]
        print(
            f"{'single process':24}{s_base / mib:>9.0f}M{s_peak / mib:>9.0f}M{s_peak / pb:>8.2f}"
            f"{(s_peak - s_base) / pb:>15.2f}"
        )
        for w in shared["workers"]:
            base, peak = w["process_rss_bytes"] or w["start_rss_bytes"], w["peak_rss_bytes"]
            label = f"worker rank {w['rank']}"
            print(
                f"{label:24}{base / mib:>9.0f}M{peak / mib:>9.0f}M{peak / pb:>8.2f}"
                f"{(peak - base) / pb:>15.2f}   snapshot {w['snapshot_seconds'] or 0:.2f} s, "
                f"{w['update_path']} path{' (step in backward)' if w.get('step_in_backward') else ''}, "
                f"task start {w['start_rss_bytes'] / mib:.0f}M"
                + ("" if w["process_rss_bytes"] else " (fresh worker: baseline = task start)")
            )
        d_base, d_peak = shared["driver"]["start_rss_bytes"], shared["driver"]["peak_rss_bytes"]
        print(
            f"{'driver (relay)':24}{d_base / mib:>9.0f}M{d_peak / mib:>9.0f}M{d_peak / pb:>8.2f}"
            f"{(d_peak - d_base) / pb:>15.2f}   step cap {shared['step_cap']}; worker peak / single peak "
            f"{max(w['peak_rss_bytes'] for w in shared['workers']) / s_peak:.2f}, driver peak / single peak "
            f"{d_peak / s_peak:.2f}"
        )
        rows = accounted(
            optimizer,
            any(w["update_path"] != "direct" for w in shared["workers"]),
            share,
            all(w.get("step_in_backward") for w in shared["workers"]),
            args.local_view,
        )
        base = max(w["process_rss_bytes"] or w["start_rss_bytes"] for w in shared["workers"]) / pb
        print(
            "accounted: "
            + ", ".join(f"{k} {v:.2f}" for k, v in rows.items())
            + f" = {sum(rows.values()):.2f}; + interpreter/torch/pyspark/numba baseline {base:.2f}"
            + f" = {sum(rows.values()) + base:.2f} x P"
        )
        results[optimizer] = {"single": single, "gradshare": shared, "accounted": rows, "local_view": args.local_view}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
