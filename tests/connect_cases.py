"""The bodies of tests/driver/test_connect.py, run inside the Connect runner's process (connect_runner.py) with
its Spark Connect session as `spark`. Each returns plain data (it is sent back to the test process)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer
from gradshare.config.options import Compression, FaultTolerance, Network, Runtime
from gradshare.demo import digits_split, evaluate_accuracy, mlp

# the models and callbacks below travel by value (executors need not import this module)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOOPBACK = dict(port=0, network={"bind": "127.0.0.1"}, verbose=0)  # JSON: also the Estimator's trainerOptions


def _digits_frame(spark):
    """scikit-learn's digits as a Connect DataFrame of 2 partitions (a local relation is split in
    order over local[2]'s 2 slots; a repartition's round-robin would depend on the columns a fit selects):
    the features as an array column, an ML vector column and a scalar column, int and float labels; and
    the test arrays."""
    from pyspark.ml.linalg import Vectors

    X, X_test, y, y_test = digits_split(0)
    rows = [(x.tolist(), Vectors.dense(x.tolist()), float(x[10]), int(v), float(v)) for x, v in zip(X, y)]
    df = spark.createDataFrame(rows, ["arr", "vec", "pixel", "label", "target"])
    return df, X_test, y_test


def session_kind(spark) -> dict:
    """What the runner holds: a Connect session whose DataFrames have no RDD."""
    df = spark.range(4)
    try:
        df.rdd
        rdd = "available"
    except Exception as e:  # noqa: BLE001 - pyspark's NOT_IMPLEMENTED, what fit(df) once hit
        rdd = type(e).__name__
    return {"session": type(spark).__module__, "rdd": rdd}


def epoch_lines(spark) -> dict:
    """A fit with the progress bar on, its relay in the job: what this client printed per epoch."""
    import contextlib
    import io

    df, X_test, y_test = _digits_frame(spark)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = SharedTrainer(
            mlp, epochs=3, batch_size=64, seed=3, validation_data=(X_test, y_test), **{**LOOPBACK, "verbose": 1}
        ).fit(df, features_col="arr", label_col="label")
    return {
        "printed": [x for x in out.getvalue().splitlines() if x.startswith("epoch ")],
        "history": [(h["epoch"], h["loss"], h["val_metric"]) for h in r.history],
    }


def digits(spark, epochs: int, tmp: str) -> dict:
    """The digits MLP from the array column (with in-memory validation, early stopping and a local
    checkpoint dir) and from the vector column: accuracy, hashes, history, checkpoints."""
    df, X_test, y_test = _digits_frame(spark)
    out = {}
    for col in ("arr", "vec"):
        r = SharedTrainer(
            mlp,
            epochs=epochs,
            batch_size=32,
            seed=3,
            validation_data=(X_test, y_test),
            early_stopping=dict(patience=50, mode="max"),
            **LOOPBACK,
            fault_tolerance=FaultTolerance(checkpoint_dir=os.path.join(tmp, col)),
        ).fit(df, features_col=col, label_col="label")
        out[col] = {
            "accuracy": evaluate_accuracy(r.model, X_test, y_test),
            "hash": r.param_hash,
            "worker_hashes": [w["param_hash"] for w in r.worker_reports],
            "world": r.world_size,
            "val": [h["val_metric"] for h in r.history],
            "stopped": r.extra["stopped_epoch"],
            "inputs": r.extra["inputs"],
            "loss": r.extra["loss"],
            "checkpoints": sorted(os.listdir(os.path.join(tmp, col))),
            "relay": r.extra.relay,
            "statuses": r.extra.relay_statuses,
        }
    # the same fit with the relay in this client instead of rank 0's task
    r = SharedTrainer(
        mlp,
        epochs=epochs,
        batch_size=32,
        seed=3,
        validation_data=(X_test, y_test),
        early_stopping=dict(patience=50, mode="max"),
        port=0,
        verbose=0,
        fault_tolerance=FaultTolerance(checkpoint_dir=os.path.join(tmp, "client")),
        network=Network(bind="127.0.0.1", relay="client"),
    ).fit(df, features_col="arr", label_col="label")
    out["client"] = {"hash": r.param_hash, "relay": r.extra.relay}
    # resume the array column's fit from its last checkpoint: one more epoch
    r = SharedTrainer(mlp, epochs=epochs + 1, batch_size=32, seed=3, **LOOPBACK).fit(
        df, features_col="arr", label_col="label", resume_from=os.path.join(tmp, "arr")
    )
    out["resumed"] = {
        "epochs": [h["epoch"] for h in r.history],
        "accuracy": evaluate_accuracy(r.model, X_test, y_test),
        "from": r.extra["resumed_from"],
    }
    return out


def early_stop(spark) -> dict:
    """A stop decided by a callback travels in the log on Connect as on classic."""
    df, X_test, y_test = _digits_frame(spark)
    r = SharedTrainer(
        mlp,
        epochs=6,
        seed=3,
        validation_data=(X_test, y_test),
        **LOOPBACK,
        runtime=Runtime(on_epoch_end=lambda row: row["epoch"] >= 1),
    ).fit(df, features_col="arr", label_col="label")
    return {
        "stopped": r.extra["stopped_epoch"],
        "epochs": [h["epoch"] for h in r.history],
        "hashes": sorted({w["param_hash"] for w in r.worker_reports} | {r.param_hash}),
    }


def inputs(spark) -> dict:
    """Several feature columns (an array and a number) with float labels, and num_workers re-partitioning."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 1), nn.Linear(1, 1)

        def forward(self, a, b):
            return self.a(a) + self.b(b.unsqueeze(1))

    df, _, _ = _digits_frame(spark)
    torch.manual_seed(0)
    r = SharedTrainer(TwoInputs(), epochs=2, num_workers=2, **LOOPBACK).fit(
        df, features_col=["arr", "pixel"], label_col="target"
    )
    return {
        "inputs": r.extra["inputs"],
        "loss": r.extra["loss"],
        "world": r.world_size,
        "loss_fell": r.history[-1]["loss"] < r.history[0]["loss"],
        "same": len({w["param_hash"] for w in r.worker_reports} | {r.param_hash}) == 1,
    }


