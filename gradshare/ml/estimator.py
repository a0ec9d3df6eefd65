"""GradshareEstimator: SharedTrainer as a Spark ML Estimator."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from pyspark import cloudpickle
from pyspark.ml import Estimator
from pyspark.ml.util import DefaultParamsWriter, MLReadable, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from torch import nn

from gradshare.config import LossFn, Metric, ModelSpec, OptimizerFactory, SchedulerFactory, TrainStep
from gradshare.config.options import EpochCallback
from gradshare.driver.session import is_connect
from gradshare.driver.trainer import SharedTrainer, default_optimizer
from gradshare.ml.model import GradshareModel, ModuleCopy
from gradshare.ml.params import EstimatorParams, check_features, check_indicator, check_label, check_new
from gradshare.ml.persist import ParamsReader, ParamsWriter, load_params, read_bytes, write_bytes
from gradshare.ml.predict import output_spec, parse_inputs
from gradshare.stopping import early_stopping_from

# GradshareEstimator's constructor arguments that are Python objects (saved cloudpickled, not as JSON Params)
OBJECTS = ("model", "optimizer", "loss", "train_step", "lr_scheduler", "metric", "on_epoch_end")


class LearningRate:
    """An optimizer factory with every param group's lr set: what the `learningRate` Param does to the
    given factory (a class, not a closure, so that it pickles by reference to the executors)."""

    def __init__(self, factory: OptimizerFactory, lr: float) -> None:
        self.factory, self.lr = factory, lr

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self.factory(params)
        optimizer.defaults["lr"] = self.lr
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        return optimizer


class GradshareEstimator(Estimator[GradshareModel], EstimatorParams, MLReadable["GradshareEstimator"], MLWritable):
    """Train a torch model on a DataFrame with `SharedTrainer`; `fit(df)` returns a `GradshareModel`.

        est = GradshareEstimator(lambda: nn.Sequential(...), featuresCol="scaled", labelCol="label",
                                 epochs=5, learningRate=1e-2, trainerOptions={"verbose": 0})
        model = Pipeline(stages=[assembler, scaler, est]).fit(df)

    model, optimizer, loss, train_step, lr_scheduler, metric, on_epoch_end: as in `SharedTrainer`
    (model: an ``nn.Module`` or a zero-argument factory). Params: the columns (`featuresCol` may be a
    list: one model input per column), epochs, batchSize, learningRate, seed, numWorkers,
    `validationIndicatorCol` (a boolean column: its true rows are the validation data, split across
    the workers and scored on all of them after every epoch; the rest train), and `trainerOptions`
    for every other SharedTrainer option (JSON values, e.g. ``{"early_stopping": {"patience": 2,
    "mode": "max"}}``). Saving pickles the objects with cloudpickle:
    loading needs the model's class importable, as with any pickled torch module.
    """

    def __init__(
        self,
        model: ModelSpec | None = None,
        *,
        optimizer: OptimizerFactory | None = None,
        loss: LossFn | None = None,
        train_step: TrainStep | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        metric: Metric | None = None,
        on_epoch_end: EpochCallback | Sequence[EpochCallback] | None = None,
        **params: object,
    ) -> None:
        super().__init__()
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.train_step, self.lr_scheduler, self.metric = train_step, lr_scheduler, metric
        self.on_epoch_end = on_epoch_end
        self.setParams(**params)

    def setParams(self, **params: object) -> GradshareEstimator:
        unknown = sorted(k for k in params if not self.hasParam(k))
        if unknown:
            raise ValueError(
                f"GradshareEstimator has no Param(s) {unknown}; its Params are {sorted(p.name for p in self.params)}"
            )
        return self._set(**params)

    def trainer(self, validation_data: DataFrame | None = None) -> SharedTrainer:
        """The SharedTrainer these Params describe (it checks every option; no Spark job); `fit` gives
        it the validationIndicatorCol rows as validation_data."""
        if self.model is None:
            raise ValueError("GradshareEstimator needs a model: an nn.Module or a factory returning one")
        optimizer = self.optimizer
        lr = self.getOrDefault(self.learningRate)
        if lr is not None:
            optimizer = LearningRate(optimizer or default_optimizer, lr)
        given: dict[str, object] = self.getOrDefault(self.trainerOptions)
        options: dict[str, Any] = dict(given)  # JSON: a group's options come as a dict, SharedTrainer takes it
        if self.on_epoch_end is not None:  # a Runtime option, given here as an object (not JSON)
            options["runtime"] = {**options.get("runtime", {}), "on_epoch_end": self.on_epoch_end}
        return SharedTrainer(
            self.model,
            self.loss,
            optimizer,
            train_step=self.train_step,
            lr_scheduler=self.lr_scheduler,
            metric=self.metric,
            validation_data=validation_data,
            epochs=self.getOrDefault(self.epochs),
            batch_size=self.getOrDefault(self.batchSize),
            seed=self.getOrDefault(self.seed),
            num_workers=self.getOrDefault(self.numWorkers),
            **options,
        )

    def _fit(self, dataset: DataFrame) -> GradshareModel:
        # every check reads the schema or the options only: bad input fails here, before any Spark job
        schema = dataset.schema
        features = self.feature_columns()
        check_features(schema, features)
        label = self.getOrDefault(self.labelCol)
        check_label(schema, label)
        check_new(schema, self.getOrDefault(self.predictionCol), "prediction")
        train, validation = self._split(dataset)
        trainer = self.trainer(validation)

        result = trainer.fit(train, features_col=self.getOrDefault(self.featuresCol), label_col=label)
        inputs = parse_inputs(result.extra["inputs"])
        spec = {
            "inputs": inputs,
            "loss": result.extra["loss"],
            "output": output_spec(result.model, inputs, result.extra["loss"], self.getOrDefault(self.task)),
        }
        architecture = ModuleCopy(self.model) if isinstance(self.model, nn.Module) else self.model
        model = GradshareModel(result.model, architecture, spec, result.history)
        return self._copyValues(model)

    def _split(self, dataset: DataFrame) -> tuple[DataFrame, DataFrame | None]:
        """(training rows, validation rows or None) by validationIndicatorCol; checked on the schema."""
        column = self.getOrDefault(self.validationIndicatorCol)
        stopping = early_stopping_from(self.getOrDefault(self.trainerOptions).get("early_stopping"))
        if not column:
            # SharedTrainer's own error would point at validation_data, which the Estimator cannot pass
            if stopping is not None and stopping.monitor == "val_metric":
                raise ValueError(
                    "trainerOptions early_stopping monitors 'val_metric' but there is no validation "
                    "data: set validationIndicatorCol to a boolean column marking the validation "
                    "rows, or monitor='loss'"
                )
            return dataset, None
        check_indicator(dataset.schema, column)
        if is_connect(dataset):  # SharedTrainer's own error would point at validation_data, as above
            raise ValueError(
                f"validationIndicatorCol={column!r} does not work on a Spark Connect session yet: the "
                "validation rows are scored in shards that ride in the training RDD, and Connect has no "
                "RDDs; fit without it (early stopping can monitor 'loss'), or fit on a classic session"
            )
        return dataset.filter(~F.col(column)), dataset.filter(F.col(column))

    def write(self) -> EstimatorWriter:
        return EstimatorWriter(self)

    @classmethod
    def read(cls) -> EstimatorReader:
        return EstimatorReader(cls)


class EstimatorWriter(ParamsWriter[GradshareEstimator]):
    """metadata/ (Params) and objects.pkl: cloudpickle of the model (or factory), optimizer, loss, ..."""

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        objects = {name: getattr(self.instance, name) for name in OBJECTS}
        write_bytes(self.sparkSession, os.path.join(path, "objects.pkl"), cloudpickle.dumps(objects))


class EstimatorReader(ParamsReader[GradshareEstimator]):
    def load(self, path: str) -> GradshareEstimator:
        instance, _ = load_params(self.sparkSession, self.cls, path)
        for name, value in pickle.loads(read_bytes(self.sparkSession, os.path.join(path, "objects.pkl"))).items():
            setattr(instance, name, value)
        return instance
