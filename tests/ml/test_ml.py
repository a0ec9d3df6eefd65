"""gradshare.ml on the real local Spark session: a Pipeline after VectorAssembler and
StandardScaler with the output schema checked, predictions equal to the torch module's, save/load round
trips (Model, PipelineModel, Estimator), a 100k-row transform that stays on the executors,
CrossValidator over a 2-point learning-rate grid, a multi-input regressor, and bad input named before
any Spark job."""

import functools
import sys

import numpy as np
import pytest
import torch
from pyspark import cloudpickle
from pyspark.errors import AnalysisException
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.functions import array_to_vector
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType
from torch import nn

from gradshare.demo import digits_split, mlp
from gradshare.ml import GradshareEstimator, GradshareModel
from gradshare.ml.predict import output_spec, parse_inputs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module
pytestmark = pytest.mark.spark
LOOPBACK = {"port": 0, "network": {"bind": "127.0.0.1"}, "verbose": 0}
PIXELS = [f"p{i}" for i in range(64)]


def digits_frame(spark, X, y):
    rows = [tuple(float(v) for v in x) + (int(t),) for x, t in zip(X, y)]
    return spark.createDataFrame(rows, [*PIXELS, "label"]).repartition(2)


def estimator(**params):
    params.setdefault("trainerOptions", LOOPBACK)
    return GradshareEstimator(
        functools.partial(mlp, 32), epochs=3, batchSize=32, learningRate=1e-2, numWorkers=2, **params
    )


@pytest.fixture(scope="module")
def digits(spark):
    X_train, X_test, y_train, y_test = digits_split(0)
    return digits_frame(spark, X_train, y_train).cache(), digits_frame(spark, X_test, y_test).cache()


@pytest.fixture(scope="module")
def fitted(digits):
    train, _ = digits
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=PIXELS, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="scaled"),
            estimator(featuresCol="scaled"),
        ]
    )
    return pipeline, pipeline.fit(train)


def predictions(df, *cols):
    rows = df.select(*cols).toPandas()
    return [np.stack(rows[c].map(lambda v: v.toArray() if hasattr(v, "toArray") else v).to_numpy()) for c in cols]


def jobs_started(spark, action) -> tuple[list, object]:
    """Run `action` in its own job group: (the Spark jobs it started, its result or exception)."""
    sc = spark.sparkContext
    group = f"gradshare-ml-test-{id(action)}"
    sc.setJobGroup(group, "test")
    try:
        try:
            outcome = action()
        except Exception as e:  # noqa: BLE001 - returned for the caller to inspect
            outcome = e
        return list(sc.statusTracker().getJobIdsForGroup(group)), outcome
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)


# ------------------------------------------------------------------------------------ pipeline
def test_pipeline_fit_transform_adds_prediction_and_probability_columns(digits, fitted):
    _, test = digits
    _, model = fitted
    stage = model.stages[-1]
    assert isinstance(stage, GradshareModel) and stage.isClassifier
    assert stage.spec["loss"] == "CrossEntropyLoss" and len(stage.history) == 3

    out = model.transform(test)
    schema = out.schema
    assert schema.names == [*test.columns, "raw", "scaled", "prediction", "probability"]
    assert isinstance(schema["prediction"].dataType, DoubleType)
    assert isinstance(schema["probability"].dataType, VectorUDT)

    scaled, pred, prob, label = predictions(out, "scaled", "prediction", "probability", "label")
    assert prob.shape == (len(label), 10) and np.allclose(prob.sum(axis=1), 1.0)
    assert np.array_equal(pred, prob.argmax(axis=1).astype(np.float64))
    with torch.no_grad():  # the executors predicted what the driver's module predicts
        logits = stage.torchModel.eval()(torch.from_numpy(scaled.astype(np.float32)))
    assert np.array_equal(pred, logits.argmax(dim=1).numpy().astype(np.float64))
    np.testing.assert_allclose(prob, torch.softmax(logits, dim=1).numpy(), rtol=1e-5, atol=1e-7)
    assert (pred == label).mean() > 0.75  # 0.83 measured (3 epochs)