def missing_column(spark) -> None:
    df, _, _ = _digits_frame(spark)
    SharedTrainer(mlp, **LOOPBACK).fit(df, features_col="pixels", label_col="label")


def rdd_on_connect(spark) -> None:
    """An RDD (of the local server's own SparkContext, the one a Connect client never sees) with a
    Connect session active."""
    from pyspark import SparkContext

    X, _, y, _ = digits_split(0)
    rdd = SparkContext._active_spark_context.parallelize(list(zip(X, (int(v) for v in y))), 2)
    SharedTrainer(mlp, **LOOPBACK).fit(rdd)


def rows_on_connect(spark) -> None:
    X, _, y, _ = digits_split(0)
    SharedTrainer(mlp, **LOOPBACK).fit(list(zip(X, y)))


def sharded_validation(spark) -> None:
    df, _, _ = _digits_frame(spark)
    SharedTrainer(mlp, validation_data=df, **LOOPBACK).fit(df, features_col="arr", label_col="label")


def hadoop_checkpoints(spark) -> None:
    df, _, _ = _digits_frame(spark)
    SharedTrainer(mlp, **LOOPBACK, fault_tolerance=FaultTolerance(checkpoint_dir="hdfs://namenode/ckpt")).fit(
        df, features_col="arr", label_col="label"
    )


def too_many_workers(spark) -> None:
    df, _, _ = _digits_frame(spark)
    SharedTrainer(mlp, num_workers=3, **LOOPBACK).fit(df, features_col="arr", label_col="label")


def null_label(spark) -> None:
    rows = [([float(i), 1.0], None if i == 5 else i % 2) for i in range(40)]
    df = spark.createDataFrame(rows, "x array<double>, y long").repartition(2)
    SharedTrainer(lambda: nn.Linear(2, 2), **LOOPBACK).fit(df, features_col="x", label_col="y")


class Exploding(nn.Module):
    """Raises inside the task on its 3rd forward pass, in every attempt."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(64, 10), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("user model exploded on purpose")
        return self.lin(x)


def worker_error(spark) -> None:
    """A worker's own error cancels the job (by its operation tag) and is raised as the worker raised it."""
    df, _, _ = _digits_frame(spark)
    SharedTrainer(Exploding, **LOOPBACK).fit(df, features_col="arr", label_col="label")


