"""What every message form is (`Form`), what it is sized from (`CodeSizes`), and the shared
validation error texts. The forms themselves live one per module beside this one (empty.py,
sparse.py, rice.py, bitmap.py); the registry that maps the wire tag to a form is forms/__init__.py.

A form turns sorted entry codes ``(i << 1) | neg`` (kernels.py) into payload bytes and back. Its
``reader`` is the payload as the array its kernels read (the bytes as uint8 for most, zero-padded
uint64 words for rice); `Message` keeps it, so a message is read without another copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gradshare.encoding.kernels import (
    CHECK_COUNT,
    CHECK_INDEX,
    CHECK_OK,
    CHECK_OVERLONG,
    CHECK_PADDING,
    CHECK_RESERVED,
    CHECK_TRAILING,
    CHECK_TRUNCATED,
)

APPLY_BATCH = 1024  # codes decoded per batch before they are applied (see kernels.apply_batch)


def apply_buffers(step: np.float32, n_entries: int) -> tuple[np.ndarray, np.ndarray]:
    """The (+step, −step) pair a code's sign bit picks from, and the batch the decoded codes go through."""
    return np.array([step, -step], np.float32), np.empty(min(n_entries, APPLY_BATCH), np.int64)


class CodeWriter(Protocol):
    """A payload written a batch of sorted codes at a time (`Form.writer`): `add` every batch in order,
    then take `payload`. A dense step's message is built this way without an array of all its codes."""

    def add(self, codes: np.ndarray) -> None: ...

    def payload(self) -> bytes: ...


@dataclass(frozen=True)
class CodeSizes:
    """One pass over a message's codes (forms/rice.py `measure`): what each form's size follows from."""

    n_params: int
    n_entries: int
    varint_bytes: int  # the sparse form's payload
    rice_k: int  # the best Rice parameter
    rice_bits: int  # the rice stream's bits after the k byte, for that k


class Form(Protocol):
    """One encoding form of a message's entries (the wire's form tag says which)."""

    @property
    def name(self) -> str: ...  # Message.form

    @property
    def tag(self) -> int: ...  # the header's form byte

    def size(self, sizes: CodeSizes) -> int | None:
        """Payload bytes of the measured entries in this form; None when it cannot hold them."""
        ...

    def encode(self, codes: np.ndarray, sizes: CodeSizes) -> bytes:
        """The payload of ``codes`` (sorted entry codes, as measured into ``sizes``)."""
        ...

    def writer(self, sizes: CodeSizes) -> CodeWriter:
        """A writer of the payload of the codes measured into ``sizes``, given a batch at a time."""
        ...

    def validate(self, payload: bytes, n_params: int, n_entries: int) -> np.ndarray:
        """Check untrusted payload bytes against the header (ValueError naming the problem); the reader."""
        ...

    def reader(self, payload: bytes) -> np.ndarray:
        """The reader of a payload this process built (trusted: no validation)."""
        ...

    def decode(self, reader: np.ndarray, n_entries: int, out: np.ndarray) -> None:
        """The entry codes of a validated payload into out[:n_entries]."""
        ...

    def apply(self, reader: np.ndarray, n_entries: int, step: np.float32, params: np.ndarray) -> None:
        """params[i] += ±step for every entry of a validated payload (float32, in entry order)."""
        ...

    @property
    def start(self) -> tuple[int, int]:
        """The cursor (position, last index) of a payload's first entry, for `decode_batch`."""
        ...

    def decode_batch(self, reader: np.ndarray, cursor: tuple[int, int], out: np.ndarray, cnt: int) -> tuple[int, int]:
        """The next ``cnt`` entry codes of a validated payload from ``cursor`` into out[:cnt] (the caller
        keeps cnt within the entries left); the cursor after them. A message is read in bounded batches
        this way (code_stream.py) without an array of all its codes."""
        ...


CHECK_TEXT = {
    CHECK_TRUNCATED: "an entry runs past the end of the payload",
    CHECK_OVERLONG: "a varint is longer than 9 bytes or not in shortest form, or the rice k is > 40",
    CHECK_INDEX: "an index is >= n_params",
    CHECK_TRAILING: "bytes are left over after n_entries entries",
    CHECK_PADDING: "bits are set past the last parameter (bitmap) or the last entry (rice)",
    CHECK_RESERVED: "the bitmap holds the reserved code 0b11",
    CHECK_COUNT: "the bitmap holds a different number of entries than n_entries",
}


def check(form: str, code: int) -> None:
    """Raise the ValueError of a validation kernel's CHECK_* result (nothing for CHECK_OK)."""
    if code != CHECK_OK:
        raise ValueError(f"invalid {form} payload: {CHECK_TEXT[code]}")


def written(form: Form, codes: np.ndarray, sizes: CodeSizes) -> bytes:
    """`Form.encode` as every form does it: its writer given all the codes at once."""
    writer = form.writer(sizes)
    writer.add(codes)
    return writer.payload()


def filled(buf: np.ndarray, end: int, n_entries: int, added: int, form: str) -> bytes:
    """A writer's payload once every entry is in: ValueError if the codes added were not the ones measured."""
    if added != n_entries or end != buf.size:
        raise ValueError(
            f"{form} payload: {added} codes written to {end} of {buf.size} bytes, measured {n_entries} entries"
        )
    return buf.tobytes()


def byte_reader(payload: bytes) -> np.ndarray:
    """The payload as uint8, the reader of the byte-oriented forms (a view: no copy)."""
    return np.frombuffer(payload, np.uint8)
