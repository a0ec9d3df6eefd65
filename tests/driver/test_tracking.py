"""Run logging and plots: SharedTrainer(runtime=Runtime(mlflow=...)) records ONE MLflow run per fit
(params, per-epoch metrics, the model as an artifact) in a local file store, a failed fit is a FAILED
run, and FitResult.plot writes a real PNG, with and without validation data."""

import json
import struct
import zlib

import mlflow
import numpy as np
import pytest
import torch

from gradshare import SharedTrainer
from gradshare.config.options import Network, Runtime
from gradshare.demo import digits_split, mlp
from gradshare.driver.result import FitResult

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local file store for this test only; the global tracking URI is restored afterwards."""
    # MLflow 3.x refuses the file store unless asked (it steers new users to SQLite; a file store is what a
    # test without SQLAlchemy can have)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    before = mlflow.get_tracking_uri()
    uri = (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(uri)
    yield mlflow.tracking.MlflowClient(uri)
    mlflow.set_tracking_uri(before)


def _runs(client, experiment: str):
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


@pytest.mark.spark
def test_one_fit_is_one_mlflow_run_with_params_metrics_and_the_model(spark, store, tmp_path):
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train[:400], (int(v) for v in y_train[:400])))
    rdd = spark.sparkContext.parallelize(rows, 2)
    trainer = SharedTrainer(
        mlp,
        epochs=2,
        batch_size=32,
        validation_data=(X_test, y_test),
        **LOOPBACK,
        runtime=Runtime(mlflow={"experiment": "gradshare-test", "run_name": "digits", "tags": {"team": "ml"}}),
    )
    result = trainer.fit(rdd)

    runs = _runs(store, "gradshare-test")
    assert len(runs) == 1, "one run per fit, not one per worker"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "digits" and run.data.tags["team"] == "ml"
    params = run.data.params
    assert params["threshold"] == "auto" and params["epochs"] == "2" and params["batch_size"] == "32"
    assert (
        params["model"] == "gradshare.demo.mlp"
        and params["compression.staleness"] == "0"
        and params["network.bind"] == "127.0.0.1"
    )
    assert params["validation_data"] == "(float32[450, 64], int64[450])"
    assert params["world_size"] == "2" and params["n_params"] == str(result.n_params)
    assert params["fit.loss"] == result.extra["loss"]

    for key in ("loss", "val_metric", "tau", "sparsity", "bytes_sent", "bytes_received", "seconds"):
        logged = store.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in sorted(logged, key=lambda m: m.step)] == [
            (row["epoch"], pytest.approx(float(row[key]))) for row in result.history
        ], key
    assert run.data.metrics["traffic_ratio"] == pytest.approx(result.traffic_ratio)

    path = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id,
        artifact_path="model/state_dict.pt",
        dst_path=str(tmp_path / "dl"),
        tracking_uri=mlflow.get_tracking_uri(),
    )
    state = torch.load(path)
    assert state.keys() == result.model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in result.model.state_dict().items())
    assert {f.path for f in store.list_artifacts(run.info.run_id)} == {"history.json", "model"}
    history = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id,
        artifact_path="history.json",
        dst_path=str(tmp_path / "dl"),
        tracking_uri=mlflow.get_tracking_uri(),
    )
    assert json.load(open(history)) == json.loads(json.dumps(result.history))

    # the same fit drawn: a PNG with the validation panel
    png = result.plot(tmp_path / "fit.png")
    _assert_png(png)


def test_a_failed_fit_is_a_failed_run_nested_under_the_active_run(store):
    trainer = SharedTrainer(mlp, **LOOPBACK, runtime=Runtime(mlflow={"experiment": "gradshare-fail"}))
    experiment_id = store.create_experiment("gradshare-fail")
    with mlflow.start_run(experiment_id=experiment_id, run_name="parent") as parent:
        with pytest.raises(TypeError, match="RDD"):
            trainer.fit([(np.zeros(64), 0)])  # a list, not an RDD: fails before any Spark job
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the caller's run stays active
    runs = _runs(store, "gradshare-fail")
    assert len(runs) == 2, [r.info.run_name for r in runs]
    (child,) = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert child.info.status == "FAILED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.params["epochs"] == "1"  # the params were logged before the fit started


def test_a_logging_failure_after_the_fit_keeps_the_result_and_says_so(store, monkeypatch):
    from gradshare.driver import tracking

    class Trainer:  # what `tracked` needs of a SharedTrainer: its options and its Runtime group (mlflow)
        options = {"epochs": 3}
        runtime = Runtime(mlflow={"experiment": "gradshare-late"})

        @tracking.tracked
        def fit(self, data):
            return _result([_row(0)])

    def broken(*args, **kwargs):
        raise OSError("tracking server went away")

    monkeypatch.setattr(tracking, "log_result", broken)
    with pytest.warns(RuntimeWarning, match="the fit succeeded but logging it .* OSError: tracking server went away"):
        result = Trainer().fit("data")
    assert result.history == [_row(0)]
    (run,) = _runs(store, "gradshare-late")
    assert run.info.status == "FAILED" and run.data.params["epochs"] == "3"


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("yes", TypeError, "mlflow must be None, True or a dict"),
        ({"experiment_name": "x"}, ValueError, r"unknown key\(s\) \['experiment_name'\]"),
        ({"run_name": ""}, ValueError, r"mlflow\['run_name'\] must be a non-empty string"),
        ({"log_model": "no"}, ValueError, r"mlflow\['log_model'\] must be True or False"),
    ],
)
def test_bad_mlflow_option_fails_at_construction(value, error, match):
    with pytest.raises(error, match=match):
        SharedTrainer(mlp, runtime=Runtime(mlflow=value))


def _result(history, n_params=1000, world_size=2) -> FitResult:
    return FitResult(
        model=None,
        history=history,
        counters={},
        worker_reports=[],
        param_hash="",
        world_size=world_size,
        n_params=n_params,
        steps=sum(r["steps"] for r in history),
        resumed_from=0,
        seconds=1.5,
    )


def _row(epoch, val=None):
    return {
        "epoch": epoch,
        "steps": 20,
        "loss": 2.0 / (epoch + 1),
        "sparsity": 2e-3,
        "payload_bytes": 900,
        "bytes_sent": 4000 + epoch,
        "bytes_received": 4100,
        "tau": 1e-3,
        "lr": 1e-3,
        "silent_steps": 0,
        "seconds": 0.4,
        "val_metric": val,
        "loss_fn": "CrossEntropyLoss",
    }


def _assert_png(path) -> None:
    """A complete, valid PNG: signature, IHDR of a real image, every chunk's CRC, IEND last."""
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, (path, len(data))
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 200


def test_plot_without_validation_writes_a_png(tmp_path):
    out = _result([_row(0), _row(1), _row(2)]).plot(tmp_path / "no-val")  # no suffix: PNG
    _assert_png(out)


def test_plot_follows_the_suffix_and_refuses_an_empty_history(tmp_path):
    svg = _result([_row(0, 0.5), _row(1, 0.8)]).plot(str(tmp_path / "fit.svg"))
    assert open(svg).read(200).lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="no history rows"):
        _result([]).plot(tmp_path / "empty.png")


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # an import of it now raises ImportError
    with pytest.raises(ImportError, match=r"gradshare\[plot\]"):
        _result([_row(0)]).plot(tmp_path / "x.png")
