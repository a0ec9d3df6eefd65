"""GradshareModel: the fitted Transformer; transform predicts on the executors."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pyspark import Broadcast, SparkContext, cloudpickle
from pyspark.ml import Model
from pyspark.ml.functions import array_to_vector, predict_batch_udf, vector_to_array
from pyspark.ml.util import DefaultParamsWriter, MLReadable, MLWritable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, DoubleType, StructField, StructType
from torch import nn

from gradshare.driver.session import is_connect
from gradshare.ml.params import ColumnParams, check_features, check_new
from gradshare.ml.persist import ParamsReader, ParamsWriter, load_params, read_bytes, write_bytes
from gradshare.ml.predict import Payload, ShippedModel, dump_weights, load_module, make_predict, pack_payload

# a Connect session's model larger than this goes to the executors as a session file, not inside the UDF
INLINE_MODEL_BYTES = 16 << 20

if TYPE_CHECKING:
    from pyspark.ml._typing import ParamMap  # pyspark's stub-only alias (what Params.copy takes)


class ModuleCopy:
    """A zero-argument factory that returns a copy of a module: the architecture of an Estimator built
    from an ``nn.Module`` instance rather than a factory."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> nn.Module:
        return copy.deepcopy(self.module)


class GradshareModel(Model, ColumnParams, MLReadable["GradshareModel"], MLWritable):
    """A torch module fitted by `GradshareEstimator`, as a Spark ML Transformer.

    ``transform(df)`` adds `predictionCol` (classifiers: the argmax class as a double, like Spark ML;
    regressors: the output as a double, or an array of doubles when the model has several outputs per
    row) and, for classifiers, `probabilityCol` (softmax of the output, an ML vector). It runs
    `pyspark.ml.functions.predict_batch_udf` on the executors in Arrow batches of `predictBatchSize` rows:
    nothing is collected to the driver, and the weights travel once, as a broadcast.

    `torchModel` is the trained module on the driver; `history` the fit's per-epoch rows.
    """

    # spec and history are JSON (saved in the model's metadata): predict.py's InputSpec/OutputSpec, read by key
    def __init__(
        self,
        module: nn.Module | None = None,
        architecture: Callable[[], nn.Module] | None = None,
        spec: dict[str, Any] | None = None,
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self._module, self.architecture = module, architecture
        self.spec = spec or {}
        self.history = list(history or [])
        # (context, payload hash, broadcast)
        self._weights: tuple[SparkContext, bytes, Broadcast[Payload]] | None = None

    @property
    def torchModel(self) -> nn.Module | None:
        return self._module

    @property
    def isClassifier(self) -> bool:
        return bool(self.spec["output"]["classification"])

    def copy(self, extra: ParamMap | None = None) -> GradshareModel:
        # Params.copy is shallow: give the copy its own module, which its user may go on changing
        that = super().copy(extra)
        that._module = copy.deepcopy(self._module)
        that._weights = None
        return that

    def _shipped(self, spark: SparkSession) -> Broadcast[Payload] | Payload | ShippedModel:
        """The module as the executors get it: one broadcast on a classic session, made again only when the
        SparkContext or the weights changed (a user may fine-tune `torchModel` between transforms);
        serialising it once per transform is cheap next to a Spark job. A Connect session has no
        broadcasts: the bytes themselves, which travel inside the UDF, up to INLINE_MODEL_BYTES; a larger
        model goes as a session file named by its sha256 (a Connect plan is one gRPC message, 128 MiB at
        most by default), added once per session and content."""
        assert self._module is not None  # _transform checked
        payload = (cloudpickle.dumps(self.architecture), dump_weights(self._module))
        if is_connect(spark):
            if len(payload[0]) + len(payload[1]) <= INLINE_MODEL_BYTES:
                return payload
            data = pack_payload(payload)
            shipped = ShippedModel(ShippedModel.name_for(data))
            with tempfile.TemporaryDirectory(prefix="gradshare-model-") as folder:
                path = os.path.join(folder, shipped.name)
                with open(path, "wb") as f:
                    f.write(data)
                spark.addArtifacts(path, file=True)  # the same name and bytes again: accepted
            return shipped
        sc = spark.sparkContext
        key = hashlib.sha256(payload[0] + payload[1]).digest()
        if self._weights is None or self._weights[0] is not sc or self._weights[1] != key:
            if self._weights is not None and self._weights[0] is sc:
                self._weights[2].unpersist()  # a fine-tuned model's old copy leaves the executors
            self._weights = (sc, key, sc.broadcast(payload))
        return self._weights[2]

    def _udf_inputs(
        self, schema: StructType, kinds: list[tuple[str, int]]
    ) -> tuple[list[Column], list[list[int] | None]]:
        """The input columns as predict_batch_udf takes them (flat arrays), and their shapes."""
        columns: list[Column] = []
        shapes: list[list[int] | None] = []
        for name, (kind, depth), spec in zip(self.feature_columns(), kinds, self.spec["inputs"]):
            shape = spec["shape"]
            if (kind == "number") != (not shape) or (kind == "array" and depth != len(shape)):
                want = (
                    "a number"
                    if not shape
                    else "a vector or an array"
                    if len(shape) == 1
                    else f"arrays nested {len(shape)} deep"
                )
                raise TypeError(
                    f"features column {name!r} has type {schema[name].dataType.simpleString()}; the "
                    f"model was fitted on {spec['dtype']}{shape} rows, so it must hold {want}"
                )
            size = schema[name].metadata.get("ml_attr", {}).get("num_attrs")  # VectorAssembler's, when known
            if kind == "vector" and size is not None and [size] != shape:
                raise ValueError(
                    f"features column {name!r} holds vectors of size {size}; the model was fitted on "
                    f"{spec['dtype']}{shape} rows"
                )
            col = vector_to_array(F.col(name), "float32") if kind == "vector" else F.col(name)
            for _ in range(max(len(shape) - 1, 0)):
                col = F.flatten(col)
            columns.append(col)
            shapes.append(shape or None)
        return columns, shapes

    def _transform(self, dataset: DataFrame) -> DataFrame:
        if self._module is None:
            raise ValueError("this GradshareModel has no module; get one from GradshareEstimator.fit or .load")
        # every check reads the schema only: bad input fails here, before any Spark job
        schema = dataset.schema
        kinds = check_features(schema, self.feature_columns())
        if len(kinds) != len(self.spec["inputs"]):
            raise ValueError(
                f"featuresCol names {len(kinds)} column(s) but the model was fitted with "
                f"{len(self.spec['inputs'])} input(s)"
            )
        prediction, probability = self.getOrDefault(self.predictionCol), self.getOrDefault(self.probabilityCol)
        check_new(schema, prediction, "prediction")
        output = self.spec["output"]
        probability = probability if output["classification"] else ""
        if probability:
            check_new(schema, probability, "probability")
        columns, shapes = self._udf_inputs(schema, kinds)

        return_type: DataType
        if probability:  # a struct, so that one UDF call per row fills both columns
            return_type = StructType(
                [StructField("prediction", DoubleType()), StructField("probability", ArrayType(DoubleType()))]
            )
        else:
            return_type = DoubleType() if output["classification"] or output["scalar"] else ArrayType(DoubleType())
        udf = predict_batch_udf(
            make_predict(self._shipped(dataset.sparkSession), self.spec["inputs"], output, bool(probability)),
            return_type=return_type,
            batch_size=self.getOrDefault(self.predictBatchSize),
            # one scalar input takes no shapes (pyspark would reshape it to [-1] + None)
            input_tensor_shapes=None if shapes == [None] else shapes,
        )
        if not probability:
            return dataset.withColumn(prediction, udf(*columns))
        # Spark keeps the UDF one ArrowEvalPython node (the test checks the plan): it does not collapse
        # projections that would duplicate a Python UDF
        scratch = f"__gradshare_{self.uid}"
        out = dataset.withColumn(scratch, udf(*columns))
        out = out.withColumn(prediction, _struct_field(scratch, "prediction"))
        out = out.withColumn(probability, array_to_vector(_struct_field(scratch, "probability")))
        return out.drop(scratch)

    def write(self) -> ModelWriter:
        return ModelWriter(self)

    @classmethod
    def read(cls) -> ModelReader:
        return ModelReader(cls)


def _struct_field(column: str, field: str) -> Column:
    return F.col(column).getField(field)


class ModelWriter(ParamsWriter[GradshareModel]):
    """metadata/ (Params, the spec, the history), architecture.pkl (cloudpickle of a zero-argument factory
    that builds the module) and weights.pt (torch.save of the trained state_dict)."""

    def saveImpl(self, path: str) -> None:
        model = self.instance
        if model.torchModel is None:
            raise ValueError("this GradshareModel has no module to save")
        DefaultParamsWriter.saveMetadata(
            model, path, self.sparkSession, extraMetadata={"spec": model.spec, "history": _jsonable(model.history)}
        )
        write_bytes(self.sparkSession, os.path.join(path, "architecture.pkl"), cloudpickle.dumps(model.architecture))
        write_bytes(self.sparkSession, os.path.join(path, "weights.pt"), dump_weights(model.torchModel))


class ModelReader(ParamsReader[GradshareModel]):
    def load(self, path: str) -> GradshareModel:
        instance, metadata = load_params(self.sparkSession, self.cls, path)
        architecture = read_bytes(self.sparkSession, os.path.join(path, "architecture.pkl"))
        module = load_module(architecture, read_bytes(self.sparkSession, os.path.join(path, "weights.pt")))
        instance._module, instance.spec, instance.history = module, metadata["spec"], metadata.get("history", [])
        instance.architecture = pickle.loads(architecture)
        return instance


def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History rows as JSON values (NumPy scalars become numbers; anything else its text)."""
    jsonable: list[dict[str, Any]] = json.loads(
        json.dumps(rows, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    )
    return jsonable
