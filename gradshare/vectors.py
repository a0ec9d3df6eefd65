"""Small operations on a flat float32 vector that is either a NumPy array (the CPU default, where the
Numba kernels run) or a torch tensor on a device (issue 11: the state, the residual and the twin live on
the GPU). The worker calls these instead of carrying two copies of its step: each one does the same
float32 operation on either kind, so both paths keep the same bits (encoding/torch_codec.py).

Indices that address such a vector are host int64 arrays (a message's entries are decoded on the host);
`index_for` moves them next to a tensor once, so a lookahead gathers and scatters on the device.
"""

from __future__ import annotations

import sys

import numpy as np


def is_tensor(x) -> bool:
    """Whether ``x`` is a torch.Tensor (without importing torch when nothing has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def copy_of(x):
    """A new vector with ``x``'s values, of the same kind and on the same device."""
    return x.clone() if is_tensor(x) else x.copy()


def copy_into(dst, src) -> None:
    """dst[:] = src (same length, same kind)."""
    if is_tensor(dst):
        dst.copy_(src)
    else:
        np.copyto(dst, src)


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array: itself when it is one, else a copy on the host (one transfer)."""
    if is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def index_for(x, index: np.ndarray):
    """Host int64 indices ready to index ``x``: themselves for an array, a tensor on x's device else."""
    if is_tensor(x):
        import torch

        return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(x.device)
    return index


def where(condition, a, b):
    """Elementwise ``a`` where ``condition`` holds, else ``b`` (np.where / torch.where)."""
    if is_tensor(condition):
        import torch

        return torch.where(condition, a, b)
    return np.where(condition, a, b)
