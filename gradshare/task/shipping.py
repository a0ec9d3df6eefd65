"""What the driver ships to the workers inside the Spark job closure, and how a worker unpacks it.

Two concerns, both about the closure:

- Fail fast on user objects. The user's model, loss, optimizer factory, scheduler factory and metric
  travel as ONE bytes field pickled with cloudpickle on the driver (`pack_user_objects`) and are
  unpickled by the worker inside its error handling (`unpack_user_objects`). A class the executors cannot
  import then raises ModuleNotFoundError in our code, where the worker reports it to the relay and the
  driver names it, instead of Spark failing the task while it unpickles the closure ("barrier task
  finished unsuccessfully", after every stage retry). The transport never carries pickle: these bytes
  ride in the Spark closure, as the objects did before.

- Memory. The model ships as a skeleton (`skeleton`): every tensor of the flat state is a meta tensor
  (shape and dtype, no data), so neither the pickled closure (which PySpark may keep as a cached
  broadcast on the executor) nor the unpickled object holds a copy of the weights. The worker gives
  those tensors uninitialised CPU storage (`materialize`) and fills its flat buffer from the relay's
  snapshot, which is the initial parameters before any step.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from pyspark import cloudpickle
from torch import nn


class Shipped(Protocol):
    """What the packing reads of a config: a dataclass (task.config.WorkerConfig) with the user's objects in
    `user` and, packed, in `user_objects`. A protocol, not WorkerConfig itself: the task body (train.py)
    imports this module."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def user(self) -> object | None: ...

    @property
    def user_objects(self) -> bytes | None: ...


C = TypeVar("C", bound=Shipped)


def pack_user_objects(cfg: C) -> C:
    """`cfg` with its user's objects (`user`: the model, loss, optimizer factory, ...) cloudpickled into
    ``cfg.user_objects`` and `user` set to None."""
    return dataclasses.replace(cfg, user_objects=cloudpickle.dumps(cfg.user), user=None)


def unpack_user_objects(cfg: C) -> C:
    """The inverse of `pack_user_objects` (a cfg without packed objects is returned as it is). Raises
    whatever unpickling raises, e.g. ModuleNotFoundError naming a module the executor cannot import."""
    if cfg.user_objects is None:
        return cfg
    user = pickle.loads(cfg.user_objects)  # cloudpickle's output is plain pickle to load
    return dataclasses.replace(cfg, user_objects=None, user=user)


def skeleton(model: nn.Module, tensors: Iterable[Any]) -> nn.Module:
    """A deep copy of `model` in which each of `tensors` (the tensors the flat state holds: their
    values come from the relay) is a meta tensor of the same shape, dtype and requires_grad; every other
    tensor (e.g. an int buffer such as BatchNorm's num_batches_tracked) is copied as it is.

    The copy never touches the data of `tensors`: deepcopy finds their replacements in its memo."""
    memo: dict[int, Any] = {}
    for t in tensors:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def materialize(model: nn.Module) -> nn.Module:
    """Give every meta parameter and buffer of `model` uninitialised CPU storage, in place (a tensor
    shared by several modules stays shared); returns `model`. The values are garbage until the caller
    loads them (the worker: from the relay's snapshot)."""
    done: dict[int, tuple[Any, Any]] = {}  # id -> (meta tensor kept alive so the id stays unique, new)
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    real = torch.empty_like(t, device="cpu")
                    done[id(t)] = (
                        t,
                        nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real,
                    )
                store[name] = done[id(t)][1]
    return model
