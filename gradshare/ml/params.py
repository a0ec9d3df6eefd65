"""The Params of gradshare.ml and the schema checks that run before any Spark job.

Column Params follow Spark ML's names and defaults (featuresCol "features", labelCol "label",
predictionCol "prediction", probabilityCol "probability"; an empty probabilityCol turns the
probability column off, as in Spark). Training options that a user may want to grid over with
`ParamGridBuilder` are typed Params (epochs, batchSize, learningRate, seed, numWorkers); every other
JSON-able SharedTrainer option goes in the one `trainerOptions` dict, so the Estimator does not
re-declare (and drift from) every one of the trainer's options. Python objects (model, optimizer, loss, ...)
are constructor arguments, not Params: Params must be JSON for Spark's metadata files.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeVar

from pyspark.ml.linalg import VectorUDT
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.sql.types import ArrayType, BooleanType, DataType, NumericType, StructType

from gradshare.config import TrainConfig
from gradshare.config.options import Compression, FaultTolerance, Network, Runtime

# SharedTrainer options that are Params or constructor arguments here, so not trainerOptions keys.
NOT_OPTIONS = {
    "model",
    "loss",
    "optimizer",
    "train_step",
    "lr_scheduler",
    "metric",
    "on_epoch_end",
    "epochs",
    "batch_size",
    "seed",
    "num_workers",
    "validation_data",
}
# where the Estimator takes each of them instead (the hint of an error naming one in trainerOptions)
_INSTEAD = {
    "validation_data": "the validationIndicatorCol Param (a boolean column marking validation rows)",
    "batch_size": "the batchSize Param",
    "num_workers": "the numWorkers Param",
    "epochs": "the epochs Param",
    "seed": "the seed Param",
}
TASKS = ("auto", "classification", "regression")
T = TypeVar("T")


def _columns(value: object) -> str | list[str]:
    """featuresCol: one column name, or a list of them (one model input each)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(c, str) for c in value):
        return list(value)
    raise TypeError(f"featuresCol must be a column name or a non-empty list of them, got {value!r}")


def _optional(convert: Callable[[object], T]) -> Callable[[object], T | None]:
    return lambda value: None if value is None else convert(value)


def _positive_int(value: object) -> int:
    number = TypeConverters.toInt(value)
    if number < 1:
        raise TypeError(f"must be an int >= 1, got {value!r}")
    return number


def _task(value: object) -> str:
    if not isinstance(value, str) or value not in TASKS:
        raise TypeError(f"task must be one of {TASKS}, got {value!r}")
    return value


def trainer_option_names() -> set[str]:
    """SharedTrainer's keywords a trainerOptions dict may hold; a group's (compression, network, ...) takes
    a dict of that group's options."""
    return {f.name for f in dataclasses.fields(TrainConfig) if f.init} - NOT_OPTIONS


def _trainer_options(value: object) -> dict[str, Any]:  # JSON values, SharedTrainer keyword options
    """trainerOptions: SharedTrainer keyword options with JSON values (they are saved as JSON). A group
    given as its dataclass (``{"network": Network(bind=...)}``) is kept as the dict of the options it sets."""
    if not isinstance(value, dict):
        raise TypeError(f"trainerOptions must be a dict of SharedTrainer options, got {type(value).__name__}")
    known = trainer_option_names()
    value = {key: _as_dict(item) for key, item in value.items()}
    for key, item in value.items():
        if key in NOT_OPTIONS or key not in known:
            instead = _INSTEAD.get(key, "a constructor argument of GradshareEstimator")
            hint = f"; use {instead}" if key in NOT_OPTIONS else f"; known: {sorted(known)}"
            raise ValueError(f"trainerOptions has unknown key {key!r}{hint}")
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(
                f"trainerOptions[{key!r}] = {item!r} is not JSON (Params are saved as JSON); pass "
                "objects as constructor arguments of GradshareEstimator"
            ) from None
    return dict(value)


def _as_dict(item: object) -> object:
    """A group's dataclass as the dict of the options it sets otherwise than its defaults; anything else as it is."""
    if not isinstance(item, (Compression, Network, FaultTolerance, Runtime)):
        return item
    return {
        f.name: getattr(item, f.name) for f in dataclasses.fields(item) if f.init and getattr(item, f.name) != f.default
    }


class ColumnParams(Params):
    """Params shared by the Estimator and its Model."""

    featuresCol = Param(
        Params._dummy(),
        "featuresCol",
        "features column (a vector, an array or a number), or a "
        "list of columns for a model with several inputs: model(x1, x2, ...)",
        _columns,
    )
    predictionCol = Param(Params._dummy(), "predictionCol", "prediction column name", TypeConverters.toString)
    probabilityCol = Param(
        Params._dummy(),
        "probabilityCol",
        "classifiers: column of class probabilities (softmax of the output, a vector); '' for none",
        TypeConverters.toString,
    )
    predictBatchSize = Param(Params._dummy(), "predictBatchSize", "rows per forward pass in transform", _positive_int)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            featuresCol="features", predictionCol="prediction", probabilityCol="probability", predictBatchSize=1024
        )

    def feature_columns(self) -> list[str]:
        cols = self.getOrDefault(self.featuresCol)
        return [cols] if isinstance(cols, str) else list(cols)


