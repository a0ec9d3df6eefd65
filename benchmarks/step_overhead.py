"""Step overhead on loopback: gradshare step ÷ single-process step, same model, same batch, one run.

    PYTHONPATH=$PWD SPARK_LOCAL_IP=127.0.0.1 python benchmarks/step_overhead.py [--steps 60] [--json out.json]

Both sides run as 2 concurrent Spark tasks on an embedded local[2] session, one torch thread each, so
they compete for the same cores in the same way: the baseline tasks train their own model copy
locally (no sharing at all); the gradshare tasks run SharedTrainer's workers (relay on 127.0.0.1).
Step times are taken inside the tasks, after `--warmup` steps (Spark start-up, materialisation and the
adaptive threshold's first steps are not the steady state). The target: ratio <= 1.15. The model
defaults to the 8.4 M-parameter MLP of docs/design.md's peer comparison (1024-2048-2048-1024-10, batch 64).
The optimizer is SGD with momentum on both sides (Adam's even-sized first updates make every entry
cross τ until the adaptive threshold has caught up, which a 60-step run would mostly measure).

--model gpt2: GPT-2 small as `GPT2Config()` builds it (124.4 M parameters), 128-token rows, the next-token
loss, AdamW (lr 1e-4, torch's default weight decay) on both sides, the size users fine-tune; a step takes
seconds on one core, so e.g. `--model gpt2 --batch-size 2 --steps 12 --warmup 4 --rounds 1`.
"""

import argparse
import json
import os
import sys
import time

from gradshare.config.options import Compression, Network, Runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="steps per worker (and for the baseline)")
    parser.add_argument("--warmup", type=int, default=15, help="steps not timed at the start")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--widths", default="1024,2048,2048,1024,10", help="MLP layer widths")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternate baseline and gradshare this many times (the machine is shared)"
    )
    parser.add_argument(
        "--general",
        action="store_true",
        help="force the general update path (P_after - P_before against a twin) for an A/B",
    )
    parser.add_argument(
        "--no-local-view",
        action="store_true",
        help="Compression(local_view=False): the gradient at P, for an A/B of the local view's cost",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--tau-warmup",
        action="store_true",
        help="keep threshold='auto''s warm-up (the default: the first epochs at up to 7 %% density) "
        "instead of warmup=0, which times the steady state",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        choices=("mlp", "gpt2"),
        help="the MLP of --widths, or GPT-2 small (124 M; needs transformers)",
    )


def make_mlp(widths):
    from torch import nn

    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def adamw(params):  # the Hugging Face recipes' optimizer
    import torch

    return torch.optim.AdamW(params, lr=1e-4)


SEQ = 128  # GPT-2's rows: 128 tokens each


def lm_step(model, batch):
    """GPT-2's next-token loss on a batch of rows (the labels are the inputs: the model shifts them)."""
    return model(input_ids=batch[0], labels=batch[0]).loss


def make_model(name, widths, small=False):
    """The benchmark's model: the MLP of ``widths``, or "gpt2": GPT-2 small as `GPT2Config()` builds it
    (124 M parameters); with ``small`` a tiny one of the same kind (a warm-up fit)."""
    if name != "gpt2":
        from torch import nn

        return nn.Linear(widths[0], widths[-1]) if small else make_mlp(widths)
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2) if small else GPT2Config())


def make_rows(name, widths, count, rng):
    """``count`` rows for the model: (features, label), or for "gpt2" (SEQ token ids, 0)."""
    if name == "gpt2":
        return [(rng.integers(0, 50257, SEQ), 0) for _ in range(count)]
    return [(rng.normal(size=widths[0]).astype("float32"), int(rng.integers(0, widths[-1]))) for _ in range(count)]


def local_steps(name, widths, batch, warmup, seed, rows):
    """Baseline task body: the same model, optimizer and batches, trained locally without sharing."""
    import numpy as np
    import torch
    from pyspark import TaskContext

    torch.set_num_threads(max(1, int(TaskContext.get().cpus())))
    data = list(rows)
    x_all = torch.from_numpy(np.stack([r[0] for r in data]))
    y_all = torch.tensor([int(r[1]) for r in data])
    torch.manual_seed(seed)
    model = make_model(name, widths)
    opt = (adamw if name == "gpt2" else optimizer)(list(model.parameters()))
    loss_fn = torch.nn.CrossEntropyLoss()
    times, cpus = [], []
    for b in range(0, len(data), batch):
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        x = x_all[b : b + batch]
        loss = lm_step(model, (x,)) if name == "gpt2" else loss_fn(model(x), y_all[b : b + batch])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return [(times[warmup:], cpus[warmup:])]


