"""CPU time of the local view's per-step passes, two-buffer against folded (gradshare/replica/local_view.py),
measured side by side in one process with thread_time (robust to a loaded machine):

    PYTHONPATH=$PWD python benchmarks/folded_view.py [--params 8403978] [--density 2e-3] [--world 2]

- two-buffer: fill the point P + r (LocalView.fill), then encode r (the direct path's encode);
- folded: encode r read as q − P (encoding/folded.py), plus applying the step's `--world` messages to q
  as well as to P (the apply log's extra work);
- numpy.add of two P-sized arrays, the yardstick.
Each round starts from the same r and q; the first 3 rounds are not counted.
"""

import argparse
import time

import numpy as np

from gradshare.encoding import apply, encode
from gradshare.encoding.folded import encode_folded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=8_403_978, help="parameters (default: step_overhead's MLP)")
    parser.add_argument("--density", type=float, default=2e-3, help="share of entries a message sends")
    parser.add_argument("--world", type=int, default=2, help="messages the log applies per step")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    p = (rng.standard_normal(args.params) * 0.05).astype(np.float32)
    r0 = (rng.standard_normal(args.params) * 1e-3).astype(np.float32)
    q0 = (p + r0).astype(np.float32)
    tau = float(np.quantile(np.abs(r0[::97]), 1 - args.density))
    r, q, point = r0.copy(), q0.copy(), np.empty_like(p)
    msg = encode(r0.copy(), None, tau)

    def two_buffer():
        np.add(p, r, out=point)
        encode(r, None, tau)

    def folded():
        encode_folded(q, p, tau)
        for _ in range(args.world):
            apply(msg, q)

    def numpy_add():
        np.add(p, r, out=point)

    runs = (two_buffer, folded, numpy_add)
    times = {f.__name__: [] for f in runs}
    for _ in range(args.rounds):
        np.copyto(r, r0)
        np.copyto(q, q0)
        for f in runs:
            t = time.thread_time()
            f()
            times[f.__name__].append(time.thread_time() - t)
    add = np.median(times["numpy_add"][3:])
    print(f"{args.params} parameters, {msg.n_entries} entries a message, {args.world} messages applied to q")
    for name, v in times.items():
        m = np.median(v[3:])
        print(f"{name:11s} CPU median {1e3 * m:6.2f} ms  ({m / add:.2f}x numpy.add)")


if __name__ == "__main__":
    main()
