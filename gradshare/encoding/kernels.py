"""Numba kernels of the threshold encode (the fused accumulate+encode pass, the folded residual's passes)
and the building blocks the forms' kernels share (forms/*.py: each form's own kernels live there).

Conventions shared by every kernel here:
- An *entry* is one emitted ±τ at parameter index i, held as the int64 code ``(i << 1) | neg``
  (neg = 1 for −τ). Codes come out of the encoder sorted by index, one per index at most.
- Kernels (``_name``) validate nothing and allocate nothing: callers pass preallocated outputs, so a
  kernel call cannot fail halfway. The public functions at the end of this module allocate and resume
  them; the arguments are
  validated before, by the backend that calls them (numpy_codec.py). The forms' ``_check_*`` kernels
  are read-only validation passes that run on untrusted bytes BEFORE any kernel writes memory from them.
- `cttz`, `prefetch_write`, `apply_batch` and the constants are public: other kernels inline them.
- ``cache=True`` so a fresh process loads machine code from ``__pycache__`` instead of recompiling.
"""

from __future__ import annotations

import sys

import numpy as np


def _import_numba_arraymath_without_scipy_linalg() -> None:
    """Import numba.np.arraymath while scipy.linalg cannot be imported.

    Numba imports that module when it first compiles or loads a cached kernel, and at import it probes
    for a BLAS (for np.dot/np.cov inside jitted code) by importing scipy.linalg.cython_blas, which
    brings all of scipy.linalg: ~15 MB of every worker's RSS (benchmarks/worker_memory.py)
    for routines no kernel here calls. Without the probe, np.cov/np.corrcoef in other jitted code use
    numba's own inner product; np.dot and numba's linalg still import scipy when they are compiled.
    Nothing is refused when scipy.linalg is already loaded (someone uses it) or arraymath is."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return

    class NoScipyLinalg:  # a meta path finder for the one import below
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "scipy.linalg" or name.startswith("scipy.linalg."):
                raise ImportError("scipy.linalg is not loaded for numba's BLAS probe (gradshare kernels.py)")
            return None

    finder = NoScipyLinalg()
    sys.meta_path.insert(0, finder)
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        sys.meta_path.remove(finder)


_import_numba_arraymath_without_scipy_linalg()

from llvmlite import ir  # noqa: E402 - after the import above, which must come first
from numba import config, njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

# count trailing zeros of a non-zero uint64: the rice decoder's unary runs, the encoders' hit masks
if config.DISABLE_JIT:

    def cttz(x):
        x = int(x)
        return np.uint64((x & -x).bit_length() - 1)

else:

    @intrinsic
    def cttz(typingctx, x):
        """Count trailing zero bits of a non-zero uint64 (llvm.cttz)."""

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
            fn = builder.module.declare_intrinsic("llvm.cttz", [i64], fnty)
            return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

        return types.uint64(types.uint64), codegen


# Block of the fused accumulate+encode pass. Adding u to r and counting |r| >= τ over a block is
# branch-free and vectorises; only blocks that hold an entry are scanned again, while they are still
# in L1. A naive loop with the emit branch inside the add loop does not vectorise (~3-4x numpy.add).
# BLOCK 256 measured best of 128..4096. SUB 64 (was 32) once the mode was decided outside the block loop and a
# full run's mask loop got a constant trip count (LLVM unrolls it): fused encode of 10 M values ÷ in-place
# numpy.add 1.49-1.57 -> 1.36-1.44 at density 1e-3, 3.1 -> 2.2 at 1e-2 (a warm-up's density).
BLOCK = 256
SUB = 64
assert SUB <= 64, "the encoders keep a SUB-value run's hits in one uint64 mask"

# Modes of _accumulate_encode: r += u; r += (u - base); r += (u - base) and then u = base.
ADD = 0
DIFF = 1
DIFF_REWIND = 2

# Status codes of _accumulate_encode.
OK = 0
FULL = 1  # the entry buffer cannot hold the current block's entries: grow it and resume
NONFINITE = 2  # a residual value became NaN or ±inf in the block starting at the returned position

FLT_MAX = np.float32(3.4028234663852886e38)

# Error codes of the read-only validation passes (0 = valid). message.py maps them to text.
CHECK_OK = 0
CHECK_TRUNCATED = 1  # an entry runs past the end of the payload
CHECK_OVERLONG = 2  # a varint longer than 9 bytes or not in its shortest form; rice k > RICE_MAX_K
CHECK_INDEX = 3  # an index >= n_params
CHECK_TRAILING = 4  # bytes left over after n_entries entries
CHECK_RESERVED = 5  # bitmap code 0b11
CHECK_PADDING = 6  # bits set past the last parameter (bitmap) or the last entry (rice)
CHECK_COUNT = 7  # bitmap holds a different number of entries than the header says


@njit(nogil=True, cache=True)
def _accumulate_encode(r, u, base, mode, tau, out, k, start, added_end, reduce=True):
    """Accumulate ``u`` into ``r`` (see ADD/DIFF/DIFF_REWIND) for blocks from ``added_end`` on, then emit
    every |r[i]| >= tau into ``out`` from ``k`` on (and reduce it by τ, unless ``reduce`` is False: a
    read-only pass over blocks accumulated already, encode_passes.py).

    Blocks start at ``start`` (a multiple of BLOCK). Blocks below ``added_end`` were accumulated by an
    earlier call that stopped with FULL, so they are only counted again. ``base`` is read only in the
    DIFF modes (pass any float32 array otherwise). Returns (k, pos, status): OK with pos == r.size;
    FULL/NONFINITE with pos = start of the block that stopped the pass.
    """
    # One loop per kind of block, the mode decided once: with the choice inside the block loop the pass
    # ran at 2.0x numpy.add, with it outside at 1.65-1.68x (10 M values, density 1e-3, the same bits).
    # Work on block views: loops over range(view.size) have provably non-negative indices, which lets
    # LLVM drop Numba's wraparound checks and vectorise (range(pos, stop) does not).
    n = r.size
    pos = start
    while pos < n and pos < added_end:  # accumulated by the call that stopped with FULL: count only
        stop = min(pos + BLOCK, n)
        rb = r[pos:stop]
        k, status = _emit_block(rb, pos, tau, out, k, _count_block(rb, tau), reduce)
        if status != OK:
            return k, pos, status
        pos = stop
    if mode == ADD:
        while pos < n:
            stop = min(pos + BLOCK, n)
            rb = r[pos:stop]
            k, status = _emit_block(rb, pos, tau, out, k, _add_block(rb, u[pos:stop], tau), True)
            if status != OK:
                return k, pos, status
            pos = stop
        return k, n, OK
    rewind = mode == DIFF_REWIND
    while pos < n:
        stop = min(pos + BLOCK, n)
        rb = r[pos:stop]
        k, status = _emit_block(
            rb, pos, tau, out, k, _add_diff_block(rb, u[pos:stop], base[pos:stop], tau, rewind), True
        )
        if status != OK:
            return k, pos, status
        pos = stop
    return k, n, OK


@njit(nogil=True, cache=True, inline="always")
def _add_block(rb, ub, tau):
    """rb += ub; the values of the result flagged for the emit (entries and non-finite values)."""
    flagged = np.int32(0)
    for j in range(rb.size):
        x = rb[j] + ub[j]
        rb[j] = x
        flagged += np.int32(not (abs(x) < tau))
    return flagged


@njit(nogil=True, cache=True, inline="always")
def _add_diff_block(rb, ab, bb, tau, rewind):
    """rb += (ab - bb), the difference rounded to float32 first, exactly as ``r + (after - before)``
    in NumPy (replicas depend on the bits); with ``rewind`` also ab = bb once read: the worker's
    parameters go back to P_before in the same pass (the line is in cache already). The branch is
    loop-invariant: LLVM unswitches it and both loops vectorise."""
    flagged = np.int32(0)
    for j in range(rb.size):
        bj = bb[j]
        d = ab[j] - bj
        if rewind:
            ab[j] = bj
        x = rb[j] + d
        rb[j] = x
        flagged += np.int32(not (abs(x) < tau))
    return flagged


@njit(nogil=True, cache=True, inline="always")
def _count_block(rb, tau):
    """The flagged values (entries and non-finite values, as `_add_block`) of an accumulated block."""
    flagged = np.int32(0)
    for j in range(rb.size):
        flagged += np.int32(not (abs(rb[j]) < tau))
    return flagged


@njit(nogil=True, cache=True, inline="always")
def _bad_count(rb):
    """Non-finite values of a block (NaN compares false, inf is > FLT_MAX)."""
    bad = np.int32(0)
    for j in range(rb.size):
        bad += np.int32(not (abs(rb[j]) <= FLT_MAX))
    return bad


@njit(nogil=True, cache=True, inline="always")
def _emit_hits(m, sb, base, tau, out, k, cnt, reduce):
    """Emit the hits flagged in the uint64 mask ``m`` (bit j: |sb[j]| >= tau, finite) and reduce each by
    τ (when ``reduce``). A hit's sign is x < 0, used without a branch (it is taken at random): x − (−τ)
    is x + τ, the same bits. Returns (k, cnt) with cnt lowered by the hits emitted."""
    while m:
        j = np.int64(cttz(m))
        m &= m - np.uint64(1)
        x = sb[j]
        neg = np.int64(x < 0)
        out[k] = ((base + j) << 1) | neg
        if reduce:
            sb[j] = x - np.float32(1 - 2 * neg) * tau
        k += 1
        cnt -= 1
    return k, cnt


@njit(nogil=True, cache=True, inline="always")
def _hit_mask(sb, tau):
    """Bit j set where |sb[j]| >= tau (sb holds at most SUB values; the last run of a vector)."""
    m = np.uint64(0)
    for j in range(sb.size):
        m |= np.uint64(abs(sb[j]) >= tau) << np.uint64(j)
    return m


@njit(nogil=True, cache=True, inline="always")
def _hit_mask_full(sb, tau):
    """`_hit_mask` of a run of exactly SUB values: the constant trip count lets LLVM unroll it."""
    m = np.uint64(0)
    for j in range(SUB):
        m |= np.uint64(abs(sb[j]) >= tau) << np.uint64(j)
    return m


@njit(nogil=True, cache=True, inline="always")
def _emit_block(rb, pos, tau, out, k, flagged, reduce):
    """Emit the entries of the accumulated block ``rb`` (starting at parameter ``pos``) into ``out`` from
    ``k`` on and reduce them by τ (when ``reduce``). ``flagged`` counts its values that are not below τ:
    its entries, and its non-finite values (NaN is not below τ either). Returns (k, OK) or (k unchanged,
    NONFINITE/FULL)."""
    # One compare a value in the streaming pass (not |x| < τ) flags both, so the non-finite check runs only
    # on blocks that hold an entry, while they are in L1 (10 M values, density 1e-3: the kernel 1.26-1.30 ->
    # 1.16-1.20x in-place numpy.add; `gradshare bench encoding` 1.51-1.56 -> 1.43-1.48; the same codes).
    if flagged == 0:
        return k, OK
    if _bad_count(rb):
        return k, NONFINITE
    cnt = flagged  # every flagged value is finite: each is an entry
    if k + cnt > out.size:
        return k, FULL
    # Find the entries: a mask of each SUB-run's hits (branch-free, vectorised), then one visit per
    # hit, and stop once all `cnt` entries of the block are out. (Scanning every value of a run
    # that holds an entry, with the emit branches, cost ~2 ns a value: at a warm-up's density of
    # several % that is nearly every run, 5x the encode's sparse time.)
    full = rb.size - rb.size % SUB
    for s0 in range(0, rb.size, SUB):
        sb = rb[s0 : s0 + SUB]
        m = _hit_mask_full(sb, tau) if s0 < full else _hit_mask(sb, tau)
        if m:
            k, cnt = _emit_hits(m, sb, pos + s0, tau, out, k, cnt, reduce)
            if cnt == 0:
                break
    return k, OK


if config.DISABLE_JIT:  # pure-Python kernels (NUMBA_DISABLE_JIT=1): a prefetch is only a hint

    def prefetch_write(array, index):
        pass

else:

    @intrinsic
    def prefetch_write(typingctx, array, index):
        """Hint the CPU to fetch array[index] for writing (llvm.prefetch, rw=1, locality=3)."""

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(1), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen


@njit(nogil=True, cache=True, inline="always")
def apply_batch(batch, cnt, steps, params):
    """params[i] += steps[neg] for the first ``cnt`` decoded codes of ``batch``.

    Decoding a whole batch first (prefetching each target as it is decoded) and adding afterwards lets
    the scattered updates (one cache miss each on a large model) overlap instead of waiting one by one
    behind the serial decode: at 100 M params, density 1e-3, ~55 M entries/s unbatched against ~80 M
    (cold cache) and ~180-270 M (warm) batched. ``steps`` = [+s, -s]: indexing by the sign bit avoids
    an unpredictable branch.
    """
    for t in range(cnt):
        c = batch[t]
        params[c >> 1] += steps[c & 1]


# --- the folded residual (local_view.py, "Q-form"): q = p + s·r is stored, r = (q − p)·(1/s) is not ---------------


@njit(nogil=True, cache=True, inline="always")
def _count_folded_block(qb, pb, inv, tau):
    """The flagged values of r = (qb − pb)·inv over a block: entries and non-finite values (`_emit_block`)."""
    flagged = np.int32(0)
    for j in range(qb.size):
        flagged += np.int32(not (abs((qb[j] - pb[j]) * inv) < tau))
    return flagged


@njit(nogil=True, cache=True, inline="always")
def _folded_bad_count(qb, pb, inv):
    """Non-finite values of r = (qb − pb)·inv over a block."""
    bad = np.int32(0)
    for j in range(qb.size):
        bad += np.int32(not (abs((qb[j] - pb[j]) * inv) <= FLT_MAX))
    return bad


@njit(nogil=True, cache=True, inline="always")
def _folded_mask(sq, sp, inv, tau):
    """Bit j set where |(sq[j] − sp[j])·inv| >= tau (at most SUB values)."""
    m = np.uint64(0)
    for j in range(sq.size):
        m |= np.uint64(abs((sq[j] - sp[j]) * inv) >= tau) << np.uint64(j)
    return m


@njit(nogil=True, cache=True, inline="always")
def _folded_mask_full(sq, sp, inv, tau):
    """`_folded_mask` of exactly SUB values (constant trip count, as `_hit_mask_full`)."""
    m = np.uint64(0)
    for j in range(SUB):
        m |= np.uint64(abs((sq[j] - sp[j]) * inv) >= tau) << np.uint64(j)
    return m


@njit(nogil=True, cache=True)
def _folded_encode(q, p, inv, tau, step, out, k, start, reduce=True):
    """Emit every |r_i| >= tau of r = (q − p)·inv into ``out`` from ``k`` on, and move q_i by ∓step (step =
    float32(τ·s), what the log adds at i when it applies the entry; not when ``reduce`` is False, a read-only
    pass), blocks from ``start`` on. Reads r, never stores it. Returns (k, pos, status) as `_accumulate_encode` does
    (FULL: the block at pos is untouched)."""
    n = q.size
    pos = start
    while pos < n:
        stop = min(pos + BLOCK, n)
        qb, pb = q[pos:stop], p[pos:stop]
        cnt = _count_folded_block(qb, pb, inv, tau)
        if cnt:
            if _folded_bad_count(qb, pb, inv):  # only where a value is flagged (`_emit_block`)
                return k, pos, NONFINITE
            if k + cnt > out.size:
                return k, pos, FULL
            full = qb.size - qb.size % SUB
            for s0 in range(0, qb.size, SUB):
                # a mask of the run's hits, then one visit per hit, as _emit_block/_emit_hits (why: there);
                # here r is read as (q − P)·inv and q moves by the step (26 → 13 ms at 10 % on 10.5 M values)
                sq, sp = qb[s0 : s0 + SUB], pb[s0 : s0 + SUB]
                m = _folded_mask_full(sq, sp, inv, tau) if s0 < full else _folded_mask(sq, sp, inv, tau)
                if m:
                    base = pos + s0
                    while m:
                        j = np.int64(cttz(m))
                        m &= m - np.uint64(1)
                        # a hit: |x| >= τ and x finite (the block count checked), so its sign is x < 0;
                        # no branch on it (taken at random): q − (−step) is q + step, the same bits
                        neg = np.int64((sq[j] - sp[j]) * inv < 0)
                        out[k] = ((base + j) << 1) | neg
                        if reduce:
                            sq[j] = sq[j] - np.float32(1 - 2 * neg) * step
                        k += 1
                        cnt -= 1
                    if cnt == 0:
                        break
        pos = stop
    return k, n, OK


@njit(nogil=True, cache=True)
def _folded_clip(q, p, inv, bound, scaled_bound):
    """Where |r_i| = |(q_i − p_i)·inv| > bound, set q_i = p_i ± scaled_bound (float32(bound·s)): r clipped
    to ±bound. Returns how many entries it clipped."""
    clipped = 0
    for i in range(q.size):
        x = (q[i] - p[i]) * inv
        if x > bound:
            q[i] = p[i] + scaled_bound
            clipped += 1
        elif x < -bound:
            q[i] = p[i] - scaled_bound
            clipped += 1
    return clipped


@njit(nogil=True, cache=True)
def _folded_rescale(q, p, ratio):
    """q = p + (q − p)·ratio: r scaled by ratio (the scale s cancels)."""
    for i in range(q.size):
        q[i] = p[i] + (q[i] - p[i]) * ratio


# --- the public wrappers: allocate, resume after FULL, report NONFINITE ------------------------------------------


class NonFiniteAt(Exception):
    """A pass met NaN or ±inf at ``index`` (local to the arrays it was given)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def plain_bad_at(r: np.ndarray, pos: int) -> int:
    """The first non-finite index of r's block at ``pos`` (a pass stopped there with NONFINITE)."""
    return pos + int(np.flatnonzero(~np.isfinite(r[pos : pos + BLOCK]))[0])


