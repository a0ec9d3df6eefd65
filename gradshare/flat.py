"""One contiguous float32 buffer holding every trainable parameter of a module.

The module's parameters become views into the buffer, so the encoding kernels see the whole model as
one 1-D NumPy array (`FlatParams.array`) without copies, and applying a decoded message changes the
module in place (DESIGN.md, "One training step").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class FlatParams:
    """Rebinds `module`'s trainable parameters onto one float32 buffer; `array` is that buffer."""

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"model {type(module).__name__} has no trainable parameters (none with requires_grad=True); "
                "there is nothing to train or share"
            )
        for name, p in named:
            if p.dtype in (torch.float16, torch.bfloat16):
                # The buffer is the float32 master copy every update is encoded from and applied to;
                # half-precision compute is autocast's job (precision.py), not the parameters'.
                raise TypeError(
                    f"parameter {name!r} is {p.dtype}; gradshare keeps float32 parameters (the master copy "
                    "its updates are encoded from): keep the model in float32 (model.float()) and pass "
                    "precision='bf16-mixed' (or 'fp16-mixed') to SharedTrainer to compute in half precision"
                )
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name!r} is {p.dtype}; gradshare trains float32 parameters "
                                "(call model.float() first)")
            if p.device.type != "cpu":
                raise TypeError(f"parameter {name!r} is on {p.device}; gradshare trains CPU parameters "
                                "(call model.cpu() first)")
        self.names = [name for name, _ in named]
        self.n_params = sum(p.numel() for _, p in named)
        self.params = [p for _, p in named]
        self.buffer = torch.empty(self.n_params, dtype=torch.float32)
        self.array: np.ndarray = self.buffer.numpy()  # shares memory with `buffer`
        self.live = self.views(self.array)  # the parameters' own views of `buffer`
        with torch.no_grad():
            for p, view in zip(self.params, self.live):
                view.copy_(p)
                p.data = view  # the Parameter object stays (optimizers keep working); its storage moves
        self.twin: np.ndarray | None = None  # see keep_twin()

    def keep_twin(self) -> np.ndarray:
        """Allocate `twin`, a second copy of `array`. Whoever changes the parameters between steps
        (the apply log, `load`) changes both alike, so at the start of a step the twin still holds P
        after the step's local work has moved `array` away from it: the worker measures the update
        against it and rewinds `array` to it in one pass, without copying P every step."""
        if self.twin is None:
            self.twin = self.array.copy()
        return self.twin

    def views(self, array: np.ndarray) -> list[torch.Tensor]:
        """One tensor per parameter, shaped like it, aliasing its slice of `array` (float32, n_params):
        the layout of `buffer`, over any flat array."""
        if array.dtype != np.float32 or array.shape != (self.n_params,) or not array.flags.c_contiguous:
            raise ValueError(f"need a C-contiguous float32 array of shape ({self.n_params},), got "
                             f"{array.dtype} {array.shape}")
        flat = torch.from_numpy(array)
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def versions(self) -> list[int]:
        """torch's in-place version counters of the parameters: they change when a parameter is
        modified in place through it (``p += x``, ``p.copy_``, ``p.detach().add_``), not when its
        storage is written through ``p.data``, `array` or another alias."""
        return [p._version for p in self.params]

    def load(self, values: np.ndarray) -> None:
        """Overwrite every parameter with `values` (a flat float32 array of n_params)."""
        values = np.asarray(values)
        if values.shape != (self.n_params,):
            raise ValueError(f"parameter array has shape {values.shape}, the model needs ({self.n_params},)")
        np.copyto(self.array, values, casting="same_kind")
        if self.twin is not None:
            np.copyto(self.twin, self.array)
