"""Validation data split across the workers: a DataFrame or RDD of validation rows,
one shard per rank, scored on every replica and reduced to one number.

Driver side (`shards_for`): the validation rows are checked against the training data (columns and
their types from the schema, before any Spark job; then dtypes and shapes in a pre-pass like the
training one), cut into one shard per rank, and zipped into the training RDD without moving the
training rows: PySpark has no `zipPartitions`, and `rdd.barrier()` takes one RDD, so shard i is
packed into exactly as many elements as training partition i has rows (the pre-pass counted them) and
`RDD.zip` pairs each training row with a short list of validation rows (`pack`, task/validation.py).
The training rows keep their partition and order, so a fit with and without shards trains the same
trajectory.

Worker side, and the rule that reduces the shards' sums to one number: task/validation.py.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, TypeVar

from pyspark.sql.types import ArrayType, BooleanType, DataType, FractionalType, IntegralType

from gradshare.checks import is_dataframe
from gradshare.driver.session import dataframe_to_rdd
from gradshare.task.partition import PartitionSummary
from gradshare.task.validation import pack

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

T = TypeVar("T")


def _column_kind(dtype: DataType) -> str:
    """A column's Spark type as what it becomes for the model: "vector", "int", "float", "bool", or
    "array<...>" of those; "?" for anything else."""
    # imported here, on the driver only: pyspark.ml's package __init__ imports pandas and pyarrow, which
    # a worker importing this module would otherwise carry (~50 MB of its baseline; docs/benchmarks/memory.md)
    from pyspark.ml.linalg import VectorUDT

    if isinstance(dtype, VectorUDT):
        return "vector"
    if isinstance(dtype, ArrayType):
        inner = _column_kind(dtype.elementType)
        return "?" if inner == "?" else f"array<{inner}>"
    if isinstance(dtype, BooleanType):
        return "bool"
    if isinstance(dtype, IntegralType):
        return "int"
    if isinstance(dtype, FractionalType):
        return "float"
    return "?"


def check_columns(validation: DataFrame, training: DataFrame, columns: list[str]) -> None:
    """A validation DataFrame has every column (features and label) with the kind of type the training
    DataFrame's has: read from the schemas, so it fails before any Spark job."""
    for c in columns:
        if c not in validation.columns:
            raise ValueError(
                f"validation_data has no column {c!r} (the training data's); its columns are {validation.columns}"
            )
        mine = _column_kind(validation.schema[c].dataType)
        theirs = _column_kind(training.schema[c].dataType)
        if mine == "?" or mine != theirs:
            raise TypeError(
                f"validation_data column {c!r} has type {validation.schema[c].dataType.simpleString()}, "
                f"the training data's has {training.schema[c].dataType.simpleString()}; cast it"
            )


def validation_rows(
    validation: DataFrame | RDD[tuple[object, object]],
    training: object,
    features_col: str | list[str] | None,
    label_col: str | None,
) -> RDD[tuple[object, object]]:
    """The validation data as an RDD of (features, label) rows, read like the training data."""
    if is_dataframe(validation):
        if not is_dataframe(training):
            raise ValueError(
                "validation_data is a DataFrame but the training data is an RDD: give both as "
                "DataFrames (fit's features_col/label_col name the columns of both) or both as RDDs"
            )
        # fit(df) without features_col and label_col raised before (driver/fit.job_for)
        assert features_col is not None and label_col is not None
        cols = [features_col] if isinstance(features_col, str) else list(features_col)
        check_columns(validation, training, [*cols, label_col])
        rows: RDD[tuple[object, object]] = dataframe_to_rdd(validation, features_col, label_col)
        return rows
    return validation


def shards_of(rdd: RDD[T], world: int) -> RDD[T]:
    """The validation RDD cut into `world` partitions, one per rank (any shard may be empty). Not by
    coalesce: a barrier stage refuses an RDD with ancestors of another partition count in it
    (SPARK-24820); a shuffle puts them in a stage of their own."""
    return rdd if rdd.getNumPartitions() == world else rdd.repartition(world)


def check_shards(summaries: list[PartitionSummary], layout: PartitionSummary, names: tuple[str, ...]) -> list[int]:
    """Every non-empty shard agrees with the training rows (`layout`: check_summaries's), errors naming
    the shard, the row and the column or input; returns the rows of every shard."""
    rows = []
    for s in sorted(summaries, key=lambda s: s.index):
        if s.rows == 0 and s.error == f"partition {s.index} is empty":  # that rank scores nothing
            rows.append(0)
            continue
        if s.error is not None:  # "partition 1 row 3: ..." of the shards
            raise (TypeError if s.error_type == "TypeError" else ValueError)(
                f"bad validation_data: {s.error.replace('partition', 'shard', 1)}"
            )
        # a shard without an error has its layout; `layout` is check_summaries's, which has one
        assert layout.features is not None and s.features is not None
        assert layout.label_shape is not None and s.label_shape is not None
        diff = layout.features.difference(s.features)
        if diff is not None:  # "features input 1 of dtype" -> "column 'b' of dtype" where there are columns
            what = diff[0]
            for i, name in enumerate(names):
                what = what.replace(f"features input {i}" if layout.features.multi else "features", name)
            raise (ValueError if "shape" in diff[0] else TypeError)(
                f"bad validation_data: shard {s.index} has {what} {diff[1]}, the training data {diff[2]}"
            )
        if s.label_shape != layout.label_shape or (
            layout.label_kind == "int" and s.label_kind == "float" and not s.labels_whole
        ):
            raise TypeError(
                f"bad validation_data: shard {s.index} has labels {s.label_kind}{list(s.label_shape)}, "
                f"the training data {layout.label_kind}{list(layout.label_shape)}"
            )
        rows.append(s.rows)
    if not any(rows):
        raise ValueError("validation_data has no rows")
    return rows


def zip_shards(
    train: RDD[T], shards: RDD[tuple[object, object]], train_rows: list[int], shard_rows: list[int]
) -> RDD[tuple[T, list[tuple[object, object]]]]:
    """The training RDD with each row paired to a list of validation rows of the same rank (`pack`)."""
    return train.zip(shards.mapPartitionsWithIndex(partial(pack, have=shard_rows, into=train_rows)))
