"""save/load for GradshareEstimator and GradshareModel (pyspark MLWritable/MLReadable): the generic pieces.

A saved instance is a directory (on a classic session any Hadoop-FS URI: local, hdfs://, s3a://, ...; on
a Spark Connect session see below):
    metadata/          Spark's DefaultParamsWriter JSON: class, uid, Params; for a model also its spec
                       (inputs, classifier or regressor, output width) and the fit's history
    objects.pkl        Estimator: cloudpickle of the model (or factory), optimizer, loss, train_step, ...
    architecture.pkl   Model: cloudpickle of a zero-argument factory that builds the module
    weights.pt         Model: torch.save of the trained state_dict (loadable with torch.load alone)
Pickles hold code by reference: loading needs the model's class importable, as with any pickled torch
module. Pipeline/PipelineModel and CrossValidator save their stages through these writers.
Each class's writer and reader live beside it (estimator.py, model.py); this module knows neither class.

A Spark Connect client has no SparkContext, so no JVM to reach Hadoop's FileSystem through: the metadata
goes through Spark's DataFrame writer as on classic (DefaultParamsWriter), the other files are read with
Spark's `binaryFile` source (any path the server can read) and written as plain files by the client,
which Spark's DataFrame API cannot do (it writes only its own formats). So a save from a Connect client
needs a local path that the client shares with the server (its own machine's server, or a shared mount):
checked after the metadata is written, by finding that metadata on the client's filesystem. The layout on
disk is the same either way, so a save from either session loads in the other.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar, cast

from pyspark.errors import AnalysisException
from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWriter
from pyspark.sql import SparkSession

from gradshare.checks import is_local, local_root
from gradshare.driver.session import is_connect

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
    """Write one file: through Hadoop's FileSystem on a classic session (the filesystems Spark's own writers
    reach), as a plain local file on a Connect session (module docstring)."""
    if is_connect(spark):
        _write_shared(path, data)
        return
    p, fs = _hadoop_path(spark, path)
    out = fs.create(p, False)  # never overwrite: MLWriter.overwrite() clears the directory first
    try:
        out.write(bytearray(data))
    finally:
        out.close()


def read_bytes(spark: SparkSession, path: str) -> bytes:
    if is_connect(spark):
        return _read_binary_file(spark, path)
    p, fs = _hadoop_path(spark, path)
    if not fs.exists(p):
        raise FileNotFoundError(_missing(path))
    stream = fs.open(p)
    try:
        jvm = spark.sparkContext._jvm
        assert jvm is not None  # _hadoop_path found one
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _missing(path: str) -> str:
    return f"{path} does not exist: not a saved gradshare.ml instance, or saved incompletely"


def check_connect_path(spark: SparkSession, path: str) -> None:
    """A save from a Connect client: a local path (module docstring); checked before anything is written."""
    if is_connect(spark) and not is_local(path):
        raise ValueError(
            f"saving a gradshare.ml instance from a Spark Connect session writes its weights and "
            f"pickles as plain files from the client, so the path must be a local directory shared "
            f"with the Connect server, not {path!r}; save from a classic session to write to "
            "Hadoop filesystems"
        )


def _write_shared(path: str, data: bytes) -> None:
    local = local_root(path)  # a local path: check_connect_path ran first
    metadata = os.path.join(os.path.dirname(local), "metadata")
    if not os.path.isdir(metadata):  # the server wrote it: it is not on this machine's filesystem
        raise ValueError(
            f"saving from a Spark Connect session: the server wrote the metadata at {metadata}, but "
            "this client cannot see it there, so the server and the client do not share this path; "
            "save to a directory both see (a shared mount, or the server's own machine)"
        )
    with open(local, "xb") as out:  # never overwrite, as on classic
        out.write(data)


def _read_binary_file(spark: SparkSession, path: str) -> bytes:
    """One file's bytes through Spark's binaryFile source (read by the server, as the metadata is)."""
    try:
        rows = spark.read.format("binaryFile").load(path).select("path", "content").collect()
    except AnalysisException as e:
        if "PATH_NOT_FOUND" in str(e):
            raise FileNotFoundError(_missing(path)) from e
        raise
    # a directory lists the files under it: only the file itself is what was saved
    found = [r.content for r in rows if str(r.path).endswith("/" + os.path.basename(path.rstrip("/")))]
    if len(rows) != 1 or len(found) != 1:
        raise FileNotFoundError(_missing(path))
    return bytes(found[0])


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

    def save(self, path: str) -> None:
        check_connect_path(self.sparkSession, path)  # before overwrite() clears anything
        super().save(path)

    def _handleOverwrite(self, path: str) -> None:
        if not is_connect(self.sparkSession):
            super()._handleOverwrite(path)  # through the JVM of the classic session
            return
        # what pyspark's own Connect writers do (Pipeline's included): the server clears the path
        from pyspark.ml.connect.readwrite import RemoteMLWriter

        RemoteMLWriter.handleOverwrite(path, True)


class ParamsReader(MLReader[R]):
    def __init__(self, cls: type[R]) -> None:
        super().__init__()
        self.cls: type[R] = cls