def test_model_and_pipeline_model_save_load_give_identical_predictions(digits, fitted, tmp_path):
    _, test = digits
    _, model = fitted
    stage = model.stages[-1]
    stage.save(str(tmp_path / "model"))
    model.save(str(tmp_path / "pipeline"))
    loaded = GradshareModel.load(str(tmp_path / "model"))
    loaded_pipeline = PipelineModel.load(str(tmp_path / "pipeline"))
    assert loaded.uid == stage.uid and loaded.spec == stage.spec and loaded.history == stage.history
    assert loaded.getOrDefault("featuresCol") == "scaled"
    assert (tmp_path / "model" / "weights.pt").exists()  # a plain torch state_dict file
    torch.load(tmp_path / "model" / "weights.pt", weights_only=True)

    scaled = model.transform(test).drop("prediction", "probability")
    want = predictions(stage.transform(scaled), "prediction", "probability")
    for got in (
        predictions(loaded.transform(scaled), "prediction", "probability"),
        predictions(loaded_pipeline.transform(test), "prediction", "probability"),
    ):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(AnalysisException, match="already exists"):  # MLWriter: no overwrite without .overwrite()
        stage.save(str(tmp_path / "model"))
    stage.write().overwrite().save(str(tmp_path / "model"))


def test_estimator_save_load_refits_to_identical_predictions(digits, fitted, tmp_path):
    train, test = digits
    pipeline, model = fitted
    est = pipeline.getStages()[-1]
    est.save(str(tmp_path / "est"))
    loaded = GradshareEstimator.load(str(tmp_path / "est"))
    assert loaded.uid == est.uid
    assert {p.name: v for p, v in loaded.extractParamMap().items()} == {
        p.name: v for p, v in est.extractParamMap().items()
    }

    prep = PipelineModel(model.stages[:-1])
    refit = loaded.fit(prep.transform(train))  # staleness 0, same seed: bit-identical training
    scaled = prep.transform(test)
    got = predictions(refit.transform(scaled), "prediction", "probability")
    want = predictions(model.stages[-1].transform(scaled), "prediction", "probability")
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


# ------------------------------------------------------------------------------------ distributed transform
def test_transform_of_100k_rows_stays_on_the_executors(spark, fitted):
    """transform itself starts no Spark job (it only builds a plan); the plan reads the source on the
    executors and evaluates one Arrow Python UDF there; the action returns one aggregate row. A
    driver-side predict would need a job inside transform (collect/toPandas) and a local relation
    (LocalTableScan / ExistingRDD) as the plan's source instead of the Range."""
    stage = fitted[1].stages[-1].copy({fitted[1].stages[-1].featuresCol: "features"})
    df = spark.range(100_000, numPartitions=2).select(
        "id", F.array(*[F.rand(seed=i) for i in range(64)]).alias("features")
    )  # array<double> works too
    jobs, out = jobs_started(spark, lambda: stage.transform(df))
    assert jobs == [] and not isinstance(out, Exception), out

    plan = out._jdf.queryExecution().executedPlan().toString()
    assert plan.count("ArrowEvalPython") == 1, plan  # both output columns from one UDF call per row
    assert "Range (0, 100000" in plan and "LocalTableScan" not in plan and "Scan ExistingRDD" not in plan, plan
    row = out.agg(
        F.count("prediction").alias("n"), F.min("prediction").alias("lo"), F.max("prediction").alias("hi")
    ).first()
    assert row.n == 100_000 and 0 <= row.lo <= row.hi <= 9


