"""One contiguous float32 buffer holding a module's state: every trainable parameter, then every
floating-point buffer (BatchNorm running statistics, any registered float buffer).

The module's parameters and buffers become views into the buffer, so the encoding kernels see the
parameters as one 1-D NumPy array (`FlatParams.array`, the first `n_params` entries) without copies,
and applying a decoded message changes the module in place (DESIGN.md, "One training step"). The whole
vector (`state`: parameters then buffers) is what the relay holds, what the log changes, what a snapshot
carries and what the end-of-fit hash covers, so a replica's buffers are as identical as its parameters
(README, "BatchNorm and other buffers").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def _check_dtype(kind: str, name: str, t: torch.Tensor) -> None:
    if t.dtype in (torch.float16, torch.bfloat16):
        # The buffer is the float32 master copy every update is encoded from and applied to;
        # half-precision compute is autocast's job (precision.py), not the state's.
        raise TypeError(
            f"{kind} {name!r} is {t.dtype}; gradshare keeps a float32 state (the master copy its updates are "
            "encoded from): keep the model in float32 (model.float()) and pass precision='bf16-mixed' (or "
            "'fp16-mixed') to SharedTrainer to compute in half precision"
        )
    if t.dtype != torch.float32:
        raise TypeError(f"{kind} {name!r} is {t.dtype}; gradshare trains float32 models (call model.float() first)")
    if t.device.type != "cpu":
        raise TypeError(f"{kind} {name!r} is on {t.device}; gradshare trains CPU models (call model.cpu() first)")


class FlatParams:
    """Rebinds `module`'s trainable parameters and float buffers onto one float32 buffer.

    `state` is that whole buffer (n_state = n_params + n_buffers entries); `array` its first n_params
    entries (the trainable parameters: what is encoded and sent), `buffer_array` the rest.
    Integer buffers (BatchNorm's num_batches_tracked) are not part of the state: they stay local.
    """

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
            _check_dtype("parameter", name, p)
        held = [(name, b) for name, b in module.named_buffers() if b.is_floating_point()]
        for name, b in held:
            _check_dtype("buffer", name, b)
        self.names = [name for name, _ in named]
        self.buffer_names = [name for name, _ in held]
        self.n_params = sum(p.numel() for _, p in named)
        self.n_buffers = sum(b.numel() for _, b in held)
        self.n_state = self.n_params + self.n_buffers
        self.params = [p for _, p in named]
        self.buffers = [b for _, b in held]
        self.buffer = torch.empty(self.n_state, dtype=torch.float32)
        self.state: np.ndarray = self.buffer.numpy()  # shares memory with `buffer`
        self.array: np.ndarray = self.state[: self.n_params]  # the parameters (a view: same memory)
        self.buffer_array: np.ndarray = self.state[self.n_params :]
        self.live = self.views(self.array)  # the parameters' own views of `buffer`
        with torch.no_grad():
            for t, view in zip(self.params + self.buffers, self.live + self._slices(self.buffer_array, self.buffers)):
                view.copy_(t)
                t.data = view  # the tensor object stays (optimizers, modules keep it); its storage moves
        self._owners = [(module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                        for name in self.buffer_names]
        self._buffer_ptrs = [b.data_ptr() for b in self.buffers]
        self.twin: np.ndarray | None = None  # see keep_twin()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds: the parameters, then the float buffers."""
        return self.params + self.buffers

    def check_buffers(self) -> None:
        """Raise if a module replaced a buffer instead of updating it in place: the new tensor is no
        longer part of the state, so its changes would silently stay on this replica."""
        for name, b, ptr, (owner, attr) in zip(self.buffer_names, self.buffers, self._buffer_ptrs, self._owners):
            if owner._buffers.get(attr) is not b or b.data_ptr() != ptr:
                raise TypeError(f"buffer {name!r} was rebound to new storage during the step; gradshare shares "
                                "buffers that modules update in place (e.g. running_mean.mul_(...)), not ones "
                                "they reassign")

    def buffer_entry_name(self, i: int) -> str:
        """'1.running_var[5]' for entry i of `buffer_array` (error messages)."""
        for name, b in zip(self.buffer_names, self.buffers):
            if i < b.numel():
                return f"buffer {name!r} entry {tuple(int(d) for d in np.unravel_index(i, tuple(b.shape)))}"
            i -= b.numel()
        raise IndexError(i)

    def _slices(self, array: np.ndarray, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.from_numpy(array)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return out

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
        return self._slices(array, self.params)

    def versions(self) -> list[int]:
        """torch's in-place version counters of the parameters: they change when a parameter is
        modified in place through it (``p += x``, ``p.copy_``, ``p.detach().add_``), not when its
        storage is written through ``p.data``, `array` or another alias."""
        return [p._version for p in self.params]

    def load(self, values: np.ndarray) -> None:
        """Overwrite every parameter and float buffer with `values` (a flat float32 state of n_state)."""
        values = np.asarray(values)
        if values.shape != (self.n_state,):
            raise ValueError(f"state array has shape {values.shape}, the model needs ({self.n_state},) "
                             f"({self.n_params} parameters + {self.n_buffers} buffer entries)")
        np.copyto(self.state, values, casting="same_kind")
        if self.twin is not None:
            np.copyto(self.twin, self.array)
