"""Small checks of SharedTrainer's arguments that TrainConfig runs and the driver reuses.

They import nothing else of gradshare, so that gradshare.config (imported by the CLI, the task and the driver
alike) reaches into neither driver/ nor task/: the mlflow option, where a checkpoint lives, and whether
data is a Spark DataFrame or RDD.
"""

from __future__ import annotations

import os
import types
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import urlparse

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame
    from typing_extensions import TypeIs  # typing's own from Python 3.13

# keys of the mlflow= dict; anything else is a typo the user should hear about
MLFLOW_OPTION_KEYS = ("experiment", "run_name", "tags", "log_model")


def check_mlflow_option(value: Any) -> dict[str, Any] | None:
    """SharedTrainer's `mlflow` argument → a normalised dict, or None when off. Fails on the driver, at
    construction, when mlflow is not installed or the dict has an unknown key or a bad value."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise TypeError(
            f"mlflow must be None, True or a dict with keys {list(MLFLOW_OPTION_KEYS)}, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - set(MLFLOW_OPTION_KEYS))
    if unknown:
        raise ValueError(f"mlflow has unknown key(s) {unknown}; known: {list(MLFLOW_OPTION_KEYS)}")
    for key in ("experiment", "run_name"):
        if value.get(key) is not None and not (isinstance(value[key], str) and value[key]):
            raise ValueError(f"mlflow[{key!r}] must be a non-empty string, got {value[key]!r}")
    tags = value.get("tags") or {}
    if not (isinstance(tags, dict) and all(isinstance(k, str) for k in tags)):
        raise ValueError(f"mlflow['tags'] must be a dict with string keys, got {tags!r}")
    if not isinstance(value.get("log_model", True), bool):
        raise ValueError(f"mlflow['log_model'] must be True or False, got {value['log_model']!r}")
    import_mlflow()
    return {
        "experiment": value.get("experiment"),
        "run_name": value.get("run_name"),
        "tags": {k: str(v) for k, v in tags.items()},
        "log_model": value.get("log_model", True),
    }


def import_mlflow() -> types.ModuleType:
    """MLflow itself, imported lazily since it is optional (the [mlflow] extra)."""
    try:
        import mlflow
    except ImportError as e:
        raise ImportError(
            "SharedTrainer(runtime=Runtime(mlflow=...)) needs MLflow on the driver: pip install 'gradshare[mlflow]' "
            "(mlflow-skinny), or the full mlflow package"
        ) from e
    return mlflow


def is_local(path: str) -> bool:
    """A local path or file: URI ("C:" is a drive, not a scheme)."""
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or len(scheme) == 1


def local_root(path: str) -> str:
    """A local path or file: URI as an absolute path."""
    parsed = urlparse(path)
    return parsed.path if parsed.scheme == "file" else os.path.abspath(path)


def checkpoint_root(path: object, argument: str) -> str:
    """`path` as a checkpoint root: an absolute local directory, or the Hadoop-FS URI as given."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a path or a Hadoop-FS URI, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):  # an os.PathLike[bytes]: roots and Hadoop-FS URIs are text
        raise TypeError(f"{argument} must be a path or a Hadoop-FS URI, got {type(path).__name__}")
    return local_root(path) if is_local(path) else path.rstrip("/")


def is_dataframe(data: object) -> TypeIs[DataFrame]:
    """A pyspark DataFrame, classic or Spark Connect (both subclass pyspark.sql.DataFrame; a Connect
    DataFrame's `.rdd` raises, so no duck typing on it)."""
    from pyspark.sql import DataFrame

    return isinstance(data, DataFrame)


def is_distributed(data: object) -> TypeGuard[DataFrame | RDD[Any]]:
    """Whether `validation_data` is a Spark DataFrame or RDD (else an in-memory pair or None)."""
    return is_dataframe(data) or hasattr(data, "mapPartitionsWithIndex")
