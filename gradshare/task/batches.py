"""Rows → model inputs and labels, keeping each input's dtype (docs/guide/data.md).

A row is ``(features, label)``. `features` is one array (the model is called as ``model(x)``) or a tuple
of inputs (``model(x1, x2, ...)``; a DataFrame's ``features_col=["a", "b"]`` gives such rows). A tuple
holding at least one array is several inputs (a number in it is a 0-d input: a (B,) tensor); a tuple of
numbers only is one input, a vector.

Dtypes travel end to end (pre-pass, partition arrays, spill file, batch tensors): integers become
int64 (token ids above 2**24 stay exact; a float32 cast would round them), floats become float32 (the
parameters' dtype; float64 data is the usual NumPy/Spark default, not a request for float64 training),
bools stay bool. uint64 is refused: its values above 2**63 - 1 would wrap in int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = ("float32", "int64", "bool")


def _array_like(x: Any) -> bool:
    return isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "toArray")


def is_multi(x: Any) -> bool:
    """Whether row features `x` are several inputs: a tuple holding at least one array."""
    return isinstance(x, tuple) and any(_array_like(e) for e in x)


def input_array(x: Any, what: str = "features") -> np.ndarray:
    """One input as a NumPy array of a training dtype (module docstring); TypeError names `what`."""
    if hasattr(x, "toArray"):  # pyspark.ml.linalg DenseVector / SparseVector
        x = x.toArray()
    arr = np.asarray(x)
    kind = arr.dtype.kind
    if arr.size == 0 or kind not in "iufb":
        raise TypeError(f"{what} of type {type(x).__name__} (dtype {arr.dtype}) are not a non-empty numeric array")
    if kind == "u" and arr.dtype.itemsize == 8:
        raise TypeError(f"{what} have dtype uint64, whose values above 2**63-1 do not fit int64; cast them")
    if kind == "f":
        return arr.astype(np.float32, copy=False)
    if kind in "iu":
        return arr.astype(np.int64, copy=False)
    return arr


def row_inputs(x: Any) -> tuple[np.ndarray, ...]:
    """The inputs of one row's features (one array, or one per element of a tuple of arrays)."""
    if is_multi(x):
        return tuple(input_array(e, f"features input {i}") for i, e in enumerate(x))
    return (input_array(x),)


@dataclass(frozen=True)
class InputLayout:
    """What every row's features look like: dtype and shape per input, and whether they are a tuple."""

    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    multi: bool

    @classmethod
    def of(cls, arrays: tuple[np.ndarray, ...], multi: bool) -> InputLayout:
        """The layout of one row's `row_inputs`."""
        return cls(tuple(str(a.dtype) for a in arrays), tuple(a.shape for a in arrays), multi)

    def describe(self) -> str:
        parts = [f"{d}{list(s)}" for d, s in zip(self.dtypes, self.shapes)]
        return f"({', '.join(parts)})" if self.multi else parts[0]

    def difference(self, other: InputLayout, columns: tuple[str, ...] = ()) -> tuple[str, Any, Any] | None:
        """Where `other` differs from this layout, as (what, other's, this one's), e.g.
        ("features input 1 of dtype", "float32", "int64"), or ("column 'ids' of shape", ...) where the
        inputs are the DataFrame `columns`; None when they match."""
        if self.multi != other.multi or len(self.dtypes) != len(other.dtypes):
            return "features", other.describe(), self.describe()
        for i, (d, s, od, os_) in enumerate(zip(self.dtypes, self.shapes, other.dtypes, other.shapes)):
            name = (
                f"column {columns[i]!r}"
                if len(columns) == len(self.dtypes)
                else f"features input {i}"
                if self.multi
                else "features"
            )
            if os_ != s:
                return f"{name} of shape", os_, s
            if od != d:
                return f"{name} of dtype", od, d
        return None


def input_names(layout: InputLayout, columns: tuple[str, ...] = ()) -> tuple[str, ...]:
    """How errors name each input: its DataFrame column where there is one, else its index."""
    if columns and len(columns) == len(layout.dtypes):
        return tuple(f"column {c!r}" for c in columns)
    if not layout.multi:
        return ("features",)
    return tuple(f"input {i}" for i in range(len(layout.dtypes)))


def stack_inputs(xs: list[tuple[np.ndarray, ...]], n_inputs: int) -> tuple[np.ndarray, ...]:
    """Rows of per-input arrays → one (rows, *shape) array per input."""
    return tuple(np.stack([row[i] for row in xs]) for i in range(n_inputs))


def spill_dtype(layout: InputLayout, label_dtype: str, label_shape: tuple[int, ...]) -> np.dtype:
    """One spill-file record per row: a field per input (x0, x1, ...), each with its own dtype and shape,
    and the label (y), so one file holds the whole row and no dtype is lost (spill.py)."""
    fields = [(f"x{i}", d, s) for i, (d, s) in enumerate(zip(layout.dtypes, layout.shapes))]
    return np.dtype([*fields, ("y", label_dtype, label_shape)], align=True)


def validation_arrays(
    data: Any, layout: InputLayout, label_dtype: str, label_shape: tuple[int, ...]
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """``validation_data=(X, y)`` as (inputs, labels) arrays checked against the training layout.

    X is one array of rows, or (multi-input data) a tuple with one array of rows per input.
    """
    try:
        X, y = data
    except (TypeError, ValueError):
        raise TypeError("validation_data must be a pair (X, y)") from None
    if layout.multi:
        if not (isinstance(X, (tuple, list)) and len(X) == len(layout.dtypes)):
            raise TypeError(
                f"validation_data: the model takes {len(layout.dtypes)} inputs; X must be a tuple of "
                f"{len(layout.dtypes)} arrays, got {type(X).__name__}"
            )
        inputs = tuple(input_array(a, f"validation_data X[{i}]") for i, a in enumerate(X))
    else:
        inputs = (input_array(X, "validation_data X"),)
    labels = np.asarray(y)
    if labels.ndim == 0 or labels.shape[1:] != label_shape or labels.dtype.kind not in "iuf":
        raise ValueError(
            f"validation_data y has {labels.dtype} rows of shape {labels.shape[1:]}, the training labels "
            f"are numbers of shape {label_shape}"
        )
    for i, (a, d, s) in enumerate(zip(inputs, layout.dtypes, layout.shapes)):
        name = f"X[{i}]" if layout.multi else "X"
        if a.shape[1:] != s or str(a.dtype) != d:
            raise ValueError(
                f"validation_data {name} has rows of {a.dtype}{list(a.shape[1:])}, the training features {d}{list(s)}"
            )
        if len(a) != len(labels):
            raise ValueError(f"validation_data {name} has {len(a)} rows but y has {len(labels)}")
    if label_dtype == "int64" and labels.dtype.kind == "f" and not np.all(labels == np.round(labels)):
        raise ValueError("validation_data y holds fractional values but the labels are class indices (int64)")
    return inputs, labels.astype(label_dtype)
