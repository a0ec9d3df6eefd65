"""What one worker step sends: the threshold-encoded parameter update and, for a model with float
buffers (BatchNorm running statistics), the exact change of those buffers.

Buffers are not trained by gradients: a BatchNorm layer moves its running mean by
``momentum × (batch mean − running mean)`` in the forward pass. That change is large next to τ and
there are few buffer entries (a few per channel), so it travels exactly, as float32 values, not as ±τ
quanta. Each worker sends its change divided by the world size N; every replica and the relay add
every worker's values in the log's (step, sender) order, so the buffers are the same bits everywhere and
follow ``running ← running + momentum × (mean over workers of the batch statistic − running)``: the
running statistics of the global batch, as one process would keep them (docs/guide/models.md, "BatchNorm and other
buffers").

Wire format: the `Message` bytes, then, when the job's model has buffers, a section

    offset size field
    0      2    magic b"GB"
    2      1    version (1)
    3      1    reserved (0)
    4      4    count, uint32 (changed buffer entries, <= n_buffers)
    8      4·c  indices, uint32, strictly increasing, < n_buffers
    8+4c   4·c  values, float32, finite

A job without buffers sends the bare `Message` bytes, exactly as before.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradshare.encoding.backend import backend_of
from gradshare.encoding.codec import apply
from gradshare.encoding.message import HEADER, HEADER_SIZE, Message
from gradshare.errors import DecodeError
from gradshare.vectors import SameVector, Vector

BUFFER_MAGIC = b"GB"
BUFFER_VERSION = 1
BUFFER_HEADER = struct.Struct("<2sBBI")
_EMPTY_INDEX = np.empty(0, np.uint32)
_EMPTY_VALUE = np.empty(0, np.float32)


@dataclass(frozen=True)
class StepUpdate:
    """One step's message plus the buffer entries it changes (indices relative to the buffer part)."""

    message: Message
    buffer_index: np.ndarray = field(default_factory=lambda: _EMPTY_INDEX)  # uint32, strictly increasing
    buffer_value: np.ndarray = field(default_factory=lambda: _EMPTY_VALUE)  # float32, finite, ÷ world size

    def to_bytes(self, n_buffers: int) -> bytes:
        head = self.message.to_bytes()
        if n_buffers == 0:
            return head
        count = len(self.buffer_index)
        return (
            head
            + BUFFER_HEADER.pack(BUFFER_MAGIC, BUFFER_VERSION, 0, count)
            + self.buffer_index.astype("<u4", copy=False).tobytes()
            + self.buffer_value.astype("<f4", copy=False).tobytes()
        )


def buffer_change(
    before: SameVector, after: SameVector, world_size: int, name: Callable[[int], str] = lambda i: f"buffer entry {i}"
) -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of the entries where the buffers moved, values = change ÷ world_size (float32).
    An entry moved when its bits changed: a constant ±inf (a causal mask) or NaN is no change, though
    its difference (−inf − (−inf)) is NaN. A moved entry must stay finite, or ValueError names it with
    `name(i)`. ``before``/``after`` are NumPy arrays or float32 torch tensors of one device: the change
    is found there, and only the changed entries come to the host (the same bits either way)."""
    index, values = backend_of(before).buffer_change(before, after, world_size)
    if not np.isfinite(values).all():
        bad = int(index[~np.isfinite(values)][0])
        raise ValueError(
            f"{name(bad)} became {float(after[bad])} in the step's forward pass (from "
            f"{float(before[bad])}); a buffer that changes is shared as its change, which must "
            "be finite (a constant non-finite buffer is fine; so is a non-persistent one)"
        )
    return index.astype(np.uint32), values


def decode_update(payload: bytes, n_state: int, *, n_params: int) -> StepUpdate:
    """Decode untrusted bytes of a job whose state has `n_params` parameters then buffers up to
    `n_state`. Raises DecodeError on anything invalid; lengths and indices are checked before use."""
    n_buffers = n_state - n_params
    if n_buffers < 0:
        raise ValueError(f"n_state {n_state} < n_params {n_params}")
    view = memoryview(payload).cast("B")
    if n_buffers == 0:
        return StepUpdate(_message(view, n_params))
    if len(view) < HEADER_SIZE:
        raise DecodeError(f"update too short: {len(view)} bytes < {HEADER_SIZE}-byte header")
    end = HEADER_SIZE + HEADER.unpack_from(view)[-1]
    if end + BUFFER_HEADER.size > len(view):
        raise DecodeError(f"update of {len(view)} bytes has no room for its buffer section after a {end}-byte message")
    magic, version, _, count = BUFFER_HEADER.unpack_from(view, end)
    if magic != BUFFER_MAGIC or version != BUFFER_VERSION:
        raise DecodeError(f"bad buffer section magic {magic!r} / version {version}")
    if count > n_buffers:
        raise DecodeError(f"buffer section has {count} entries, the model has {n_buffers} buffer entries")
    start = end + BUFFER_HEADER.size
    if len(view) - start != 8 * count:
        raise DecodeError(f"buffer section holds {len(view) - start} bytes, {count} entries need {8 * count}")
    index = np.frombuffer(view, "<u4", count, start).astype(np.uint32)
    values = np.frombuffer(view, "<f4", count, start + 4 * count).astype(np.float32)
    if count and (index[-1] >= n_buffers or (count > 1 and not (np.diff(index.astype(np.int64)) > 0).all())):
        raise DecodeError(f"buffer indices must be strictly increasing and < {n_buffers}")
    if not np.isfinite(values).all():
        raise DecodeError("buffer section holds a non-finite value")
    return StepUpdate(_message(view[:end], n_params), index, values)


def _message(view: memoryview, n_params: int) -> Message:
    msg = Message.from_bytes(view, max_params=n_params)
    if msg.n_params != n_params:
        raise DecodeError(f"update is for {msg.n_params} parameters, the job has {n_params}")
    return msg


def apply_update(update: StepUpdate, state: Vector, scale: float = 1.0) -> None:
    """state[:n_params] += ±τ·scale at the message's entries; the buffer part += the values (float32).
    ``state`` is a NumPy array or a float32 torch tensor on any device (the same bits: each index occurs
    once, so each entry sees one float32 addition on either)."""
    apply(update.message, state[: update.message.n_params], scale)
    add_buffers(update, state)


def add_buffers(update: StepUpdate, state: Vector) -> None:
    """The buffer part of `apply_update`: state[n_params:] += the values at their indices (float32)."""
    if len(update.buffer_index):
        buffers = state[update.message.n_params :]
        backend_of(buffers).add_at(buffers, update.buffer_index, update.buffer_value)
