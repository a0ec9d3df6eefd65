"""Liveness figures: the longest whole-process pause a fit survives with no data loss, and
the time from a real worker process death to the restarted stage's resume. Local Spark, loopback.

    PYTHONPATH=$PWD SPARK_LOCAL_IP=127.0.0.1 python benchmarks/liveness.py [--liveness 1.0]
        [--pauses 2,5] [--deaths 3]

Pause: rank 1's Python worker stops itself (SIGSTOP, every thread) in its 10th forward; this script
continues it after `pause x liveness_timeout` seconds. "no data loss" = the fit's parameter hash equals
an undisturbed run's with the same seed (k = 0), no rank gone, nothing skipped.

Death: rank 1's Python worker calls os._exit in its 30th forward (epoch 1), writing the time first;
the retried stage's rank 1 writes the time of its first forward. resume = that difference: Spark
noticing the death, failing and retrying the barrier stage, the new tasks loading their partitions,
joining the relay and fetching its snapshot.
"""

import argparse
import os
import signal
import sys
import tempfile
import threading
import time

from pyspark import cloudpickle
from torch import nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _rank():
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return None if ctx is None else ctx.partitionId()


class Pauses(nn.Module):
    def __init__(self, marker):
        super().__init__()
        from gradshare.demo import mlp

        self.net, self.marker, self.calls = mlp(), marker, 0

    def forward(self, x):
        self.calls += 1
        if self.marker and _rank() == 1 and self.calls == 10 and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.net(x)


class Dies(nn.Module):
    def __init__(self, marker):
        super().__init__()
        from gradshare.demo import mlp

        self.net, self.marker, self.calls = mlp(), marker, 0

    def forward(self, x):
        self.calls += 1
        if (
            _rank() == 1
            and self.calls == 1
            and os.path.exists(self.marker)
            and not os.path.exists(self.marker + ".back")
        ):
            with open(self.marker + ".back", "w") as f:
                f.write(repr(time.time()))
        if _rank() == 1 and self.calls == 30 and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
            os._exit(17)
        return self.net(x)


def _continue_after(marker, pause):
    def run():
        while not os.path.exists(marker) or not open(marker).read():
            time.sleep(0.01)
        pid = int(open(marker).read())
        while open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "T":
            time.sleep(0.01)
        time.sleep(pause)
        os.kill(pid, signal.SIGCONT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--liveness", type=float, default=1.0)
    ap.add_argument("--pauses", default="2,5")
    ap.add_argument("--deaths", type=int, default=3)
    args = ap.parse_args()

    from gradshare import SharedTrainer
    from gradshare.config.options import FaultTolerance, Network
    from gradshare.demo import digits_split
    from gradshare.driver.session import get_or_create_session

    spark, _ = get_or_create_session(master="local[2]")
    spark.sparkContext.setLogLevel("OFF")
    X, _, y, _ = digits_split(0)
    rdd = spark.sparkContext.parallelize(list(zip(X, (int(v) for v in y))), 2).cache()
    kw = dict(
        epochs=2,
        batch_size=32,
        seed=5,
        fault_tolerance=FaultTolerance(liveness_timeout=args.liveness),
        port=0,
        network=Network(bind="127.0.0.1"),
        verbose=0,
    )
    tmp = tempfile.mkdtemp()
    try:
        calm = SharedTrainer(lambda: Pauses(None), **kw).fit(rdd)
        print(f"pause (liveness_timeout {args.liveness:g} s) | survived | bit-identical | gone | skipped")
        for factor in (float(f) for f in args.pauses.split(",")):
            marker = os.path.join(tmp, f"pause{factor}")
            _continue_after(marker, factor * args.liveness)
            r = SharedTrainer(lambda: Pauses(marker), **kw).fit(rdd)
            print(
                f"{factor:g} x = {factor * args.liveness:g} s | yes | {r.param_hash == calm.param_hash} | "
                f"{r.counters.get('gone', 0)} | {r.skipped_steps}"
            )
        print("death -> resume (s): first forward of the retried stage's rank 1 minus the exit time")
        for i in range(args.deaths):
            marker = os.path.join(tmp, f"death{i}")
            t0 = time.monotonic()
            r = SharedTrainer(lambda: Dies(marker), **{**kw, "epochs": 3}).fit(rdd)
            died, back = float(open(marker).read()), float(open(marker + ".back").read())
            print(
                f"run {i}: resume {back - died:.2f} s (fit {time.monotonic() - t0:.1f} s, resumed at step "
                f"{r.resumed_from}, epochs whole: {[h['steps'] for h in r.history]})"
            )
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
