"""Small operations on a flat float32 vector that is either a NumPy array (the CPU default, where the
Numba kernels run) or a torch tensor on a device (the state, the residual and the twin live on
the GPU). The worker calls these instead of carrying two copies of its step: each one does the same
float32 operation on either kind, so both paths keep the same bits (encoding/torch_codec.py).

Indices that address such a vector are host int64 arrays (a message's entries are decoded on the host);
`index_for` moves them next to a tensor once, so a lookahead gathers and scatters on the device.

This module never imports torch at load (the codec imports it, and the NumPy path must not pay ~3 s for
torch): a tensor branch imports it where it runs, when a tensor shows it is loaded already.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeVar, Union, overload

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:  # for annotations only: the NumPy path never imports torch (`gradshare bench encoding`)
    import torch
    from typing_extensions import TypeIs

# A flat float32 vector: a NumPy array (the Numba kernels) or a torch tensor on any device
# (encoding/torch_codec.py). The codec and the helpers below take either and dispatch on its kind.
Vector = Union[np.ndarray, "torch.Tensor"]
# where two or more vectors must be of one kind (two arrays, or two tensors), and a result of that kind
SameVector = TypeVar("SameVector", np.ndarray, "torch.Tensor")


def is_tensor(x: object) -> TypeIs[torch.Tensor]:
    """Whether ``x`` is a torch.Tensor, without importing torch: if nothing imported torch, nothing can
    be a tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


@overload
def copy_of(x: np.ndarray) -> np.ndarray: ...
@overload
def copy_of(x: torch.Tensor) -> torch.Tensor: ...
@overload
def copy_of(x: Vector) -> Vector: ...  # a vector of either kind (FlatParams.array): a copy of that kind


def copy_of(x: Vector) -> Vector:
    """A new vector with ``x``'s values, of the same kind and on the same device."""
    return x.clone() if is_tensor(x) else x.copy()


def copy_into(dst: Vector, src: Vector) -> None:
    """dst[:] = src (same length, same kind)."""
    if is_tensor(dst):
        if not is_tensor(src):  # what Tensor.copy_ raised for an array, named
            raise TypeError(f"src must be a torch.Tensor like dst, got {type(src).__name__}")
        dst.copy_(src)
    else:
        np.copyto(dst, src)


def to_host(x: Vector) -> np.ndarray:
    """``x`` as a NumPy array: itself when it is one, else a copy on the host (one transfer)."""
    if is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def index_for(x: Vector, index: NDArray[np.int64]) -> Vector:
    """Host int64 indices ready to index ``x``: themselves for an array, a tensor on x's device else."""
    if is_tensor(x):
        import torch  # already loaded (x is a tensor): the module itself never imports it

        return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(x.device)
    return index


def where(condition: SameVector, a: SameVector, b: SameVector) -> SameVector:
    """Elementwise ``a`` where ``condition`` holds, else ``b`` (np.where / torch.where)."""
    if is_tensor(condition):
        import torch  # already loaded (condition is a tensor): the module itself never imports it

        return torch.where(condition, a, b)
    return np.where(condition, a, b)
