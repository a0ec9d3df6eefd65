"""One contiguous float32 buffer holding a module's state: every trainable parameter, then every
persistent floating-point buffer (BatchNorm running statistics, any float buffer in the state_dict).

The module's parameters and buffers become views into the buffer, so the encoding kernels see the
parameters as one 1-D NumPy array (`FlatParams.array`, the first `n_params` entries) without copies,
and applying a decoded message changes the module in place (docs/design.md, "One training step"). The whole
vector (`state`: parameters then buffers) is what the relay holds, what the log changes, what a snapshot
carries and what the end-of-fit hash covers, so a replica's buffers are as identical as its parameters
(docs/guide/models.md, "BatchNorm and other buffers").

Which buffers are shared: the persistent float buffers (those in ``state_dict()``). A non-persistent
buffer (``register_buffer(..., persistent=False)``: causal masks, rotary cos/sin caches, anything a module
derives and rebuilds) is not model state; it stays local to each replica, outside the flat state and the
end-of-fit hash, as it stays outside a checkpoint. Integer buffers stay local too (`int_buffers`).

On a device (``FlatParams(module, device=...)``) the buffer is a float32 torch tensor there, and
`state`, `array`, `buffer_array` and `twin` are torch views of it instead of NumPy ones: the codec, the
apply log and the worker take either (encoding/torch_codec.py, vectors.py). Without a device they stay
the NumPy views the Numba kernels run on, the CPU default.

The copies that follow P (`twin`, `point`: `followers`) change only with it, through the methods that
change P between steps (`apply_update`, `add`, `load`, `sync_followers`, `put`), so no caller keeps them
in step by hand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from gradshare.encoding import Message, StepUpdate, apply, apply_update
from gradshare.encoding.step_cap import StepCap, apply_step
from gradshare.vectors import Vector, copy_into, copy_of, to_host


def _check_dtype(kind: str, name: str, t: torch.Tensor, on_device: bool) -> None:
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
    if t.device.type != "cpu" and not on_device:
        # The NumPy state is host memory; SharedTrainer ships a CPU model and each worker moves it to
        # its device (SharedTrainer(runtime=Runtime(device=...))).
        raise TypeError(
            f"{kind} {name!r} is on {t.device}; pass the model on the CPU (model.cpu()) and "
            "choose where it trains with SharedTrainer(runtime=Runtime(device=...))"
        )


class FlatParams:
    """Rebinds `module`'s trainable parameters and persistent float buffers onto one float32 buffer.

    `state` is that whole buffer (n_state = n_params + n_buffers entries); `array` its first n_params
    entries (the trainable parameters: what is encoded and sent), `buffer_array` the rest.
    Integer buffers (BatchNorm's num_batches_tracked) and non-persistent buffers are not part of the
    state: they stay local (`shared_buffers`).

    device: None (default) for a NumPy state in host memory (the Numba path); a torch.device for a torch
        tensor state there ("cpu" included: the device code path without a GPU, for tests). The
        rebound parameters and buffers then live on it; move the rest of the module (integer buffers,
        frozen parameters) with ``module.to(device)`` first.
    """

    def __init__(self, module: nn.Module, device: torch.device | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"model {type(module).__name__} has no trainable parameters (none with requires_grad=True); "
                "there is nothing to train or share"
            )
        for name, p in named:
            _check_dtype("parameter", name, p, device is not None)
        held = shared_buffers(module)
        for name, b in held:
            _check_dtype("buffer", name, b, device is not None)
        self.names = [name for name, _ in named]
        self.buffer_names = [name for name, _ in held]
        self.n_params = sum(p.numel() for _, p in named)
        self.n_buffers = sum(b.numel() for _, b in held)
        self.n_state = self.n_params + self.n_buffers
        self.params = [p for _, p in named]
        self.buffers = [b for _, b in held]
        self.device = None if device is None else torch.device(device)
        self.buffer = torch.empty(self.n_state, dtype=torch.float32, device=self.device)
        # shares memory with `buffer`: a NumPy view on the default path, `buffer` itself on a device
        self.state: Vector = self.buffer if self.device is not None else self.buffer.numpy()
        self.array = self.state[: self.n_params]  # the parameters (a view: same memory)
        self.buffer_array = self.state[self.n_params :]
        self.live = self.views(self.array)  # the parameters' own views of `buffer`
        with torch.no_grad():
            for t, view in zip(self.params + self.buffers, self.live + self._slices(self.buffer_array, self.buffers)):
                view.copy_(t)
                t.data = view  # the tensor object stays (optimizers, modules keep it); its storage moves
        self._owners = [
            (module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]) for name in self.buffer_names
        ]
        self._buffer_ptrs = [b.data_ptr() for b in self.buffers]
        self.twin: Vector | None = None  # see keep_twin()
        self.point: Vector | None = None  # see keep_point()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds: the parameters, then the float buffers."""
        return self.params + self.buffers

    def check_buffers(self) -> None:
        """Raise if a module replaced a buffer instead of updating it in place: the new tensor is no
        longer part of the state, so its changes would silently stay on this replica."""
        for name, b, ptr, (owner, attr) in zip(self.buffer_names, self.buffers, self._buffer_ptrs, self._owners):
            if owner._buffers.get(attr) is not b or b.data_ptr() != ptr:
                raise TypeError(
                    f"buffer {name!r} was rebound to new storage during the step; gradshare shares "
                    "buffers that modules update in place (e.g. running_mean.mul_(...)), not ones "
                    "they reassign"
                )

    def buffer_entry_name(self, i: int) -> str:
        """'1.running_var[5]' for entry i of `buffer_array` (error messages)."""
        for name, b in zip(self.buffer_names, self.buffers):
            if i < b.numel():
                return f"buffer {name!r} entry {tuple(int(d) for d in np.unravel_index(i, tuple(b.shape)))}"
            i -= b.numel()
        raise IndexError(i)

    def _slices(self, array: Vector, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return out

    def keep_twin(self) -> Vector:
        """Allocate `twin`, a second copy of `array`. Whoever changes the parameters between steps
        (the apply log, `load`) changes both alike, so at the start of a step the twin still holds P
        after the step's local work has moved `array` away from it: the worker measures the update
        against it and rewinds `array` to it in one pass, without copying P every step."""
        if self.twin is None:
            self.twin = copy_of(self.array)
        return self.twin

    def keep_point(self) -> Vector:
        """Allocate `point`, P plus a worker's scaled residual (the folded local view, local_view.py),
        equal to P (residual 0). The apply log adds every message to it as to P, so the difference stays
        the residual; `load` (a fresh snapshot: the residual starts from zero) sets it to P again."""
        if self.point is None:
            self.point = copy_of(self.array)
        return self.point

    def views(self, array: Vector) -> list[torch.Tensor]:
        """One tensor per parameter, shaped like it, aliasing its slice of `array` (float32, n_params; a
        NumPy array, or a torch tensor on the state's device): the layout of `buffer`, over any flat array."""
        if isinstance(array, torch.Tensor):
            if (
                array.dtype != torch.float32
                or tuple(array.shape) != (self.n_params,)
                or not array.is_contiguous()
                or array.device != self.buffer.device
            ):
                raise ValueError(
                    f"need a contiguous float32 tensor of shape ({self.n_params},) on "
                    f"{self.buffer.device}, got {array.dtype} {tuple(array.shape)} on {array.device}"
                )
        elif array.dtype != np.float32 or array.shape != (self.n_params,) or not array.flags.c_contiguous:
            raise ValueError(
                f"need a C-contiguous float32 array of shape ({self.n_params},), got {array.dtype} {array.shape}"
            )
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
            raise ValueError(
                f"state array has shape {values.shape}, the model needs ({self.n_state},) "
                f"({self.n_params} parameters + {self.n_buffers} buffer entries)"
            )
        state = self.state
        if isinstance(state, np.ndarray):  # device None: the state is this NumPy view
            np.copyto(state, values, casting="same_kind")
        else:  # the host snapshot crosses to the device once
            host = values.astype(np.float32, casting="same_kind", copy=False)
            state.copy_(torch.from_numpy(np.ascontiguousarray(host)))
        self.sync_followers()

    @property
    def followers(self) -> tuple[Vector, ...]:
        """The copies of P kept (`twin`, `point`): whatever changes P between steps changes them alike."""
        return tuple(v for v in (self.twin, self.point) if v is not None)

    def apply_update(self, update: StepUpdate, scale: float) -> None:
        """One decoded message of the log × `scale`: into the state (parameters and float buffers) and
        into every follower (the twin stays P; the folded point stays P + s·r: r does not change)."""
        apply_update(update, self.state, scale)
        for v in self.followers:
            apply(update.message, v, scale)

    def apply_step(self, updates: Sequence[StepUpdate], scale: float, cap: StepCap | None) -> None:
        """One whole step's decoded messages (rank order) × `scale`, each tensor's share capped by `cap`
        (encoding/step_cap.py; None: as `apply_update` one by one), into the state and every follower."""
        apply_step(updates, self.state, scale, cap, self.followers)

    def add(self, message: Message, scale: float) -> None:
        """`message` × `scale` into P and every follower (the own-update lookahead, lookahead.py)."""
        apply(message, self.array, scale)
        for v in self.followers:
            apply(message, v, scale)

    def sync_followers(self) -> None:
        """Every follower := P (after P was overwritten: the folded point's residual starts from 0)."""
        for v in self.followers:
            copy_into(v, self.array)

    def put(self, idx: Vector, values: Vector, point_values: Vector | None = None) -> None:
        """P and its twin at `idx` := `values`; the folded point there := `point_values` (None: left as
        it is). Every vector of P's kind (`device`)."""
        self.array[idx] = values  # type: ignore[assignment]  # one kind: mypy cannot tie the union
        if self.twin is not None:
            self.twin[idx] = values  # type: ignore[assignment]
        if self.point is not None and point_values is not None:
            self.point[idx] = point_values  # type: ignore[assignment]

    def host_state(self) -> np.ndarray:
        """The state as a NumPy array (hashing, snapshots): the state itself on the default path, a copy
        from the device otherwise."""
        return to_host(self.state)


def frozen_digest(module: nn.Module) -> str | None:
    """A digest of the parameters the flat state does not hold (requires_grad=False: a LoRA model's frozen
    base), by name, dtype, shape and bytes; None where there are none. Every replica must start from the
    driver's: a worker compares its own with the one the driver shipped (task/worker.py)."""
    frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for name, p in frozen:
        digest.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
        if p.device.type != "meta" and p.numel():  # the bytes as they lie: no copy on the host
            digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def shared_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) of every buffer the flat state holds: float, and persistent (registered without
    ``persistent=False``, so in ``module.state_dict()``). A forward pass may change them (running
    statistics: the change is shared exactly, encoding/update.py) or not (a constant mask kept
    persistent: never a change, whatever its values, ±inf and NaN included)."""
    # torch's own record of persistence, the one state_dict() consults: a state_dict hook that renames
    # keys must not turn a running statistic into a local buffer
    local = {
        id(b)
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None and name in m._non_persistent_buffers_set
    }
    return [(name, b) for name, b in module.named_buffers() if b.is_floating_point() and id(b) not in local]


def int_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's integer buffers (BatchNorm's num_batches_tracked), copied to the CPU: they are not
    part of the flat state, so whoever carries a replica's state (a report, a checkpoint) takes them."""
    return {name: b.detach().cpu().clone() for name, b in module.named_buffers() if not b.is_floating_point()}


def load_int_buffers(module: nn.Module, values: Mapping[str, torch.Tensor | np.ndarray]) -> None:
    """Copy `values` (tensors or arrays, from `int_buffers`) into the module's integer buffers."""
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in values.items():
            buffers[name].copy_(torch.as_tensor(value))