def folded_bad_at(q: np.ndarray, p: np.ndarray, inv: np.float32, pos: int) -> int:
    """The first index of the block at ``pos`` where r = (q − p)·inv is not finite."""
    block = (q[pos : pos + BLOCK] - p[pos : pos + BLOCK]) * inv
    return pos + int(np.flatnonzero(~(np.abs(block) <= FLT_MAX))[0])


def _grown(out: np.ndarray, k: int) -> np.ndarray:
    """FULL: a block did not fit ``out``; a larger buffer holding its first ``k`` codes."""
    grown = np.empty(max(2 * out.size, k + BLOCK), np.int64)
    grown[:k] = out[:k]
    return grown


def encode_codes(
    r: np.ndarray, u: np.ndarray | None, tau: np.float32, base: np.ndarray | None = None, rewind: bool = False
) -> np.ndarray:
    """Entry codes (local indices) of the fused pass over the views r/u (u - base when base is given);
    grows its buffer as needed. Raises NonFiniteAt with the first bad index."""
    n = r.size
    out = np.empty(max(1024, n >> 8), np.int64)  # 0.4 % density before the first regrowth
    k, pos, added_end = 0, 0, (0 if u is not None else n)
    uu = u if u is not None else r  # not read when added_end == n
    mode = ADD if base is None else DIFF_REWIND if rewind else DIFF
    while True:
        k, pos, status = _accumulate_encode(r, uu, uu if base is None else base, mode, tau, out, k, pos, added_end)
        if status == OK:
            return out[:k]
        if status == NONFINITE:
            raise NonFiniteAt(plain_bad_at(r, pos))
        out = _grown(out, k)
        added_end = max(added_end, pos + BLOCK)  # that block is accumulated already


def folded_encode_codes(q: np.ndarray, p: np.ndarray, inv: np.float32, tau: np.float32, step: np.float32) -> np.ndarray:
    """Entry codes of r = (q − p)·inv, q moved by ∓step at each (`_folded_encode`); raises NonFiniteAt."""
    out = np.empty(max(1024, q.size >> 8), np.int64)
    k, pos = 0, 0
    while True:
        k, pos, status = _folded_encode(q, p, inv, tau, step, out, k, pos)
        if status == OK:
            return out[:k]
        if status == NONFINITE:
            raise NonFiniteAt(folded_bad_at(q, p, inv, pos))
        out = _grown(out, k)


def folded_clip(q: np.ndarray, p: np.ndarray, inv: np.float32, bound: np.float32, scaled_bound: np.float32) -> int:
    """`_folded_clip`: r clipped to ±bound through q; the entries clipped."""
    return int(_folded_clip(q, p, inv, bound, scaled_bound))


def folded_rescale(q: np.ndarray, p: np.ndarray, ratio: np.float32) -> None:
    """`_folded_rescale`: r scaled by ratio through q."""
    _folded_rescale(q, p, ratio)
