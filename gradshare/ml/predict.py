"""What runs on the executors in `GradshareModel.transform`, and the spec that says how.

The spec is plain JSON (saved in the model's metadata): each input's dtype and shape, whether the model
is a classifier, and the width of its output. The weights reach the executors once per transform as
one Spark broadcast of ``(architecture bytes, state_dict bytes)`` (on a Spark Connect session, which has
no broadcasts, as those bytes inside the pickled UDF, which the plan carries); each Python worker builds
the module from it once (pyspark's ModelCache, keyed by the predict_batch_udf) and reuses it for every batch.
torch.save/cloudpickle here are Spark's own data path for a model, not gradshare's UDP wire (which
carries no pickle).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import io
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias, TypedDict, cast

import numpy as np
import torch
from pyspark import Broadcast, TaskContext
from torch import nn

from gradshare.replica.losses import model_output

_INPUT = re.compile(r"(float32|int64|bool)\[([0-9, ]*)\]")
CLASSIFICATION_LOSSES = ("CrossEntropyLoss", "NLLLoss")


class InputSpec(TypedDict):
    """One input of the fitted model, as the spec's JSON holds it."""

    dtype: str  # "float32" | "int64" | "bool"
    shape: list[int]  # of one row


class OutputSpec(TypedDict):
    """The fitted model's output, as the spec's JSON holds it."""

    classification: bool
    width: int  # values per row
    scalar: bool  # a regressor with one value per row


# what the broadcast carries: (cloudpickled architecture factory, torch.save'd state_dict)
Payload: TypeAlias = tuple[bytes, bytes]
# the batch function predict_batch_udf calls: one array per input -> predictions (or prediction + probability)
Predict: TypeAlias = Callable[..., "np.ndarray | Mapping[str, np.ndarray]"]


def parse_inputs(described: str) -> list[InputSpec]:
    """FitResult.extra["inputs"] ("float32[64]" or "(float32[4], int64[])", batches.InputLayout.describe)
    as [{"dtype": ..., "shape": [...]}, ...]."""
    found = _INPUT.findall(described)
    if not found:
        raise ValueError(f"cannot read the fitted input layout {described!r}")
    return [{"dtype": d, "shape": [int(s) for s in dims.split(",") if s.strip()]} for d, dims in found]


def zero_batch(inputs: list[InputSpec]) -> tuple[torch.Tensor, ...]:
    """One row of zeros per input (zeros are valid ids for an Embedding too)."""
    return tuple(torch.zeros((1, *i["shape"]), dtype=getattr(torch, i["dtype"])) for i in inputs)


def output_spec(module: nn.Module, inputs: list[InputSpec], loss_name: str, task: str) -> OutputSpec:
    """Classifier or regressor, and the output's width, from the fitted loss and one forward pass on zeros.

    Classification (task "auto" with CrossEntropyLoss/NLLLoss, or task "classification") needs a (B, C)
    output: prediction = argmax as a double, probability = softmax. Regression: a (B,) or (B, 1) output
    is a double column, anything wider an array of the row's flattened outputs.
    """
    try:  # on a copy: a forward may keep state (counters, caches), as in losses.py's probe
        with torch.no_grad():
            out = model_output(copy.deepcopy(module).eval()(*zero_batch(inputs)))
    except Exception as e:  # noqa: BLE001 - a model that cannot run on the driver cannot be described
        raise ValueError(
            f"transform needs the model's output shape, but it did not run on one row of zeros on "
            f"the driver: {type(e).__name__}: {e}"
        ) from e
    if not torch.is_tensor(out):
        raise TypeError(f"transform needs a model returning one tensor; it returned {type(out).__name__}")
    classify = task == "classification" or (task == "auto" and loss_name in CLASSIFICATION_LOSSES)
    if classify and not (out.dim() == 2 and out.shape[1] > 1):
        raise ValueError(
            f"a classifier's output must be (B, C) with C > 1 classes for prediction and probability "
            f"columns, but it has shape (B, {', '.join(map(str, out.shape[1:]))}); set task='regression' "
            "for the raw output"
        )
    width = int(np.prod(out.shape[1:], dtype=np.int64))
    return {"classification": classify, "width": width, "scalar": not classify and width == 1}