# ------------------------------------------------------------------------------------ gradshare.ml
PIXELS = [f"p{i}" for i in range(64)]


def _pixels_frame(spark, X, y):
    """Digits as one double column per pixel (what VectorAssembler takes) and an int label."""
    return spark.createDataFrame([tuple(float(v) for v in x) + (int(t),) for x, t in zip(X, y)], [*PIXELS, "label"])


def _columns(df, *cols) -> list[np.ndarray]:
    rows = df.select(*cols).toPandas()
    return [np.stack(rows[c].map(lambda v: v.toArray() if hasattr(v, "toArray") else v).to_numpy()) for c in cols]


def ml_pipeline(spark, epochs: int, tmp: str) -> dict:
    """A Pipeline of VectorAssembler, StandardScaler (Spark's own stages, run by the server) and the
    GradshareEstimator fitted on digits; its transform against the driver's module; save/load of the
    PipelineModel, the GradshareModel alone and the Estimator, to local directories."""
    import functools

    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from gradshare.ml import GradshareEstimator, GradshareModel

    X, X_test, y, y_test = digits_split(0)
    train, test = _pixels_frame(spark, X, y), _pixels_frame(spark, X_test, y_test)
    est = GradshareEstimator(
        functools.partial(mlp, 32),
        featuresCol="scaled",
        epochs=epochs,
        batchSize=32,
        learningRate=1e-2,
        numWorkers=2,
        trainerOptions=LOOPBACK,
    )
    model = Pipeline(
        stages=[
            VectorAssembler(inputCols=PIXELS, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="scaled"),
            est,
        ]
    ).fit(train)
    stage = model.stages[-1]
    out = model.transform(test)
    scaled, pred, prob, label = _columns(out, "scaled", "prediction", "probability", "label")
    with torch.no_grad():  # what the driver's module predicts for the same rows
        logits = stage.torchModel.eval()(torch.from_numpy(scaled.astype(np.float32)))

    # a model above the inline size goes to the executors as a session file named by its sha256
    from gradshare.ml import model as model_module

    inline, model_module.INLINE_MODEL_BYTES = model_module.INLINE_MODEL_BYTES, 0
    try:
        by_file = _columns(model.transform(test), "prediction", "probability")
        by_file_again = _columns(model.transform(test), "prediction", "probability")  # the same file again
    finally:
        model_module.INLINE_MODEL_BYTES = inline

    pipeline_dir, model_dir, est_dir = (os.path.join(tmp, d) for d in ("pipeline", "model", "est"))
    model.write().overwrite().save(pipeline_dir)
    model.write().overwrite().save(pipeline_dir)  # the server clears it first
    stage.save(model_dir)
    try:
        stage.save(model_dir)
        again = "saved twice"
    except Exception as e:  # noqa: BLE001 - what a second save without overwrite() says
        again = f"{type(e).__name__}: {e}"
    est.save(est_dir)
    loaded_pipeline, loaded = PipelineModel.load(pipeline_dir), GradshareModel.load(model_dir)
    loaded_est = GradshareEstimator.load(est_dir)
    by_pipeline = _columns(loaded_pipeline.transform(test), "prediction", "probability")
    by_model = _columns(loaded.transform(out.drop("prediction", "probability")), "prediction", "probability")
    return {
        "schema": out.schema.simpleString(),
        "classifier": stage.isClassifier,
        "history": len(stage.history),
        "accuracy": float((pred == label).mean()),
        "forward_pred": bool(np.array_equal(pred, logits.argmax(dim=1).numpy().astype(np.float64))),
        "forward_prob": float(np.abs(prob - torch.softmax(logits, dim=1).numpy()).max()),
        "pipeline_same": all(np.array_equal(a, b) for a, b in zip(by_pipeline, (pred, prob))),
        "file_same": all(np.array_equal(a, b) for a, b in zip(by_file + by_file_again, (pred, prob) * 2)),
        "model_same": all(np.array_equal(a, b) for a, b in zip(by_model, (pred, prob))),
        "loaded_uid": loaded.uid == stage.uid and loaded.spec == stage.spec and loaded.history == stage.history,
        "stages": [type(s).__name__ for s in loaded_pipeline.stages],
        "files": sorted(os.listdir(model_dir)),
        "second_save": again,
        "weights_keys": sorted(torch.load(os.path.join(model_dir, "weights.pt"), weights_only=True)),
        "est_params": {p.name: v for p, v in loaded_est.extractParamMap().items()}
        == {p.name: v for p, v in est.extractParamMap().items()}
        and loaded_est.uid == est.uid,
    }