# ------------------------------------------------------------------------------------ tuning
def test_cross_validator_picks_the_better_learning_rate(spark, digits, tmp_path):
    train, _ = digits
    data = VectorAssembler(inputCols=PIXELS, outputCol="features").transform(train)
    est = estimator(featuresCol="features").setParams(epochs=1)
    grid = ParamGridBuilder().addGrid(est.learningRate, [1e-5, 1e-2]).build()
    cv = CrossValidator(
        estimator=est,
        estimatorParamMaps=grid,
        numFolds=2,
        seed=1,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
    )
    model = cv.fit(data)
    low, high = model.avgMetrics
    assert high > low + 0.3, model.avgMetrics  # measured: 0.05 at lr 1e-5, 0.58 at lr 1e-2 (one epoch)
    assert isinstance(model.bestModel, GradshareModel)
    model.save(str(tmp_path / "cv"))  # CrossValidatorModel saves its estimator and best model through ours
    loaded = CrossValidatorModel.load(str(tmp_path / "cv"))
    assert loaded.avgMetrics == model.avgMetrics
    assert np.array_equal(*(predictions(m.transform(data), "prediction")[0] for m in (model, loaded)))


# ------------------------------------------------------------------------------------ regression, several inputs
class Affine(nn.Module):
    """model(x, z) for a vector input x and a scalar input z (a number column)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x, z):
        return self.lin(x) + z.unsqueeze(1).float()


def test_regressor_with_two_input_columns_predicts_a_double(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 3))
    z = rng.normal(size=512)
    y = x @ np.array([1.0, -2.0, 0.5]) + z
    df = spark.createDataFrame([(x[i].tolist(), float(z[i]), float(y[i])) for i in range(512)], ["x", "z", "y"])
    est = GradshareEstimator(
        Affine, featuresCol=["x", "z"], labelCol="y", epochs=2, learningRate=0.05, numWorkers=2, trainerOptions=LOOPBACK
    )
    model = est.fit(df)
    assert not model.isClassifier and model.spec["inputs"] == [
        {"dtype": "float32", "shape": [3]},
        {"dtype": "float32", "shape": []},
    ]
    out = model.transform(df)
    assert isinstance(out.schema["prediction"].dataType, DoubleType) and "probability" not in out.columns
    pred, xs, zs = predictions(out, "prediction", "x", "z")
    with torch.no_grad():
        want = model.torchModel(torch.from_numpy(xs.astype(np.float32)), torch.from_numpy(zs.astype(np.float32)))
    np.testing.assert_allclose(pred, want[:, 0].numpy(), rtol=1e-6)


def test_output_spec_decides_the_columns():
    inputs = parse_inputs("(float32[4], int64[])")
    assert inputs == [{"dtype": "float32", "shape": [4]}, {"dtype": "int64", "shape": []}]
    assert parse_inputs("float32[2, 3]") == [{"dtype": "float32", "shape": [2, 3]}]

    class Two(nn.Module):
        def __init__(self, out):
            super().__init__()
            self.lin = nn.Linear(4, out)

        def forward(self, x, ids):
            return self.lin(x) + ids.unsqueeze(1)

    assert output_spec(Two(3), inputs, "CrossEntropyLoss", "auto") == {
        "classification": True,
        "width": 3,
        "scalar": False,
    }
    assert output_spec(Two(3), inputs, "MSELoss", "auto") == {"classification": False, "width": 3, "scalar": False}
    assert output_spec(Two(1), inputs, "MSELoss", "auto")["scalar"]
    assert output_spec(Two(3), inputs, "train_step:step", "classification")["classification"]
    with pytest.raises(ValueError, match=r"\(B, 1\).*task='regression'"):
        output_spec(Two(1), inputs, "CrossEntropyLoss", "auto")


# ------------------------------------------------------------------------------------ bad input
def test_bad_columns_are_named_before_any_spark_job(spark, fitted):
    df = spark.createDataFrame([([0.0] * 64, 1, "a", 2.0)], ["features", "label", "text", "prediction"])
    cases = [
        (lambda: estimator(featuresCol="nope").fit(df), ValueError, "features column 'nope' is not in"),
        (lambda: estimator(featuresCol=["features", "gone"]).fit(df), ValueError, "features column 'gone'"),
        (lambda: estimator(featuresCol="text").fit(df), TypeError, "features column 'text' has type string"),
        (lambda: estimator(labelCol="text").fit(df), TypeError, "label column 'text' has type string"),
        (lambda: estimator(labelCol="y").fit(df), ValueError, "label column 'y' is not in"),
        (
            lambda: estimator(predictionCol="label", trainerOptions=LOOPBACK).fit(df.drop("prediction")),
            ValueError,
            "prediction column 'label' already exists",
        ),
        (lambda: estimator(trainerOptions={"stalenes": 1}), ValueError, "unknown key 'stalenes'"),
        (lambda: estimator(trainerOptions={"model": 1}), ValueError, "'model'; use a constructor argument"),
        (lambda: estimator(trainerOptions={"on_epoch_end": 1}), ValueError, "'on_epoch_end'; use a constructor"),
        (lambda: estimator(trainerOptions={"validation_data": 1}), ValueError, "use the validationIndicatorCol"),
        (lambda: estimator(trainerOptions={"batch_size": 8}), ValueError, "use the batchSize Param"),
        (lambda: estimator(predictBatchSize=0), TypeError, "predictBatchSize"),
        (lambda: estimator(epoch=2), ValueError, "no Param(s) ['epoch']"),
        (lambda: GradshareEstimator(featuresCol="features").fit(df.drop("prediction")), ValueError, "needs a model"),
        (
            lambda: estimator(trainerOptions={"compression": {"staleness": -1}}).fit(df.drop("prediction")),
            ValueError,
            "staleness must be",
        ),
    ]
    stage = fitted[1].stages[-1]
    cases += [
        (lambda: stage.transform(df), ValueError, "features column 'scaled' is not in"),
        (
            lambda: stage.copy({stage.featuresCol: "features"}).transform(df),
            ValueError,
            "prediction column 'prediction' already exists",
        ),
        (
            lambda: stage.copy({stage.featuresCol: "features", stage.predictionCol: "p"}).transform(
                df.withColumnRenamed("text", "probability")
            ),
            ValueError,
            "probability column 'probability' already",
        ),
        (
            lambda: stage.copy({stage.featuresCol: "label"}).transform(df.drop("prediction")),
            TypeError,
            "features column 'label' has type bigint; the model was fitted on float32",
        ),
    ]
    three = VectorAssembler(inputCols=["label", "label", "label"], outputCol="v3").transform(df.drop("prediction"))
    cases.append(
        (
            lambda: stage.copy({stage.featuresCol: "v3"}).transform(three),
            ValueError,
            "features column 'v3' holds vectors of size 3; the model was fitted on float32[64]",
        )
    )
    for action, kind, message in cases:
        jobs, outcome = jobs_started(spark, action)
        assert isinstance(outcome, kind) and message in str(outcome), (message, outcome)
        assert jobs == [], (message, jobs)


def test_transform_takes_a_vector_or_an_array_column_alike(spark, fitted):
    stage = fitted[1].stages[-1].copy({fitted[1].stages[-1].featuresCol: "v"})
    df = spark.range(8, numPartitions=1).select(F.array(*[F.lit(i / 64) for i in range(64)]).alias("a"))
    df = df.withColumn("v", array_to_vector("a"))
    by_vector = predictions(stage.transform(df), "probability")[0]
    by_array = predictions(stage.copy({stage.featuresCol: "a"}).transform(df.drop("v")), "probability")[0]
    assert np.array_equal(by_vector, by_array)
    only = stage.copy({stage.probabilityCol: ""}).transform(df)  # Spark's convention: '' turns a column off
    assert only.columns == ["a", "v", "prediction"]
    assert np.array_equal(predictions(only, "prediction")[0], by_vector.argmax(axis=1).astype(np.float64))

    with torch.no_grad():  # weights changed after a transform reach the executors on the next one
        stage.torchModel[-1].weight.zero_()
        stage.torchModel[-1].bias.zero_()
    assert np.allclose(predictions(stage.transform(df), "probability")[0], 0.1) and not np.allclose(by_vector, 0.1)