@dataclass(frozen=True)
class ShippedModel:
    """A Connect session's large payload, shipped as a session file (SparkSession.addArtifacts): its name,
    which is its content's sha256 (a session file cannot be replaced, so a fine-tuned model is another
    name), read back and checked in the task."""

    name: str

    @classmethod
    def name_for(cls, data: bytes) -> str:
        return f"gradshare-model-{hashlib.sha256(data).hexdigest()}.bin"

    def payload(self) -> Payload:
        from pyspark import SparkFiles

        with open(SparkFiles.get(self.name), "rb") as f:
            data = f.read()
        if self.name_for(data) != self.name:
            raise ValueError(f"the model shipped as {self.name} does not match its sha256")
        return unpack_payload(data)


def pack_payload(payload: Payload) -> bytes:
    """(architecture, weights) as one file: the architecture's length (8 bytes, little-endian), then both."""
    return len(payload[0]).to_bytes(8, "little") + payload[0] + payload[1]


def unpack_payload(data: bytes) -> Payload:
    n = int.from_bytes(data[:8], "little")
    if not 0 <= n <= len(data) - 8:
        raise ValueError("a shipped model file holds a bad architecture length")
    return data[8 : 8 + n], data[8 + n :]


def make_predict(
    payload: Broadcast[Payload] | Payload | ShippedModel, inputs: list[InputSpec], output: OutputSpec, probability: bool
) -> Callable[[], Predict]:
    """A `make_predict_fn` for pyspark.ml.functions.predict_batch_udf (a picklable object: the UDF ships it).
    payload: a broadcast of it (classic), the bytes themselves (Connect: no broadcasts), or a session file
    holding them (Connect, a large model)."""
    return _MakePredict(payload, inputs, output, probability)


class _MakePredict:
    def __init__(
        self,
        payload: Broadcast[Payload] | Payload | ShippedModel,
        inputs: list[InputSpec],
        output: OutputSpec,
        probability: bool,
    ) -> None:
        self.payload, self.inputs, self.output, self.probability = payload, inputs, output, probability

    def __call__(self) -> Predict:
        shipped = self.payload
        module = load_module(
            *(
                shipped
                if isinstance(shipped, tuple)
                else shipped.payload()
                if isinstance(shipped, ShippedModel)
                else shipped.value
            )
        )
        module.eval()
        context = TaskContext.get()
        if context is not None:  # docs/design.md, "Spark": torch threads = the task's CPUs, no oversubscription
            torch.set_num_threads(max(int(context.cpus()), 1))
        dtypes = [np.dtype(i["dtype"]) for i in self.inputs]
        output, probability = self.output, self.probability

        def predict(*columns: np.ndarray) -> np.ndarray | dict[str, np.ndarray]:
            xs = tuple(torch.from_numpy(np.ascontiguousarray(c, dtype=d)) for c, d in zip(columns, dtypes))
            with torch.inference_mode():
                out = cast(torch.Tensor, model_output(module(*xs)))  # one tensor: output_spec checked it
            if output["classification"]:
                classes = out.argmax(dim=1).to(torch.float64).numpy()
                if not probability:
                    return classes
                return {
                    "prediction": classes,
                    "probability": torch.softmax(out.float(), dim=1).to(torch.float64).numpy(),
                }
            values = out.reshape(len(out), -1).to(torch.float64).numpy()
            return values[:, 0] if output["scalar"] else values

        # predict_batch_udf counts the function's parameters to match one column to each input
        # (functions take a __signature__ at run time; the checker's function type has no such attribute)
        predict.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(len(dtypes))]
        )
        return predict


def dump_weights(module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getvalue()


def load_module(architecture: bytes, weights: bytes) -> nn.Module:
    """Build the module from its pickled factory and load the state_dict (weights_only: tensors, no code)."""
    module: nn.Module = pickle.loads(architecture)()
    module.load_state_dict(torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True))
    return module
