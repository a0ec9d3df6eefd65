"""save/load for GradshareEstimator and GradshareModel (pyspark MLWritable/MLReadable): the generic pieces.

A saved instance is a directory (any Hadoop-FS URI: local, hdfs://, s3a://, ...):
    metadata/          Spark's DefaultParamsWriter JSON: class, uid, Params; for a model also its spec
                       (inputs, classifier or regressor, output width) and the fit's history
    objects.pkl        Estimator: cloudpickle of the model (or factory), optimizer, loss, train_step, ...
    architecture.pkl   Model: cloudpickle of a zero-argument factory that builds the module
    weights.pt         Model: torch.save of the trained state_dict (loadable with torch.load alone)
Pickles hold code by reference: loading needs the model's class importable, as with any pickled torch
module. Pipeline/PipelineModel and CrossValidator save their stages through these writers.
Each class's writer and reader live beside it (estimator.py, model.py); this module knows neither class.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast

from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWriter
from pyspark.sql import SparkSession

S = TypeVar("S", bound=Params)  # an instance saved here: its Params are the metadata
R = TypeVar("R", bound=MLReadable[Any])  # a class loaded here (a Params too: load_params checks)

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


def load_params(spark: SparkSession, cls: type[R], path: str) -> tuple[R, dict[str, Any]]:
    """A new `cls` with the uid and Params saved at `path`, and the metadata (JSON)."""
    metadata = DefaultParamsReader.loadMetadata(path, spark)
    expected = f"{cls.__module__}.{cls.__name__}"
    if metadata["class"] != expected:
        raise ValueError(f"{path} holds a {metadata['class']}, not a {expected}")
    instance = cls()
    # both classes saved here are Params and MLReadable; typing has no intersection type to say so
    cast(Params, instance)._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    return instance, metadata


# Each class's write() / read() returns its writer / reader (MLWritable.save, MLReadable.load call them).


class ParamsWriter(MLWriter, Generic[S]):
    def __init__(self, instance: S) -> None:
        super().__init__()
        self.instance: S = instance


class ParamsReader(MLReader[R]):
    def __init__(self, cls: type[R]) -> None:
        super().__init__()
        self.cls: type[R] = cls
