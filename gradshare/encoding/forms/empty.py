"""The *empty* form: no entries, no payload. Every step sends a message, an empty one when nothing
crossed τ, so that the apply log can advance (DESIGN.md, "Consistency model")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradshare.encoding.forms.base import CodeSizes, CodeWriter, written

_NOTHING = np.empty(0, np.uint8)
_NOTHING.flags.writeable = False


class _NoCodes:
    """The empty payload (base.CodeWriter): any code is one too many."""

    def add(self, codes: np.ndarray) -> None:
        if codes.size:
            raise ValueError(f"form 'empty' cannot hold {codes.size} entries")

    def payload(self) -> bytes:
        return b""


@dataclass(frozen=True)
class EmptyForm:
    """No payload: holds zero entries only."""

    name: str = "empty"
    tag: int = 0

    def size(self, sizes: CodeSizes) -> int | None:
        return 0 if sizes.n_entries == 0 else None

    def encode(self, codes: np.ndarray, sizes: CodeSizes) -> bytes:
        return written(self, codes, sizes)

    def writer(self, sizes: CodeSizes) -> CodeWriter:
        return _NoCodes()

    def validate(self, payload: bytes, n_params: int, n_entries: int) -> np.ndarray:
        if n_entries or payload:
            raise ValueError(f"empty form needs n_entries == 0 and no payload, got {n_entries} / {len(payload)} bytes")
        return _NOTHING

    def reader(self, payload: bytes) -> np.ndarray:
        return _NOTHING

    def decode(self, reader: np.ndarray, n_entries: int, out: np.ndarray) -> None:
        pass

    def apply(self, reader: np.ndarray, n_entries: int, step: np.float32, params: np.ndarray) -> None:
        pass

    @property
    def start(self) -> tuple[int, int]:
        return 0, -1

    def decode_batch(self, reader: np.ndarray, cursor: tuple[int, int], out: np.ndarray, cnt: int) -> tuple[int, int]:
        if cnt:
            raise ValueError(f"form 'empty' holds no entries, {cnt} asked for")
        return cursor


EMPTY = EmptyForm()
