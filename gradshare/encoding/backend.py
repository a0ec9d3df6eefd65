"""Which backend runs the codec on a vector: NumPy arrays with the Numba kernels (numpy_codec.py) or
torch tensors on any device (torch_codec.py). Both are modules with the functions of `Backend`, the same
names, arguments and results, bit for bit.

A state picks its backend once, when it is built (`SharingState` for its residual or folded point,
`backend_for` a device); the stateless public functions (`encode`, `apply`, ...) ask `backend_of` their
vector once per call. This is the one place that tells the kinds apart, and the one place that imports
torch_codec (and so torch), only when a tensor or a device asks for it: the NumPy path never pays
torch's import (`gradshare bench encoding`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from gradshare.encoding import numpy_codec
from gradshare.encoding.message import Message
from gradshare.vectors import is_tensor

if TYPE_CHECKING:
    import torch

V = TypeVar("V")


class Backend(Protocol[V]):
    """The codec's operations on one kind ``V`` of flat float32 vector (each checks its arguments)."""

    def zeros(self, n: int, device: Any) -> V: ...

    def encode(
        self,
        residual: V,
        update: V | None,
        threshold: float,
        *,
        form: str | None = ...,
        threads: int = ...,
        base: V | None = ...,
        rewind: bool = ...,
    ) -> Message: ...

    def apply(self, message: Message, params: V, scale: float = ...) -> None: ...

    def quantile_threshold(self, values: V, density: float) -> float | None: ...

    def check_residual(self, residual: object) -> V: ...

    def clip(self, residual: V, bound: np.float32) -> None: ...

    def rescale(self, residual: V, ratio: np.float32) -> None: ...

    def load(self, residual: V, values: object) -> None: ...

    def like(self, point: V, values: object) -> V: ...

    def buffer_change(self, before: V, after: V, world_size: int) -> tuple[np.ndarray, np.ndarray]: ...

    def add_at(self, target: V, index: np.ndarray, values: np.ndarray) -> None: ...

    def check_pair(self, point: object, params: object) -> tuple[V, V]: ...

    def encode_folded(
        self, point: V, params: V, tau: float, inv: np.float32, step: np.float32, form: str | None = ...
    ) -> Message: ...

    def clip_folded(self, point: V, params: V, inv: np.float32, bound: np.float32, scaled: np.float32) -> int: ...

    def rescale_folded(self, point: V, params: V, ratio: np.float32) -> None: ...

    def unfold(self, point: V, params: V, inv: np.float32) -> V: ...

    def fold(self, point: V, params: V, residual: object, s: np.float32) -> None: ...


NUMPY: Backend[np.ndarray] = numpy_codec


def torch_backend() -> Backend[torch.Tensor]:
    """The torch backend (imports torch_codec, and torch, on first use)."""
    from gradshare.encoding import torch_codec  # here, not at the top: it imports torch (module docstring)

    return torch_codec


def backend_of(vector: object) -> Backend[Any]:
    """The backend of ``vector``'s kind: torch for a torch.Tensor, NumPy for anything else (whose
    functions then reject what is not a float32 array)."""
    return torch_backend() if is_tensor(vector) else NUMPY
