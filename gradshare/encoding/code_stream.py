"""A message's entry codes read a bounded batch at a time, in index order (a state object).

    stream = CodeStream(message)
    for codes in stream.batches():          # every code, BATCH at a time (a view, valid until the next)
        ...
    stream.below(hi)                        # or: the codes not yet taken whose index is < hi
    stream.reach()                          # the index after the decoded batch's last code

Why: `Message.codes()` returns all of a message's codes as one int64 array, 8 bytes an entry. A dense
step of a large model (the warm-up's density, a fixed τ early on) holds tens of millions of entries,
so code that reads several messages that way holds several full-size arrays at once; measured at
50 M parameters, two workers: a worker's peak 3.4× one process's (docs/benchmarks/memory.md). A
stream holds one batch whatever the message's size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gradshare.encoding import forms
from gradshare.encoding.message import Message

BATCH = 1 << 16  # codes decoded at a time: 512 kB of int64, in L2, and few enough Python calls at 100 M entries


class CodeStream:
    """The entry codes ``(index << 1) | neg`` of one message, ascending, decoded ``batch`` at a time."""

    def __init__(self, message: Message, batch: int = BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.form = forms.BY_NAME[message.form]
        self.reader = message.reader
        self.left = message.n_entries  # codes not decoded yet
        self.cursor = self.form.start
        self.buffer = np.empty(min(batch, max(message.n_entries, 1)), np.int64)
        self.head = self.buffer[:0]  # decoded and not taken yet

    def _refill(self) -> bool:
        cnt = min(self.buffer.size, self.left)
        if cnt == 0:
            return False
        self.cursor = self.form.decode_batch(self.reader, self.cursor, self.buffer, cnt)
        self.left -= cnt
        self.head = self.buffer[:cnt]
        return True

    def batches(self) -> Iterator[np.ndarray]:
        """Every code not taken yet, a batch at a time (each a view into the stream's buffer)."""
        while self.head.size or self._refill():
            head, self.head = self.head, self.buffer[:0]
            yield head

    def reach(self) -> int | None:
        """The index after the last code of the decoded batch (decoding the next batch when this one is
        taken), None when no code is left: `below` of any hi up to it takes codes of this batch only."""
        if not self.head.size and not self._refill():
            return None
        return int(self.head[-1] >> 1) + 1

    def below(self, hi: int) -> np.ndarray:
        """The codes not taken yet whose index is < ``hi`` (a new array: at most ``hi`` − the last index
        taken codes, since a message's indices are distinct)."""
        pieces = []
        while self.head.size or self._refill():
            k = int(np.searchsorted(self.head, hi << 1))  # code < hi << 1 exactly when index < hi
            if k:
                pieces.append(self.head[:k].copy())
            self.head = self.head[k:]
            if self.head.size:
                break
        if not pieces:
            return np.empty(0, np.int64)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


__all__ = ["BATCH", "CodeStream"]
