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

from pyspark import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from gradshare.ml.predict import dump_weights, load_module

# pickle/cloudpickle: the model-file format of this Spark ML layer (like torch.save), never the UDP wire


def _hadoop_path(spark, path: str):
    jvm = spark.sparkContext._jvm
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p, p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())


def write_bytes(spark, path: str, data: bytes) -> None:
    """Write one file through Hadoop's FileSystem (the same filesystems Spark's own writers reach)."""
    p, fs = _hadoop_path(spark, path)
    out = fs.create(p, False)  # never overwrite: MLWriter.overwrite() clears the directory first
    try:
        out.write(bytearray(data))
    finally:
        out.close()


def read_bytes(spark, path: str) -> bytes:
    p, fs = _hadoop_path(spark, path)
    if not fs.exists(p):
        raise FileNotFoundError(f"{path} does not exist: not a saved gradshare.ml instance, or saved incompletely")
    stream = fs.open(p)
    try:
        return bytes(spark.sparkContext._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _load_params(reader: MLReader, cls, path: str):
    metadata = DefaultParamsReader.loadMetadata(path, reader.sparkSession)
    expected = f"{cls.__module__}.{cls.__name__}"
    if metadata["class"] != expected:
        raise ValueError(f"{path} holds a {metadata['class']}, not a {expected}")
    instance = cls()
    instance._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    return instance, metadata


class _Writer(MLWriter):
    def __init__(self, instance):
        super().__init__()
        self.instance = instance


class _Reader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls


class Saved(MLReadable, MLWritable):
    """save/load through the class's `writer`/`reader` (MLWritable.save, MLReadable.load call these)."""

    writer: type[MLWriter]
    reader: type[MLReader]

    def write(self) -> MLWriter:
        return self.writer(self)

    @classmethod
    def read(cls) -> MLReader:
        return cls.reader(cls)


class EstimatorWriter(_Writer):
    def saveImpl(self, path: str) -> None:
        from gradshare.ml.estimator import OBJECTS  # lazy: estimator.py imports this module

        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        objects = {name: getattr(self.instance, name) for name in OBJECTS}
        write_bytes(self.sparkSession, os.path.join(path, "objects.pkl"), cloudpickle.dumps(objects))


class EstimatorReader(_Reader):
    def load(self, path: str):
        instance, _ = _load_params(self, self.cls, path)
        for name, value in pickle.loads(read_bytes(self.sparkSession, os.path.join(path, "objects.pkl"))).items():
            setattr(instance, name, value)
        return instance


class ModelWriter(_Writer):
    def saveImpl(self, path: str) -> None:
        model = self.instance
        if model.torchModel is None:
            raise ValueError("this GradshareModel has no module to save")
        DefaultParamsWriter.saveMetadata(model, path, self.sparkSession,
                                         extraMetadata={"spec": model.spec, "history": _jsonable(model.history)})
        write_bytes(self.sparkSession, os.path.join(path, "architecture.pkl"), cloudpickle.dumps(model.architecture))
        write_bytes(self.sparkSession, os.path.join(path, "weights.pt"), dump_weights(model.torchModel))


class ModelReader(_Reader):
    def load(self, path: str):
        instance, metadata = _load_params(self, self.cls, path)
        architecture = read_bytes(self.sparkSession, os.path.join(path, "architecture.pkl"))
        module = load_module(architecture, read_bytes(self.sparkSession, os.path.join(path, "weights.pt")))
        instance._module, instance.spec, instance.history = module, metadata["spec"], metadata.get("history", [])
        instance.architecture = pickle.loads(architecture)
        return instance


def _jsonable(rows: list) -> list:
    """History rows as JSON values (NumPy scalars become numbers; anything else its text)."""
    return json.loads(json.dumps(rows, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
