"""The relay's aggregate of one step: every rank's message summed into the relay's own residual, then
re-encoded as ONE message ("aggregated forwarding"; a state object and a function).

    state = AggregateState(n_params, n_buffers, rule=CalibratedThreshold(density=1e-3))
    agg = aggregate_step(state, [update_rank0, update_rank1, ...], step)   # StepUpdate, rank order

Why re-sparsify instead of an exact aggregate: with a calibrated τ ("auto", the default) every rank has
its own τ, and the union of N messages of m entries each holds ≈ N·m entries at low overlap, so an exact
aggregate (signed counts per index, or the messages grouped by τ) still costs ≈ N·m per receiver, i.e.
≈ N²·m at the relay. Keeping the relay's egress near N·m needs the relay to send a message about the
size of one rank's. This is two-level error feedback, as in hierarchical / "double-squeeze" compression
(Tang et al., ICML 2019): what the relay does not send stays in its residual and goes out in a later
step, so no update mass is lost, only delayed.

Buffer sections (BatchNorm statistics, encoding/update.py) are not thresholded: each rank already sent
its change ÷ N exactly, so the aggregate carries their float32 sum, added in rank order from 0, whole.

Every replica and the relay apply only the aggregated messages, in step order, so they stay
bit-identical; the relay is the only holder of this residual (it is not part of a replica's state).

Speed (p99 < 20 ms at N = 32): the residual carries a per-block bound of |r| (blockmax.py), so
the re-encode reads only the blocks that can hold an entry instead of all 4·n bytes; the adds and the
encode are the plain codec's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradshare.encoding import blockmax as _bm
from gradshare.encoding import forms, kernels
from gradshare.encoding.forms.base import apply_buffers
from gradshare.encoding.message import Message, to_float32_threshold
from gradshare.encoding.threshold import CalibratedThreshold, quantile_threshold
from gradshare.encoding.update import StepUpdate
from gradshare.errors import NonFiniteError

# A calibrated τ that more than this many times the target share of the sample reaches is a value
# many entries hold exactly (a tie), and Strom's rule would send every one of them. 2: the aggregate
# may be up to twice one rank's message (the relay's egress budget is 2·N·m a step), never N times it
TIE_SLACK = 2.0


class AggregateState:
    """The relay's aggregation state for one job.

    n_params: the message part of the state (the model's parameters).
    n_buffers: float buffer entries after them (0 for a model without BatchNorm statistics).
    rule: the τ rule of the aggregated message, a `CalibratedThreshold` (default: the workers'
        default density): the aggregated message stays about the size of one rank's.
    """

    def __init__(self, n_params: int, n_buffers: int = 0, rule: CalibratedThreshold | None = None) -> None:
        if isinstance(n_buffers, bool) or not isinstance(n_buffers, (int, np.integer)) or n_buffers < 0:
            raise ValueError(f"n_buffers must be an int >= 0, got {n_buffers!r}")
        rule = CalibratedThreshold() if rule is None else rule
        if not isinstance(rule, CalibratedThreshold):
            raise TypeError(
                f"rule must be a CalibratedThreshold (the aggregate's size follows its density), "
                f"got {type(rule).__name__}"
            )
        if isinstance(n_params, bool) or not isinstance(n_params, (int, np.integer)) or n_params < 1:
            raise ValueError(f"n_params must be an int >= 1, got {n_params!r}")
        self.rule = rule
        self.n_params = int(n_params)
        self.n_buffers = int(n_buffers)
        # no learning-rate following (SharingState's): the relay has no rate; its residual holds the
        # ranks' messages as sent (an apply scale, aggregate="mean", comes when the aggregate is applied)
        self.residual = np.zeros(self.n_params, np.float32)
        # per block of 1 << blockmax.SHIFT values, an upper bound of |residual| there: the residual must
        # change only through aggregate_step, which keeps this bound (blockmax.py)
        self.bound = np.zeros(_bm.n_blocks(self.n_params), np.float32)
        self.steps = 0  # aggregates made


def aggregate_step(state: AggregateState, updates: Sequence[StepUpdate], step: int) -> StepUpdate:
    """Add ``updates`` (one step's messages, in rank order) to the relay's residual and encode the
    step's one aggregated `StepUpdate` from it (the residual keeps what is not sent).

    Each message adds ±τ_r at its entries with float32 arithmetic, in the given order, so the result is
    a function of the messages and their order alone: the relay's aggregate is reproducible."""
    for i, u in enumerate(updates):  # all checked before any is added: a refusal changes nothing
        if u.message.n_params != state.n_params:
            raise ValueError(f"updates[{i}] is for {u.message.n_params} parameters, the aggregate for {state.n_params}")
        if len(u.buffer_index) and int(u.buffer_index[-1]) >= state.n_buffers:
            raise ValueError(
                f"updates[{i}] changes buffer entry {int(u.buffer_index[-1])}; the aggregate has {state.n_buffers}"
            )
    index = [u.buffer_index for u in updates if len(u.buffer_index)]
    for u in updates:
        add_message(state, u.message)
    message = encode_residual(state, aggregate_threshold(state, step))
    state.rule.update(message.n_entries, message.n_params)  # as encode_step: the rule sees what went out
    state.steps += 1
    if not index:
        return StepUpdate(message)
    total = np.zeros(state.n_buffers, np.float32)
    for u in updates:  # rank order, one float32 addition per entry and rank
        if len(u.buffer_index):
            total[u.buffer_index] += u.buffer_value
    where = np.unique(np.concatenate(index)).astype(np.uint32)
    return StepUpdate(message, where, total[where])


# The forms whose payload the bounded add reads as it decodes, by wire tag; any other form (the bitmap,
# rare on a relay's inbound messages) is decoded to codes first.
_STREAM_ADD = {forms.SPARSE.tag: _bm.add_sparse, forms.RICE.tag: _bm.add_rice}


def add_message(state: AggregateState, message: Message) -> None:
    """residual += the message's ±τ (codec.apply's float32 additions, in entry order), keeping the bound."""
    if message.n_entries == 0:
        return
    steps, batch = apply_buffers(message.step(1.0), message.n_entries)
    r, bound = state.residual, state.bound
    add = _STREAM_ADD.get(forms.BY_NAME[message.form].tag)
    if add is None:
        _bm.add_codes(message.codes(), steps, r, bound)
        return
    add(message.reader, message.n_entries, steps, r, bound, batch)


def encode_residual(state: AggregateState, tau: float) -> Message:
    """codec.encode(residual, None, tau), reading only the blocks whose bound reaches τ."""
    tau = to_float32_threshold(tau, "aggregate threshold")
    r = state.residual
    try:
        codes = _bm.encode_bounded(r, state.bound, np.float32(tau))
    except kernels.NonFiniteAt as exc:
        i = exc.index
        raise NonFiniteError(
            f"residual is not finite at index {i} (residual[{i}] = {r[i]!r}); the residual "
            f"is partly updated and must be reset"
        ) from None
    return Message.from_codes(codes, tau, r.size, None)


def aggregate_threshold(state: AggregateState, step: int) -> float:
    """The calibrated τ of the step (the rule's quantile of a strided sample of the residual), made a
    float32 ulp larger when the sample says a tie at τ would send far more than the target share.

    Why: each rank's message adds exactly ±τ_r, so the relay's residual holds N groups of equal
    magnitudes, and the quantile often lands on one of them; under Strom's rule (send |r| ≥ τ) the
    whole group would go, up to one more rank's message. Above the tie those entries wait a step (or
    more) in the residual instead, and the aggregate stays near the target size (≤ 2·N·m)."""
    rule, n = state.rule, state.n_params
    stride = rule.stride(n, step)
    # one gather of the strided sample (on 10 M parameters its cache misses are most of the cost); the
    # sample moves every step, as a worker's does (sharing.py)
    sample = np.abs(state.residual[step % stride :: stride])
    sample = sample[np.isfinite(sample)]  # a NaN/inf is the encoder's to report, with its index
    target = rule.target(step, n)
    kth = quantile_threshold(sample, target)
    if kth is not None:  # as CalibratedThreshold.calibrate: an all-zero sample keeps the last τ
        rule.tau = to_float32_threshold(kth, "aggregate threshold")
    tau = rule.tau
    if np.count_nonzero(sample >= np.float32(tau)) > TIE_SLACK * target * sample.size + 1:
        tau = float(np.nextafter(np.float32(tau), np.float32(np.inf)))
    return tau
