"""Public threshold codec: `encode` (fused r += u and threshold encode) and `apply` (decode-apply).

Strom 2015 / DL4J `SharedTrainingMaster`: a worker keeps a residual r; each step r += u, every
|r_i| >= τ is sent as "±τ at i" and r_i -= ±τ stays local (one τ per entry per step).

Each function takes either kind of vector, a float32 NumPy array (the Numba kernels, numpy_codec.py) or
a float32 torch tensor on any device (torch_codec.py), and runs the backend of that kind (backend.py):
the same messages and vectors, bit for bit.

Non-finite values: if r + u becomes NaN or ±inf anywhere (a NaN/inf update, or float32 overflow),
`encode` raises ValueError naming the first such index. The residual has then been partly updated
(every block before that index is accumulated and reduced) and must be reset before it is used again:
a diverged step cannot be sent as ±τ entries.
"""

from __future__ import annotations

import numpy as np

from gradshare.encoding.backend import backend_of
from gradshare.encoding.message import Message

# "as Vector": re-exported, the encoding modules name it from here.
from gradshare.vectors import Vector as Vector


def encode(
    residual: Vector,
    update: Vector | None,
    threshold: float,
    *,
    form: str | None = None,
    threads: int = 1,
    base: Vector | None = None,
    rewind: bool = False,
) -> Message:
    """Accumulate ``update`` into ``residual`` IN PLACE and threshold-encode it.

    residual: float32, 1-D, C-contiguous, writable. After the call every |residual_i| that was >= τ
        has been reduced by one τ toward zero, and the message holds the matching ±τ entries.
    update: float32 array of the same shape, or None to encode ``residual`` as it is.
    threshold: τ > 0 (rounded to float32, the precision of the kernels), or a threshold rule object
        (its current ``.threshold`` is used; the rule is not advanced, see `encode_step`).
    form: None picks the smallest of empty/sparse/rice/bitmap; a form name forces it (benchmarks, tests).
    base: with ``update``, accumulate ``update - base`` instead (e.g. P_after and P_before of an optimizer
        step), rounded to float32 before it is added: bit-identical to ``encode(residual, update - base)``
        in one pass, without the temporary.
    rewind: with ``base``, also set ``update`` to ``base`` in the same pass (``update`` must be writable):
        the worker's parameters return to P_before without a copy. On the NaN/inf error, ``update`` is
        rewound up to the block that failed.
    threads: split the vector into this many contiguous ranges encoded in parallel (the kernels release
        the GIL). The message is identical for every thread count.

    Raises ValueError on NaN/inf, see the module docstring.

    A torch.Tensor residual (any device) runs the device-generic path, `torch_codec.encode`: the same
    message, bit for bit; update and base must then be tensors on the residual's device, and
    ``threads`` is not used (torch's own threads or the GPU do the work).
    """
    return backend_of(residual).encode(
        residual, update, threshold, form=form, threads=threads, base=base, rewind=rewind
    )


def apply(message: Message, params: Vector, scale: float = 1.0) -> None:
    """params[i] += ±τ·scale for every entry of ``message`` (decode-apply, in place).

    The step is computed once as float32(τ·scale) and added with float32 arithmetic, so every replica
    that applies the same messages in the same order gets bit-identical parameters. A torch.Tensor
    ``params`` (any device) is updated by `torch_codec.apply`, to the same bits.
    """
    backend_of(params).apply(message, params, scale)


def entry_codes(message: Message) -> np.ndarray:
    """The message's entry codes ``(index << 1) | neg``, ascending int64 (the bare decoder)."""
    if not isinstance(message, Message):
        raise TypeError(f"message must be a Message, got {type(message).__name__}")
    return message.codes()


def decode_entries(message: Message) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64 ascending, signs int8 of ±1) of the message's entries."""
    codes = entry_codes(message)
    return codes >> 1, (1 - 2 * (codes & 1)).astype(np.int8)


def decode(message: Message) -> np.ndarray:
    """The message as a dense float32 vector (zeros plus the ±τ entries)."""
    dense = np.zeros(message.n_params, np.float32)
    apply(message, dense)
    return dense


def convert(message: Message, form: str | None) -> Message:
    """The same entries in another form (None: the smallest)."""
    return Message.from_codes(entry_codes(message), message.threshold, message.n_params, form)