class EstimatorParams(ColumnParams):
    """What `GradshareEstimator.fit` passes to SharedTrainer."""

    labelCol = Param(
        Params._dummy(), "labelCol", "label column (numbers, or arrays/vectors of them)", TypeConverters.toString
    )
    epochs = Param(Params._dummy(), "epochs", "passes over each partition", TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "rows per step per worker", TypeConverters.toInt)
    learningRate = Param(
        Params._dummy(),
        "learningRate",
        "if set, every param group of the optimizer gets this lr (None: the optimizer factory's own)",
        _optional(TypeConverters.toFloat),
    )
    seed = Param(Params._dummy(), "seed", "SharedTrainer seed (model init, shuffles)", TypeConverters.toInt)
    numWorkers = Param(
        Params._dummy(),
        "numWorkers",
        "barrier tasks (None: the DataFrame's partitions)",
        _optional(TypeConverters.toInt),
    )
    task = Param(
        Params._dummy(),
        "task",
        "'auto' (classification when the fit's loss was CrossEntropyLoss or NLLLoss), 'classification' or 'regression'",
        _task,
    )
    validationIndicatorCol = Param(
        Params._dummy(),
        "validationIndicatorCol",
        "boolean column: true marks a "
        "validation row (scored on every worker after each epoch), false a training "
        "row; '' for none",
        TypeConverters.toString,
    )
    trainerOptions = Param(
        Params._dummy(),
        "trainerOptions",
        "other SharedTrainer keyword options with JSON values, e.g. {'threshold': 1e-3, 'port': 0}",
        _trainer_options,
    )

    def __init__(self) -> None:
        super().__init__()
        # the training Params' defaults are SharedTrainer's (TrainConfig: tests/test_config.py)
        self._setDefault(
            labelCol="label",
            epochs=TrainConfig.epochs,
            batchSize=TrainConfig.batch_size,
            learningRate=None,
            seed=TrainConfig.seed,
            numWorkers=TrainConfig.num_workers,
            trainerOptions={},
            task="auto",
            validationIndicatorCol="",
        )


# ------------------------------------------------------------------------------------ schema checks
def _field(schema: StructType, column: str, role: str) -> DataType:
    if column not in schema.names:
        raise ValueError(f"{role} column {column!r} is not in the DataFrame; its columns are {schema.names}")
    return schema[column].dataType


def input_kind(dtype: DataType) -> tuple[str, int]:
    """("vector", 1) | ("array", nesting depth) | ("number", 0) | ("?", 0) for a column's Spark type."""
    if isinstance(dtype, VectorUDT):
        return "vector", 1
    depth = 0
    while isinstance(dtype, ArrayType):
        dtype, depth = dtype.elementType, depth + 1
    if isinstance(dtype, (NumericType, BooleanType)):
        return ("array", depth) if depth else ("number", 0)
    return "?", 0


def check_features(schema: StructType, columns: list[str]) -> list[tuple[str, int]]:
    """Each features column exists and holds numbers, arrays of numbers or ML vectors."""
    kinds = []
    for c in columns:
        dtype = _field(schema, c, "features")
        kind = input_kind(dtype)
        if kind[0] == "?":
            raise TypeError(
                f"features column {c!r} has type {dtype.simpleString()}; it must be a vector, an "
                "array of numbers or a number (VectorAssembler makes a vector of several columns)"
            )
        kinds.append(kind)
    return kinds


def check_indicator(schema: StructType, column: str) -> None:
    """validationIndicatorCol exists and is boolean (Spark ML's GBT takes the same kind of column)."""
    dtype = _field(schema, column, "validationIndicatorCol")
    if not isinstance(dtype, BooleanType):
        raise TypeError(
            f"validationIndicatorCol {column!r} has type {dtype.simpleString()}; it must be boolean "
            "(true: a validation row)"
        )


def check_label(schema: StructType, column: str) -> None:
    dtype = _field(schema, column, "label")
    if input_kind(dtype)[0] == "?":
        raise TypeError(
            f"label column {column!r} has type {dtype.simpleString()}; it must be a number, an array "
            "of numbers or a vector (index string labels with StringIndexer first)"
        )


def check_new(schema: StructType, column: str, role: str) -> None:
    """An output column must not exist yet: overwriting the user's column silently would lose data."""
    if column in schema.names:
        raise ValueError(f"{role} column {column!r} already exists in the DataFrame; set {role}Col to another name")
