"""GradshareEstimator: SharedTrainer as a Spark ML Estimator (issue 14, item 1)."""

from __future__ import annotations

from typing import Any, Callable

from pyspark.ml import Estimator

from gradshare.ml.model import GradshareModel, ModuleCopy
from gradshare.ml.params import EstimatorParams, check_features, check_label, check_new
from gradshare.ml.persist import EstimatorReader, EstimatorWriter, Saved

# the constructor arguments that are Python objects (saved cloudpickled, not as JSON Params)
OBJECTS = ("model", "optimizer", "loss", "train_step", "lr_scheduler", "metric")


class LearningRate:
    """An optimizer factory with every param group's lr set: what the `learningRate` Param does to the
    given factory (a class, not a closure, so that it pickles by reference to the executors)."""

    def __init__(self, factory: Callable, lr: float):
        self.factory, self.lr = factory, lr

    def __call__(self, params):
        optimizer = self.factory(params)
        optimizer.defaults["lr"] = self.lr
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        return optimizer


class GradshareEstimator(Estimator, EstimatorParams, Saved):
    """Train a torch model on a DataFrame with `SharedTrainer`; `fit(df)` returns a `GradshareModel`.

        est = GradshareEstimator(lambda: nn.Sequential(...), featuresCol="scaled", labelCol="label",
                                 epochs=5, learningRate=1e-2, trainerOptions={"verbose": 0})
        model = Pipeline(stages=[assembler, scaler, est]).fit(df)

    model, optimizer, loss, train_step, lr_scheduler, metric: as in `SharedTrainer` (model: an
    ``nn.Module`` or a zero-argument factory). Params: the columns (`featuresCol` may be a list: one
    model input per column), epochs, batchSize, learningRate, seed, numWorkers, and `trainerOptions`
    for every other SharedTrainer option (JSON values). Saving pickles the objects with cloudpickle:
    loading needs the model's class importable, as with any pickled torch module.
    """

    def __init__(self, model: Any = None, *, optimizer: Callable | None = None, loss: Callable | None = None,
                 train_step: Callable | None = None, lr_scheduler: Callable | None = None,
                 metric: Callable | None = None, **params: Any):
        super().__init__()
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.train_step, self.lr_scheduler, self.metric = train_step, lr_scheduler, metric
        self.setParams(**params)

    def setParams(self, **params: Any) -> "GradshareEstimator":
        unknown = sorted(k for k in params if not self.hasParam(k))
        if unknown:
            raise ValueError(f"GradshareEstimator has no Param(s) {unknown}; its Params are "
                             f"{sorted(p.name for p in self.params)}")
        return self._set(**params)

    def trainer(self):
        """The SharedTrainer these Params describe (it checks every option; no Spark job)."""
        from gradshare.trainer import SharedTrainer, default_optimizer

        if self.model is None:
            raise ValueError("GradshareEstimator needs a model: an nn.Module or a factory returning one")
        optimizer = self.optimizer
        lr = self.getOrDefault(self.learningRate)
        if lr is not None:
            optimizer = LearningRate(optimizer or default_optimizer, lr)
        return SharedTrainer(
            self.model, self.loss, optimizer, train_step=self.train_step, lr_scheduler=self.lr_scheduler,
            metric=self.metric, epochs=self.getOrDefault(self.epochs), batch_size=self.getOrDefault(self.batchSize),
            seed=self.getOrDefault(self.seed), num_workers=self.getOrDefault(self.numWorkers),
            **self.getOrDefault(self.trainerOptions))

    def _fit(self, dataset) -> GradshareModel:
        from torch import nn

        from gradshare.ml.predict import output_spec, parse_inputs

        # every check reads the schema or the options only: bad input fails here, before any Spark job
        schema = dataset.schema
        features = self.feature_columns()
        check_features(schema, features)
        label = self.getOrDefault(self.labelCol)
        check_label(schema, label)
        check_new(schema, self.getOrDefault(self.predictionCol), "prediction")
        trainer = self.trainer()

        result = trainer.fit(dataset, features_col=self.getOrDefault(self.featuresCol), label_col=label)
        inputs = parse_inputs(result.extra["inputs"])
        spec = {"inputs": inputs, "loss": result.extra["loss"],
                "output": output_spec(result.model, inputs, result.extra["loss"], self.getOrDefault(self.task))}
        architecture = ModuleCopy(self.model) if isinstance(self.model, nn.Module) else self.model
        model = GradshareModel(result.model, architecture, spec, result.history)
        return self._copyValues(model)

    writer, reader = EstimatorWriter, EstimatorReader
