"""`gradshare bench encoding`: encoding overhead against the memory floor, measured side by side.

On the same arrays, in one run: the fused accumulate+encode (`encode(r, u, τ)`) against
`numpy.add(r, u, out=r)` (the memory traffic encode cannot avoid), decode-apply speed, wire bytes per
entry of every form and the compression against dense float32. Medians over ``--repeat`` runs; the
residual is reset to zero before every timed call so each step has the requested density. The JSON
keys are documented in docs/benchmarks/encoding.md.

Top-level imports are stdlib only: the CLI imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for annotations only (see above)
    import numpy as np
    from numpy.typing import NDArray

    from gradshare.encoding import Message

DEFAULT_PARAMS = 10_000_000
DEFAULT_DENSITY = 1e-3
DEFAULT_REPEAT = 7

# The dense baseline DL4J sends per entry (one int32 with the sign folded in).
DL4J_BYTES_PER_ENTRY = 4.0

_COLD_START = """
import time
t0 = time.perf_counter()
import numpy as np
from gradshare.encoding import Message, apply, encode
r = np.zeros(100_000, np.float32)
u = np.linspace(-1, 1, 100_000, dtype=np.float32)
m = Message.from_bytes(encode(r, u, 0.999).to_bytes(), max_params=r.size)
apply(m, r)
print(time.perf_counter() - t0)
"""


def positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def density_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=positive_int,
        default=DEFAULT_PARAMS,
        metavar="N",
        help=f"float32 parameters per vector (default {DEFAULT_PARAMS:,}; 1e8 takes ~1.2 GB of RAM)",
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
        help=f"timed repeats; the median is reported (default {DEFAULT_REPEAT})",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="T",
        help="threads for encode and for the numpy.add baseline alike (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="RNG seed of the update vector (default 0)")
    parser.add_argument(
        "--no-cold-start",
        dest="cold_start",
        action="store_false",
        help="skip timing a fresh process's import + first encode (two extra interpreter starts)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def measure(
    params: int, density: float, repeat: int, threads: int = 1, seed: int = 0, cold_start: bool = True
) -> dict[str, Any]:
    """Run the benchmark and return the result dict (the --json object)."""
    import numba
    import numpy as np

    from gradshare.encoding import BITMAP, RICE, SPARSE, convert

    # τ such that a standard normal update crosses it with probability `density` (both tails).
    tau = statistics.NormalDist().inv_cdf(1.0 - density / 2.0)
    m, t = _time_codec(params, tau, repeat, threads, seed)
    k = m.n_entries
    encode_s = statistics.median(t["encode"])
    add_s = statistics.median(t["add"])
    apply_s = statistics.median(t["apply"])
    warm_s = statistics.median(t["warm"])
    decode_s = statistics.median(t["decode"])
    wire = {form: convert(m, form).nbytes for form in (SPARSE, RICE, BITMAP)}

    def per_s(seconds: float) -> float | None:
        return k / seconds if k and seconds > 0 else None

    result = {
        "params": params,
        "density_requested": density,
        "density": k / params,
        "entries": k,
        "threshold": m.threshold,
        "repeat": repeat,
        "threads": threads,
        "encode_s": encode_s,
        "numpy_add_s": add_s,
        # each repeat times encode and numpy.add back to back: the median of those paired ratios
        # cancels most of the noise of a shared machine
        "encode_over_numpy_add": statistics.median(e / a for e, a in zip(t["encode"], t["add"])),
        "apply_s": apply_s,
        "apply_entries_per_s": per_s(apply_s),
        "apply_warm_s": warm_s,
        "apply_warm_entries_per_s": per_s(warm_s),
        "decode_entries_per_s": per_s(decode_s),
        "form": m.form,
        "message_bytes": m.nbytes,
        "dense_bytes": 4 * params,
        "compression_ratio": 4 * params / m.nbytes,
        "bytes_per_entry": {form: (size / k if k else None) for form, size in wire.items()},
        "dl4j_bytes_per_entry": DL4J_BYTES_PER_ENTRY,
        "cold_start_s": None,
        "cold_start_first_s": None,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    if cold_start:
        result["cold_start_first_s"], result["cold_start_s"] = _cold_start(), _cold_start()
    return result


def _time_codec(
    params: int, tau: float, repeat: int, threads: int, seed: int
) -> tuple[Message, dict[str, list[float]]]:
    """The last message encoded and the seconds of each repeat by phase: encode, add (numpy.add of the
    same arrays), apply (cold), warm (apply with the touched lines cached), decode."""
    import numpy as np

    from gradshare.encoding import apply, encode
    from gradshare.encoding.codec import entry_codes as codes  # the bare decoder: payload -> int64 entry codes

    rng = np.random.default_rng(seed)
    u = rng.standard_normal(params, dtype=np.float32)
    r = np.zeros(params, np.float32)
    target = np.zeros(params, np.float32)
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    numpy_add = _numpy_add(r, u, pool, threads)
    t: dict[str, list[float]] = {"encode": [], "add": [], "apply": [], "warm": [], "decode": []}
    try:
        # warm-up: loads the kernels (from the on-disk cache when warm) and faults the pages in
        m = encode(r, u, tau, threads=threads)
        numpy_add()
        apply(m, target)
        codes(m)
        for _ in range(repeat):
            r.fill(0.0)  # same density every repeat; also the same cache state for both timings
            t0 = time.perf_counter()
            m = encode(r, u, tau, threads=threads)
            t["encode"].append(time.perf_counter() - t0)
            r.fill(0.0)
            t0 = time.perf_counter()
            numpy_add()
            t["add"].append(time.perf_counter() - t0)
            # decode-apply as a training step sees it: right after streaming passes, target not cached
            t0 = time.perf_counter()
            apply(m, target)
            t["apply"].append(time.perf_counter() - t0)
            # the same again with the touched lines cached (best of 3 back-to-back re-applies; the
            # first re-apply still competes with write-backs of the streaming passes)
            warm = []
            for _ in range(3):
                t0 = time.perf_counter()
                apply(m, target)
                warm.append(time.perf_counter() - t0)
            t["warm"].append(min(warm))
            t0 = time.perf_counter()
            codes(m)
            t["decode"].append(time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.shutdown()
    return m, t


def _numpy_add(
    r: NDArray[np.float32], u: NDArray[np.float32], pool: ThreadPoolExecutor | None, threads: int
) -> Callable[[], None]:
    """r += u in place, the baseline pass: split over `pool`'s `threads` like the threaded encode."""
    import numpy as np

    if pool is None:

        def numpy_add() -> None:
            np.add(r, u, out=r)

        return numpy_add
    params = len(r)
    step = -(-params // threads)
    spans = [(lo, min(lo + step, params)) for lo in range(0, params, step)]

    def numpy_add_threaded() -> None:
        list(pool.map(lambda s: np.add(r[s[0] : s[1]], u[s[0] : s[1]], out=r[s[0] : s[1]]), spans))

    return numpy_add_threaded


def _cold_start() -> float:
    """Seconds for import + first encode/decode/apply in a fresh interpreter (JIT cache as it is)."""
    out = subprocess.run([sys.executable, "-c", _COLD_START], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _table(res: dict[str, Any]) -> str:
    def ms(s: float) -> str:
        return f"{s * 1e3:9.3f} ms"

    def rate(v: float | None) -> str:
        return f"{v / 1e6:,.0f} M entries/s" if v else "-"

    bpe = res["bytes_per_entry"]
    lines = [
        f"gradshare bench encoding: {res['params']:,} float32 params, density {res['density']:.3g} "
        f"(asked {res['density_requested']:g}), {res['entries']:,} entries, τ = {res['threshold']:.4g}, "
        f"{res['threads']} thread(s), median of {res['repeat']}",
        f"  fused accumulate+encode      {ms(res['encode_s'])}",
        f"  numpy.add(r, u, out=r)       {ms(res['numpy_add_s'])}",
        f"  encode / numpy.add           {res['encode_over_numpy_add']:9.2f} x   (median of paired runs)",
        f"  decode-apply, cold cache     {ms(res['apply_s'])}   {rate(res['apply_entries_per_s'])}",
        f"  decode-apply, warm cache     {ms(res['apply_warm_s'])}   {rate(res['apply_warm_entries_per_s'])}",
        f"  decode only                                {rate(res['decode_entries_per_s'])}",
        "  wire bytes per entry         "
        + ", ".join(f"{f} {v:.3f}" if v is not None else f"{f} -" for f, v in bpe.items())
        + f"  (DL4J {res['dl4j_bytes_per_entry']:.1f})",
        f"  chosen form                  {res['form']}, {res['message_bytes']:,} bytes, "
        f"{res['compression_ratio']:,.1f}x smaller than dense float32",
    ]
    if res["cold_start_s"] is not None:
        lines.append(
            f"  fresh process import+encode  {res['cold_start_s']:.3f} s (first run {res['cold_start_first_s']:.3f} s)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    res = measure(args.params, args.density, args.repeat, args.threads, args.seed, args.cold_start)
    print(json.dumps(res, indent=2) if args.json else _table(res))
    return 0