def _unfitted_model(**params):
    """A GradshareModel of the digits MLP (untrained: the checks read only the schema and the spec)."""
    from gradshare.ml import GradshareModel

    spec = {
        "inputs": [{"dtype": "float32", "shape": [64]}],
        "loss": "CrossEntropyLoss",
        "output": {"classification": True, "width": 10, "scalar": False},
    }
    model = GradshareModel(mlp(32), lambda: mlp(32), spec)
    return model._set(**params) if params else model


def _save_without_weights(path: str) -> None:
    from gradshare.ml import GradshareModel

    _unfitted_model().save(path)
    os.remove(os.path.join(path, "weights.pt"))
    GradshareModel.load(path)


def ml_bad_input(spark, tmp: str) -> list:
    """Each bad input to fit, transform and save on Connect: (error type, message), as on classic."""
    import functools

    from pyspark.ml.feature import VectorAssembler

    from gradshare.ml import GradshareEstimator, GradshareModel

    def est(**params):
        return GradshareEstimator(functools.partial(mlp, 32), numWorkers=2, trainerOptions=LOOPBACK, **params)

    df = spark.createDataFrame([([0.0] * 64, 1, "a", 2.0, True)], ["features", "label", "text", "prediction", "val"])
    three = VectorAssembler(inputCols=["label", "label", "label"], outputCol="v3").transform(df.drop("prediction"))
    cases = [
        lambda: est(featuresCol="nope").fit(df),
        lambda: est(featuresCol="text").fit(df),
        lambda: est(labelCol="y").fit(df),
        lambda: est(predictionCol="label").fit(df.drop("prediction")),
        lambda: est(validationIndicatorCol="val").fit(df.drop("prediction")),
        lambda: _unfitted_model(featuresCol="scaled").transform(df),
        lambda: _unfitted_model().transform(df),
        lambda: _unfitted_model(featuresCol="label").transform(df.drop("prediction")),
        lambda: _unfitted_model(featuresCol="v3").transform(three),
        lambda: _unfitted_model().save("hdfs://namenode/models/m"),
        lambda: GradshareModel.load(os.path.join(tmp, "never-saved")),
        lambda: _save_without_weights(os.path.join(tmp, "partial")),
    ]
    errors = []
    for case in cases:
        try:
            case()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - returned for the test to check
            errors.append((type(e).__name__, str(e)))
    return errors


def ping(spark) -> int:
    return int(np.int64(spark.range(3).count()))


def killed_host(spark, tmp: str) -> dict:
    """Rank 0's task, which hosts the relay, dies mid-fit on its first run: the stage runs again from the
    last checkpoint; and the same fit uninterrupted."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dying import DiesOnce

    df, _, _ = _digits_frame(spark)
    marker = os.path.join(tmp, "died")
    fit = dict(epochs=3, batch_size=64, seed=4, compression=Compression(warmup=1.0), **LOOPBACK)
    killed = SharedTrainer(
        lambda: DiesOnce(marker, 0, 20), **fit, fault_tolerance=FaultTolerance(checkpoint_dir=os.path.join(tmp, "ckpt"))
    ).fit(df, features_col="arr", label_col="label")
    whole = SharedTrainer(lambda: DiesOnce(marker, 0, 20), **fit).fit(df, features_col="arr", label_col="label")
    return {
        "died": os.path.exists(marker),
        "restarts": killed.extra.restarts,
        "hash": killed.param_hash,
        "workers": sorted({w["param_hash"] for w in killed.worker_reports}),
        "whole": whole.param_hash,
        "relay": killed.extra.relay,
        "epochs": [h["epoch"] for h in killed.history],
    }