class RelayCpu:
    """CPU seconds of the driver's relay thread during a fit: sampled every 0.2 s while it runs (the
    thread is gone when fit returns), so up to 0.2 s of its life may be missed."""

    def __init__(self):
        import threading

        self.seconds, self._stop = 0.0, threading.Event()
        self.threads: dict[str, float] = {}  # every driver thread's CPU growth over the fit
        self._thread = threading.Thread(target=self._sample, name="relay-cpu-sampler", daemon=True)

    def _sample(self):
        from gradshare.task.profiling import threads_cpu

        first = threads_cpu()
        while not self._stop.wait(0.2):
            now = threads_cpu()
            cpu = [v for k, v in now.items() if k.startswith("gradshare-relay")]
            if cpu:
                self.seconds = max(self.seconds, sum(cpu))
            for k, v in now.items():
                if k != "(calling thread)":
                    self.threads[k] = max(self.threads.get(k, 0.0), v - first.get(k, 0.0))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


def phase_means(reports, warmup: int, stat=None) -> dict[str, float]:
    """Mean (or `stat`) ms per timed step of every phase of the workers' profiles (gradshare/task/profiling.py)."""
    import numpy as np

    from gradshare.task.profiling import PHASES

    steps = [r["profile"]["steps"] for r in reports]
    stat = np.mean if stat is None else stat
    out = {k: 1e3 * float(stat(np.concatenate([s[k][warmup:] for s in steps]))) for k in (*PHASES, "wall", "cpu")}
    out["other"] = out["wall"] - sum(out[p] for p in PHASES)
    out["off_cpu"] = out["wall"] - out["cpu"] - out["wait"]  # runnable but descheduled (or blocked elsewhere)
    return out


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from gradshare import SharedTrainer
    from gradshare.driver.session import get_or_create_session

    widths = [int(w) for w in args.widths.split(",")]
    spark, created = get_or_create_session(2)
    try:
        rng = np.random.default_rng(1)
        rows = args.steps * args.batch_size
        data = make_rows(args.model, widths, 2 * rows, rng)
        rdd = spark.sparkContext.parallelize(data, 2).cache()
        rdd.count()
        rounds = []
        for _ in range(args.rounds):  # alternate, so a load change hits both sides alike
            base = rdd.mapPartitions(
                lambda it: local_steps(args.model, widths, args.batch_size, args.warmup, 0, it)
            ).collect()
            lm = args.model == "gpt2"
            trainer = SharedTrainer(
                lambda: make_model(args.model, widths),
                optimizer=adamw if lm else optimizer,
                **({"train_step": lm_step} if lm else {}),
                batch_size=args.batch_size,
                epochs=1,
                port=0,
                verbose=0,
                compression=Compression(
                    staleness=args.staleness, warmup=None if args.tau_warmup else 0, local_view=not args.no_local_view
                ),
                network=Network(bind="127.0.0.1"),
                runtime=Runtime(worker_options={"profile": True, "direct_update": not args.general}),
            )
            cpu0 = time.process_time()  # the driver: the relay thread and Spark's py4j calls
            with RelayCpu() as relay_cpu:
                result = trainer.fit(rdd)
            driver_cpu = time.process_time() - cpu0
            result.relay_cpu = relay_cpu.seconds
            result.driver_threads = relay_cpu.threads
            single = float(np.median(np.concatenate([t for t, _ in base])))
            single_cpu = float(np.mean(np.concatenate([c for _, c in base])))
            step = float(
                np.median(np.concatenate([r["profile"]["steps"]["wall"][args.warmup :] for r in result.worker_reports]))
            )
            rounds.append((single, step, result, driver_cpu, single_cpu))
    finally:
        if created:
            spark.stop()
    ratios = [step / single for single, step, *_ in rounds]
    k = int(np.argsort(ratios)[len(ratios) // 2])  # the median round
    single, step, result, driver_cpu, _ = rounds[k]
    # CPU per step, mean over every round: far less sensitive than wall time to what else the shared
    # machine runs (it still feels cache and memory-bandwidth contention)
    single_cpu = float(np.mean([r[4] for r in rounds]))
    worker_cpu = float(
        np.mean([np.mean(rep["profile"]["steps"]["cpu"][args.warmup :]) for r in rounds for rep in r[2].worker_reports])
    )
    reps = result.worker_reports
    prof = phase_means(reps, args.warmup)
    log, enc = (prof["wait"] + prof["apply"]) / 1e3, prof["encode"] / 1e3
    out = {
        "n_params": result.n_params,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "staleness": args.staleness,
        "update_path": result.worker_reports[0]["update_path"],
        "single_step_ms": 1e3 * single,
        "gradshare_step_ms": 1e3 * step,
        "ratio": step / single,
        "ratios_all_rounds": ratios,
        "log_wait_ms_mean": 1e3 * log,
        "encode_ms_mean": 1e3 * enc,
        "mean_sparsity": float(np.mean([h["sparsity"] for h in result.history])),
        "traffic_ratio": result.traffic_ratio,
        "profile_ms_mean": prof,
        "single_cpu_ms": 1e3 * single_cpu,
        "worker_thread_cpu_ms": 1e3 * worker_cpu,
        "cpu_ratio": worker_cpu / single_cpu,
        "driver_cpu_ms_per_step": 1e3 * driver_cpu / max(r["steps_run"] for r in reps),
        "relay_thread_cpu_ms_per_step": 1e3 * result.relay_cpu / max(r["steps_run"] for r in reps),
        "profile_ms_median": phase_means(reps, args.warmup, np.median),
    }
    what = "GPT-2 small" if args.model == "gpt2" else f"MLP {args.widths}"
    print(
        f"model: {what} ({result.n_params:,} params), batch {args.batch_size}, {args.steps} steps "
        f"({args.warmup} warm-up), 2 tasks on local[2], 1 torch thread each, staleness {args.staleness}, "
        f"{out['update_path']} update path"
    )
    print(f"single-process step (median)  {out['single_step_ms']:8.2f} ms")
    print(
        f"gradshare step (median)       {out['gradshare_step_ms']:8.2f} ms   (means over the timed steps: waiting "
        f"for/applying the log {out['log_wait_ms_mean']:.2f} ms, encode {out['encode_ms_mean']:.2f} ms)"
    )
    print(
        f"ratio                         {out['ratio']:8.3f}   (target <= 1.15; median of rounds "
        f"{', '.join(f'{r:.3f}' for r in ratios)})"
    )
    print(
        f"CPU per step, training thread  single {out['single_cpu_ms']:.2f} ms, gradshare "
        f"{out['worker_thread_cpu_ms']:.2f} ms: ratio {out['cpu_ratio']:.3f} (means over all rounds)"
    )
    print(f"traffic vs dense              {out['traffic_ratio']:8.1f}x less, mean sparsity {out['mean_sparsity']:.2e}")
    prof = out["profile_ms_mean"]
    print("gradshare step phases (ms, mean over both workers' timed steps; 'other' = wall - phases):")
    print("  mean:   " + "  ".join(f"{k} {v:.2f}" for k, v in prof.items()))
    print("  median: " + "  ".join(f"{k} {v:.2f}" for k, v in out["profile_ms_median"].items()))
    steps_run = max(r["steps_run"] for r in reps)
    for r in reps:
        cpu = r["profile"]["threads_cpu"]
        print(
            f"  rank {r['rank']} thread CPU ms/step (whole run): "
            + "  ".join(f"{k} {1e3 * v / steps_run:.2f}" for k, v in cpu.items())
        )
    print(
        f"  driver process CPU ms/step: {out['driver_cpu_ms_per_step']:.2f}, of which the relay thread "
        f"{out['relay_thread_cpu_ms_per_step']:.2f} (whole fit, start-up included); busiest driver threads "
        "(ms/step): "
        + ", ".join(
            f"{k} {1e3 * v / max(r['steps_run'] for r in reps):.2f}"
            for k, v in sorted(result.driver_threads.items(), key=lambda kv: -kv[1])[:4]
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))
