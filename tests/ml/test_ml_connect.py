"""gradshare.ml on a Spark Connect session: GradshareEstimator in a Pipeline with Spark's own
VectorAssembler and StandardScaler trains the digits MLP to a known accuracy; transform predicts what
the driver's module predicts; the PipelineModel, the GradshareModel alone and the Estimator save to and
load from a local directory with identical predictions; bad input is named as on classic
(tests/ml/test_ml.py). The bodies run in the ONE Connect runner process of the session
(tests/connect_runner.py, tests/connect_cases.py)."""

import pytest

from gradshare.ml.persist import write_bytes


def ok(reply):
    assert reply[0] == "ok", reply
    return reply[1]


class ConnectSession:
    """Stands in for a Connect session where only its kind is read (gradshare.driver.session.is_connect)."""

    __module__ = "pyspark.sql.connect.session"


def test_a_connect_save_to_a_path_the_client_cannot_see_is_named(tmp_path):
    # the server wrote no metadata/ where this client looks: client and server do not share the path
    with pytest.raises(ValueError, match="cannot see it there"):
        write_bytes(ConnectSession(), str(tmp_path / "model" / "weights.pt"), b"weights")
    (tmp_path / "model" / "metadata").mkdir(parents=True)
    write_bytes(ConnectSession(), f"file://{tmp_path}/model/weights.pt", b"weights")
    assert (tmp_path / "model" / "weights.pt").read_bytes() == b"weights"
    with pytest.raises(FileExistsError):  # never overwrite, as on classic
        write_bytes(ConnectSession(), str(tmp_path / "model" / "weights.pt"), b"other")


@pytest.mark.spark
def test_pipeline_fit_transform_save_load_on_connect(connect, tmp_path):
    got = ok(connect.run("ml_pipeline", epochs=3, tmp=str(tmp_path), timeout=400))
    assert got["classifier"] and got["history"] == 3
    assert got["schema"].endswith(",raw:vector,scaled:vector,prediction:double,probability:vector>"), got["schema"]
    assert got["accuracy"] > 0.9, got  # 0.95 measured (3 epochs, seeded: the same every run)
    # the executors predicted what the driver's module predicts for the same rows
    assert got["forward_pred"] and got["forward_prob"] < 1e-5
    assert got["pipeline_same"] and got["model_same"] and got["loaded_uid"]
    assert got["file_same"]  # a large model, shipped as a session file, predicts the same
    assert got["stages"] == ["VectorAssembler", "StandardScalerModel", "GradshareModel"]
    assert got["files"] == ["architecture.pkl", "metadata", "weights.pt"]  # the classic layout: plain files
    assert got["weights_keys"] and all("." in k for k in got["weights_keys"])  # a plain torch state_dict
    assert "already exists" in got["second_save"], got["second_save"]  # no overwrite without .overwrite()
    assert got["est_params"]


@pytest.mark.spark
def test_bad_input_on_connect_is_named_as_on_classic(connect, tmp_path):
    errors = ok(connect.run("ml_bad_input", tmp=str(tmp_path)))
    expected = [
        ("ValueError", "features column 'nope' is not in"),
        ("TypeError", "features column 'text' has type string"),
        ("ValueError", "label column 'y' is not in"),
        ("ValueError", "prediction column 'label' already exists"),
        ("ValueError", "validationIndicatorCol='val' does not work on a Spark Connect session"),
        ("ValueError", "features column 'scaled' is not in"),
        ("ValueError", "prediction column 'prediction' already exists"),
        ("TypeError", "features column 'label' has type bigint; the model was fitted on float32"),
        ("ValueError", "features column 'v3' holds vectors of size 3; the model was fitted on float32[64]"),
        (
            "ValueError",
            "the path must be a local directory shared with the Connect server, not 'hdfs://namenode/models/m'",
        ),
        ("AnalysisException", "Path does not exist"),
        ("FileNotFoundError", "weights.pt does not exist: not a saved gradshare.ml instance, or saved incompletely"),
    ]
    assert len(errors) == len(expected)
    for got, (kind, words) in zip(errors, expected):
        assert got is not None and got[0] == kind and words in got[1], (kind, words, got)
    assert ok(connect.run("ping")) == 3  # the session is still usable


def test_a_shipped_model_file_holds_both_parts_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    from pyspark import SparkFiles

    from gradshare.ml.predict import ShippedModel, pack_payload, unpack_payload

    payload = (b"architecture", b"weights" * 100)
    data = pack_payload(payload)
    assert unpack_payload(data) == payload
    shipped = ShippedModel(ShippedModel.name_for(data))
    (tmp_path / shipped.name).write_bytes(data)
    monkeypatch.setattr(SparkFiles, "get", lambda name: str(tmp_path / name))
    assert shipped.payload() == payload
    (tmp_path / shipped.name).write_bytes(data + b"x")
    with pytest.raises(ValueError, match="does not match its sha256"):
        shipped.payload()
    with pytest.raises(ValueError, match="bad architecture length"):
        unpack_payload((1 << 40).to_bytes(8, "little") + b"short")
