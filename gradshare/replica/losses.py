"""Which loss a fit uses, the train step that computes it, and the driver's one-row probe.

A *batch* is a tuple of tensors ``(x1, ..., xn, labels)``: the model's inputs in row order (one for
plain rows), then the labels. A train step is ``step(model, batch) -> scalar loss tensor``; the worker
calls ``backward()`` on it and then the optimizer. The default step is `LossStep`:
``loss(model(*inputs), target)``; a user's ``train_step`` hook (several outputs, sample weights,
auxiliary losses) is wrapped in `HookStep`.

Choosing the default (`plan_loss`, on the driver before any task starts):
- The model is run once, in eval mode without gradients, on a copy, on the first row of partition 0
  (the pre-pass brings it back): that gives its output shape. A model that cannot run there (it
  reads the Spark task context, say) is left to the workers, which check every batch the same way.
- int labels → CrossEntropyLoss; the output must be (B, C, ...) with C > 1 classes.
- float labels → MSELoss, with the target shaped like the output where that is unambiguous ((B,)
  against (B, 1) is unsqueezed, (B, 1) against (B,) squeezed); any other difference is an error
  naming both shapes, never a silent broadcast (MSELoss of (B, 1) against (B,) broadcasts to (B, B)
  and the model learns only the mean). A user's `loss` gets the same target shaping and check.
- float labels that are all whole numbers ≥ 0 (Spark's StringIndexer gives 0.0, 1.0, ...) become
  int64 class indices when the probe saw a classifier: a (B, C) output with C > 1.
- ``label_dtype`` ("int64" / "float32") overrides the label half of this.

Gradient clipping: the step only returns the loss, so clipping lives with the optimizer: pass
``optimizer=clip_grad_norm(factory, max_norm)``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

# a loss: loss(output, target) -> scalar tensor; a metric: metric(output, labels) -> a number or (sum, count)
Loss = Callable[[Any, torch.Tensor], torch.Tensor]
MetricFn = Callable[[Any, torch.Tensor], object]


def _shape(t: torch.Tensor) -> str:
    """A batch tensor's shape with the batch dimension written B: what the user's model sees."""
    dims = ["B", *(str(d) for d in tuple(t.shape)[1:])] if t.dim() else []
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


class InputTypeError(TypeError):
    """Data of a dtype the model cannot take, or a train_step result that is not a scalar loss: the
    probe raises these on the driver instead of leaving them to the workers."""


def model_output(out: object) -> object:
    """What the default loss and metrics read of a model's output: the output itself, or the ``logits``
    of a mapping that holds them (a Hugging Face ``ModelOutput``, a dict), as HF's own Trainer reads a
    model called without labels. A mapping without logits: InputTypeError naming train_step (raised by
    the driver's probe, before any task starts)."""
    if isinstance(out, Mapping):
        logits = out.get("logits")
        if not torch.is_tensor(logits):
            keys = ", ".join(map(repr, list(out)[:6]))
            raise InputTypeError(
                f"the model returned a {type(out).__name__} with no 'logits' tensor (keys: {keys}); "
                "the default loss needs one output: pass train_step=lambda model, batch: ... "
                "returning the loss (e.g. model(input_ids=batch[0], labels=batch[0]).loss)"
            )
        return logits
    return out


def class_axis(out: object, y: torch.Tensor) -> int:
    """Where a classifier's output keeps its classes, for class-index labels `y`: 1 for PyTorch's
    (B, C, *d) against labels (B, *d); -1 for the class-last (B, *d, C) that sequence models produce
    (a language model's logits (B, T, C) against labels (B, T)). ValueError naming both shapes when
    neither fits, or when both do (a (B, X, X) output against (B, X) labels): then pass `loss=`."""
    if not torch.is_tensor(out):
        raise TypeError(
            f"the model returned {type(out).__name__}, not one tensor; the default loss needs one "
            "output (several outputs: pass train_step=)"
        )
    paired = out.dim() == y.dim() + 1 and out.shape[0] == y.shape[0]
    first = paired and out.shape[2:] == y.shape[1:] and out.shape[1] > 1
    last = paired and out.dim() >= 3 and out.shape[:-1] == y.shape and out.shape[-1] > 1
    if first and last:
        raise ValueError(
            f"the model's output {_shape(out)} against class labels {_shape(y)} could keep its classes "
            "on axis 1 or on the last axis; pass loss= (e.g. lambda out, y: "
            "F.cross_entropy(out.flatten(0, -2), y.flatten()) for class-last logits)"
        )
    if first or last:
        return 1 if first else -1
    raise ValueError(
        f"the labels are class indices of shape {_shape(y)}, so the model's output must be "
        f"(B, C{''.join(', ' + str(d) for d in y.shape[1:])}) or "
        f"(B{''.join(', ' + str(d) for d in y.shape[1:])}, C) with C > 1 classes, but it has shape "
        f"{_shape(out)} (regression on integer targets: pass label_dtype='float32')"
    )


def match_target(out: object, y: torch.Tensor, *, classes: bool = False) -> torch.Tensor:
    """The labels `y` shaped for `out`, or ValueError naming both shapes (module docstring).

    classes: the loss takes class indices (CrossEntropyLoss): `out` must be (B, C, *d) or (B, *d, C)
    with C > 1 for labels (B, *d) (`class_axis`). Integer labels for a user's loss are passed through
    unchecked (index losses such as NLLLoss never broadcast).
    """
    if not torch.is_tensor(out):
        raise TypeError(
            f"the model returned {type(out).__name__}, not one tensor; the default loss needs one "
            "output (several outputs: pass train_step=)"
        )
    if classes:
        class_axis(out, y)
        return y
    if not y.is_floating_point() or out.shape == y.shape:
        return y
    if out.dim() == y.dim() + 1 and out.shape[-1] == 1 and out.shape[:-1] == y.shape:
        return y.unsqueeze(-1)
    if y.dim() == out.dim() + 1 and y.shape[-1] == 1 and y.shape[:-1] == out.shape:
        return y.squeeze(-1)
    hint = (
        " (class indices, such as StringIndexer's 0.0, 1.0, ...? pass label_dtype='int64')"
        if out.dim() == 2 and y.dim() == 1 and out.shape[1] > 1
        else ""
    )
    raise ValueError(
        f"the model's output has shape {_shape(out)} but the labels have shape {_shape(y)}: the loss "
        f"would broadcast one against the other{hint}"
    )


def accuracy(outputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of labels (rows, or a sequence's positions) that are the arg-max output along the class
    axis (`class_axis`): the default metric for int labels."""
    return float((outputs.argmax(dim=class_axis(outputs, labels)) == labels).float().mean())


def accuracy_sums(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(labels that are the arg-max output, labels): `accuracy` as the exact sums that validation shards
    add across workers (validation.py)."""
    return float((outputs.argmax(dim=class_axis(outputs, labels)) == labels).sum()), float(labels.numel())


_EMBEDDING = re.compile(r"'indices'.*(?:Long, Int|embedding)", re.S)
_DTYPE = re.compile(r"dtype|scalar type|Long and Float|Float and Long")


@contextmanager
def explained(inputs: Sequence[torch.Tensor], names: tuple[str, ...]) -> Iterator[None]:
    """Re-raise torch's dtype errors from a forward pass as TypeError naming the input and its dtype:
    features keep their dtype (batches.py), so float ids reach an nn.Embedding, or int data a Linear."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        text = str(e)
        names = names if len(names) == len(inputs) else tuple(f"input {i}" for i in range(len(inputs)))
        floats = [
            f"{n} has dtype {str(x.dtype).replace('torch.', '')}"
            for n, x in zip(names, inputs)
            if x.is_floating_point()
        ]
        ints = [
            f"{n} has dtype {str(x.dtype).replace('torch.', '')}"
            for n, x in zip(names, inputs)
            if not x.is_floating_point()
        ]
        if _EMBEDDING.search(text) and floats:
            raise InputTypeError(
                f"an nn.Embedding got float ids: {'; '.join(floats)}; give token ids as integers "
                f"(they stay int64 end to end). torch said: {text.splitlines()[0]}"
            ) from e
        if _DTYPE.search(text) and ints:
            raise InputTypeError(
                f"a layer got non-float data: {'; '.join(ints)}; integer and bool features keep "
                "their dtype: cast them to float in the data or in the model. torch said: "
                f"{text.splitlines()[0]}"
            ) from e
        raise


class LossStep:
    """The default train step: ``loss(model(*inputs), target)`` with `match_target`'s shaping."""

    def __init__(
        self, loss: Loss, name: str | None = None, input_names: tuple[str, ...] = (), classes: bool = False
    ) -> None:
        self.loss, self.name, self.input_names, self.classes = loss, name or _name(loss), input_names, classes

    def outputs(self, model: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Any:
        with explained(inputs, self.input_names):
            return model_output(model(*inputs))

    def __call__(self, model: Callable[..., Any], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        *inputs, y = batch
        return self._loss(self.outputs(model, inputs), y)

    def _loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        target = match_target(out, y, classes=self.classes)
        if self.classes and class_axis(out, y) == -1:  # class-last logits: the loss takes (B, C, *d)
            out = out.movedim(-1, 1)
        return self.loss(out, target)

    def evaluate(
        self, model: Callable[..., Any], batch: tuple[torch.Tensor, ...], metric: MetricFn | None
    ) -> float | tuple[float, float]:
        *inputs, y = batch
        out = self.outputs(model, inputs)
        if metric is not None:  # a number, or a (sum, count) pair (validation.py's reduction rule)
            return metric_value(metric(out, y))
        return float(self._loss(out, y))


class HookStep:
    """A user's ``train_step(model, batch) -> loss``; checks that it returns a scalar tensor."""

    def __init__(
        self, fn: Callable[[Any, tuple[torch.Tensor, ...]], object], input_names: tuple[str, ...] = ()
    ) -> None:
        self.fn, self.name, self.input_names = fn, f"train_step:{_name(fn)}", input_names

    def __call__(self, model: Callable[..., Any], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with explained(batch[:-1], self.input_names):
            loss = self.fn(model, batch)
        if not (torch.is_tensor(loss) and loss.dim() == 0):
            shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise InputTypeError(f"train_step must return a scalar loss tensor, got {shape}")
        return loss

    def evaluate(
        self, model: Callable[..., Any], batch: tuple[torch.Tensor, ...], metric: MetricFn | None
    ) -> float | tuple[float, float]:
        if metric is None:  # validation: the hook's own loss
            return float(self(model, batch))
        *inputs, y = batch
        with explained(inputs, self.input_names):
            return metric_value(metric(model_output(model(*inputs)), y))


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def clip_grad_norm(
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], max_norm: float
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory like `optimizer` whose step first clips the gradients' total norm to
    `max_norm` (torch.nn.utils.clip_grad_norm_), e.g.
    ``optimizer=clip_grad_norm(lambda p: torch.optim.Adam(p, 1e-3), 1.0)``. A step pre-hook keeps the
    optimizer's own class, so the direct update path (capture.py) still applies."""
    if not callable(optimizer):
        raise TypeError("clip_grad_norm: optimizer must be a factory taking the parameter list")
    if not (isinstance(max_norm, (int, float)) and max_norm > 0 and np.isfinite(max_norm)):
        raise ValueError(f"clip_grad_norm: max_norm must be a positive finite number, got {max_norm!r}")

    def factory(given: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(given)
        opt = optimizer(params)

        def clip(*_: object) -> None:  # a step pre-hook must return None
            torch.nn.utils.clip_grad_norm_(params, max_norm)

        opt.register_step_pre_hook(clip)
        return opt

    return factory


# ------------------------------------------------------------------------------------ driver side
@dataclass(frozen=True)
class LossPlan:
    """What `plan_loss` decided: the labels' dtype, the step every worker runs, and what to report."""

    label_dtype: str
    step: LossStep | HookStep
    name: str  # "CrossEntropyLoss", "MSELoss", a user loss's class/function name, "train_step:<name>"
    probe: str | None  # "output (B, 10)" or why the probe could not run on the driver (None: the model
    # returned None, which the workers then report)


def plan_loss(
    model: nn.Module,
    sample: tuple[Any, ...] | None,
    label_kind: str,
    labels_whole: bool,
    *,
    loss: Loss | None = None,
    train_step: Callable[[Any, tuple[torch.Tensor, ...]], object] | None = None,
    label_dtype: str | None = None,
    input_names: tuple[str, ...] = (),
    label_range: tuple[int, int] | None = None,
) -> LossPlan:
    """Choose label dtype and loss from the label kind and the model's output on one row (`sample`:
    ``(inputs, label)`` NumPy arrays); raise before training on dtype, shape or class-count errors it
    can see (`label_range`: the pre-pass's lowest and highest scalar class label)."""
    # the pre-pass's first row: only a partition with an error lacks one, and the driver raised for it
    assert sample is not None
    inputs = tuple(torch.from_numpy(np.array(a)[None]) for a in sample[0])  # a batch of one row
    if label_dtype == "int64" and label_kind == "float" and not labels_whole:
        raise ValueError(
            "label_dtype='int64' but the labels hold fractional or negative values; class "
            "indices must be whole numbers >= 0"
        )
    out, why = _probe(model, inputs, input_names, train_step is None)
    if label_dtype is None:
        classifier = torch.is_tensor(out) and out.dim() == 2 and out.shape[1] > 1
        whole = label_kind == "float" and labels_whole and np.ndim(sample[1]) == 0
        label_dtype = "int64" if label_kind == "int" or (whole and classifier) else "float32"
    y = torch.as_tensor(np.asarray(sample[1]).astype(label_dtype))[None]
    if train_step is not None:
        hook = HookStep(train_step, input_names)
        if why is None:  # the hook's own dtype/result errors surface here, before any task starts
            why = _attempt(lambda: hook(_eval_copy(model), (*inputs, y))) or "train_step ran on one row"
        return LossPlan(label_dtype, hook, hook.name, why)
    classes = loss is None and label_dtype == "int64"
    if loss is None:
        loss = torch.nn.CrossEntropyLoss() if classes else torch.nn.MSELoss()
    step = LossStep(loss, input_names=input_names, classes=classes)
    if out is None:
        return LossPlan(label_dtype, step, step.name, why)
    match_target(out, y, classes=classes)  # a shape error names both shapes now, not on every executor
    n_classes = out.shape[class_axis(out, y)] if classes else 0
    if classes and label_range is not None and not 0 <= label_range[0] <= label_range[1] < n_classes:
        raise ValueError(
            f"the labels are class indices from {label_range[0]} to {label_range[1]}, but the model's "
            f"output {_shape(out)} has {n_classes} classes (0 to {n_classes - 1})"
        )
    return LossPlan(label_dtype, step, step.name, f"output {_shape(out)}")


def _eval_copy(model: nn.Module) -> nn.Module:
    probe = copy.deepcopy(model)  # a forward may keep state (counters, caches): the shipped model stays fresh
    probe.eval()  # BatchNorm and dropout: one row is fine in eval mode
    return probe


def _attempt(fn: Callable[[], object]) -> str | None:
    """Run `fn` without gradients; None when it ran, else why not. InputTypeError is raised: it is the
    user's data or hook, wherever it runs."""
    try:
        with torch.no_grad():
            fn()
    except InputTypeError:
        raise
    except Exception as e:  # noqa: BLE001 - the model may need the Spark task; workers check every batch
        return f"probe skipped: {type(e).__name__}: {e}"
    return None


def _probe(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], names: tuple[str, ...], call_model: bool
) -> tuple[Any, str | None]:
    """(output, None) from one forward pass, or (None, why not); dtype errors are raised, named.
    A train_step hook calls the model its own way (an input may be sample weights): not probed here."""
    if not call_model:
        return None, None
    got: list[Any] = []

    def forward() -> None:
        with explained(inputs, names):
            got.append(_eval_copy(model)(*inputs))
        got[0] = model_output(got[0])  # a mapping without logits: raised, naming train_step

    why = _attempt(forward)
    return (got[0], None) if why is None else (None, why)


def metric_value(value: Any) -> float | tuple[float, float]:
    """A metric's value: a float, or a (sum, count) pair of floats (module docstring)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise TypeError(f"metric returned a sequence of {len(value)} values; return a number or (sum, count)")
        return float(value[0]), float(value[1])
    return float(value)
