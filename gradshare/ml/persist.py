"""save/load for GradshareEstimator and GradshareModel (pyspark MLWritable/MLReadable).

A saved instance is a directory (any Hadoop-FS URI: local, hdfs://, s3a://, ...):
    metadata/          Spark's DefaultParamsWriter JSON: class, uid, Params; for a model also its spec
                       (inputs, classifier or regressor, output width) and the fit's history
    objects.pkl        Estimator: cloudpickle of the model (or factory), optimizer, loss, train_step, ...
    architecture.pkl   Model: cloudpickle of a zero-argument factory that builds the module
    weights.pt         Model: torch.save of the trained state_dict (loadable with torch.load alone)
Pickles hold code by reference: loading needs the model's class importable, as with any pickled torch
module. Pipeline/PipelineModel and CrossValidator save their stages through these writers.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pyspark import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter
from pyspark.sql import SparkSession

from gradshare.ml.predict import dump_weights, load_module

if TYPE_CHECKING:  # they import this module
    from gradshare.ml.estimator import GradshareEstimator
    from gradshare.ml.model import GradshareModel

P = TypeVar("P", "GradshareEstimator", "GradshareModel")  # the classes saved here
# GradshareEstimator's constructor arguments that are Python objects (saved cloudpickled, not as JSON Params)
OBJECTS = ("model", "optimizer", "loss", "train_step", "lr_scheduler", "metric", "on_epoch_end")

# pickle/cloudpickle: the model-file format of this Spark ML layer (like torch.save), never the UDP wire


def _hadoop_path(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """(Hadoop Path, its FileSystem): py4j proxies of the JVM's objects (py4j has no types: Any)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # the driver's SparkContext of a classic session runs a JVM
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p, p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())


def write_bytes(spark: SparkSession, path: str, data: bytes) -> None:
    """Write one file through Hadoop's FileSystem (the same filesystems Spark's own writers reach)."""
    p, fs = _hadoop_path(spark, path)
    out = fs.create(p, False)  # never overwrite: MLWriter.overwrite() clears the directory first
    try:
        out.write(bytearray(data))
    finally:
        out.close()


def read_bytes(spark: SparkSession, path: str) -> bytes:
    p, fs = _hadoop_path(spark, path)
    if not fs.exists(p):
        raise FileNotFoundError(f"{path} does not exist: not a saved gradshare.ml instance, or saved incompletely")
    stream = fs.open(p)
    try:
        jvm = spark.sparkContext._jvm
        assert jvm is not None  # _hadoop_path found one
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _load_params(spark: SparkSession, cls: type[P], path: str) -> tuple[P, dict[str, Any]]:
    """A new `cls` with the uid and Params saved at `path`, and the metadata (JSON)."""
    metadata = DefaultParamsReader.loadMetadata(path, spark)
    expected = f"{cls.__module__}.{cls.__name__}"
    if metadata["class"] != expected:
        raise ValueError(f"{path} holds a {metadata['class']}, not a {expected}")
    instance = cls()
    instance._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    return instance, metadata


# Each class's write() / read() returns its writer / reader (MLWritable.save, MLReadable.load call them).


class _Writer(MLWriter, Generic[P]):
    def __init__(self, instance: P) -> None:
        super().__init__()
        self.instance: P = instance


class _Reader(MLReader[P]):
    def __init__(self, cls: type[P]) -> None:
        super().__init__()
        self.cls: type[P] = cls


class EstimatorWriter(_Writer["GradshareEstimator"]):
    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        objects = {name: getattr(self.instance, name) for name in OBJECTS}
        write_bytes(self.sparkSession, os.path.join(path, "objects.pkl"), cloudpickle.dumps(objects))


class EstimatorReader(_Reader["GradshareEstimator"]):
    def load(self, path: str) -> GradshareEstimator:
        instance, _ = _load_params(self.sparkSession, self.cls, path)
        for name, value in pickle.loads(read_bytes(self.sparkSession, os.path.join(path, "objects.pkl"))).items():
            setattr(instance, name, value)
        return instance


class ModelWriter(_Writer["GradshareModel"]):
    def saveImpl(self, path: str) -> None:
        model = self.instance
        if model.torchModel is None:
            raise ValueError("this GradshareModel has no module to save")
        DefaultParamsWriter.saveMetadata(model, path, self.sparkSession,
                                         extraMetadata={"spec": model.spec, "history": _jsonable(model.history)})
        write_bytes(self.sparkSession, os.path.join(path, "architecture.pkl"), cloudpickle.dumps(model.architecture))
        write_bytes(self.sparkSession, os.path.join(path, "weights.pt"), dump_weights(model.torchModel))


class ModelReader(_Reader["GradshareModel"]):
    def load(self, path: str) -> GradshareModel:
        instance, metadata = _load_params(self.sparkSession, self.cls, path)
        architecture = read_bytes(self.sparkSession, os.path.join(path, "architecture.pkl"))
        module = load_module(architecture, read_bytes(self.sparkSession, os.path.join(path, "weights.pt")))
        instance._module, instance.spec, instance.history = module, metadata["spec"], metadata.get("history", [])
        instance.architecture = pickle.loads(architecture)
        return instance


def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History rows as JSON values (NumPy scalars become numbers; anything else its text)."""
    jsonable: list[dict[str, Any]] = json.loads(json.dumps(rows, default=lambda v: v.item() if hasattr(v, "item")
                                                             else str(v)))
    return jsonable
