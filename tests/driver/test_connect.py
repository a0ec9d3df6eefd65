"""SharedTrainer.fit(df) on a Spark Connect session (no SparkContext, no RDDs): the DataFrame path
(mapInArrow) trains the digits MLP to a known accuracy with bit-identical replicas, from an array or
an ML vector column, several feature columns and float labels; validation, early stopping and local
checkpoints work; what cannot work on Connect yet fails before any job, naming the option. The bodies
run in the ONE Connect runner process of the session (connect_runner.py, tests/connect_cases.py)."""

import pytest

pytestmark = pytest.mark.spark


def ok(reply):
    assert reply[0] == "ok", reply
    return reply[1]


def test_the_runner_holds_a_connect_session_without_rdds(connect):
    got = ok(connect.run("session_kind"))
    assert got["session"].startswith("pyspark.sql.connect") and got["rdd"] != "available"


def test_digits_on_connect_from_array_and_vector_columns_with_validation_and_checkpoints(connect, tmp_path):
    got = ok(connect.run("digits", epochs=5, tmp=str(tmp_path), timeout=400))
    arr, vec = got["arr"], got["vec"]
    assert arr["world"] == 2 and arr["inputs"] == "float32[64]" and arr["loss"] == "CrossEntropyLoss"
    assert arr["accuracy"] > 0.9, arr  # the classic suite's digits MLP reaches ~0.93 in 6 epochs
    assert set(arr["worker_hashes"]) == {arr["hash"]}  # every replica bit-identical to the relay
    # the same rows in the same partitions: a dense vector column trains bit for bit as the array column
    assert vec["hash"] == arr["hash"] and vec["inputs"] == "float32[64]"
    assert (
        len(arr["val"]) == 5
        and all(v is not None for v in arr["val"])
        and arr["val"][-1] == pytest.approx(arr["accuracy"], abs=1e-6)
    )
    assert arr["stopped"] is None  # patience 50: early stopping watched and never fired
    assert arr["checkpoints"] == [f"epoch-{e:05d}" for e in range(1, 6)]
    # "auto" on Connect: the relay ran in rank 0's task, and its status reached this client
    assert arr["relay"] == vec["relay"] == "in-job" and arr["statuses"] > 0
    assert got["client"]["relay"] == "client" and got["client"]["hash"] == arr["hash"]  # the same log
    resumed = got["resumed"]
    assert resumed["epochs"] == [5] and resumed["from"].endswith("epoch-00005") and resumed["accuracy"] > 0.9


def test_a_killed_relay_host_runs_the_stage_again_from_the_last_checkpoint_on_connect(connect, tmp_path):
    got = ok(connect.run("killed_host", tmp=str(tmp_path), timeout=400))
    assert got["died"] and got["relay"] == "in-job"
    [restart] = got["restarts"]
    assert restart["from"] == str(tmp_path / "ckpt")
    # 11 steps an epoch: rank 0 died in epoch 1, after the checkpoint of epoch 0; the run that finished
    # resumed there, and ends bit-identical to the fit that never died
    assert got["epochs"] == [1, 2] and got["workers"] == [got["hash"]] and got["hash"] == got["whole"]


def test_each_epoch_reaches_the_connect_client_as_a_line_while_the_relay_runs_in_the_job(connect):
    got = ok(connect.run("epoch_lines"))
    history = got["history"]
    # one line per epoch, its mean loss (the applied log's) and, for all but the last, rank 0's score
    assert got["printed"] == [
        f"epoch {e}: loss {loss:.4f}" + ("" if e == 2 else f", val_metric {val:.4f}") for e, loss, val in history
    ]


def test_a_callback_stops_every_rank_after_the_same_epoch_on_connect(connect):
    got = ok(connect.run("early_stop"))
    assert got["stopped"] is not None and got["stopped"] < 5 and got["epochs"] == list(range(got["stopped"] + 1))
    assert len(got["hashes"]) == 1


def test_several_feature_columns_and_float_labels_on_connect(connect):
    got = ok(connect.run("inputs"))
    assert got["inputs"] == "(float32[64], float32[])" and got["loss"] == "MSELoss" and got["world"] == 2
    assert got["loss_fell"] and got["same"]


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("missing_column", "ValueError", ["'pixels'", "columns are"]),
        ("rdd_on_connect", "ValueError", ["Spark Connect", "fit(df, features_col=..., label_col=...)"]),
        ("rows_on_connect", "TypeError", ["list", "fit(df, features_col=..., label_col=...)"]),
        ("sharded_validation", "ValueError", ["validation_data", "Spark Connect", "(X, y)"]),
        (
            "hadoop_checkpoints",
            "ValueError",
            ["checkpoint_dir='hdfs://namenode/ckpt'", "Spark Connect", "local directory"],
        ),
        ("too_many_workers", "ValueError", ["3 workers", "local[2]"]),
        ("null_label", "ValueError", ["column 'y' is null at row"]),
        ("worker_error", "TrainingError", ["rank", "RuntimeError: user model exploded on purpose"]),
    ],
)
def test_what_connect_cannot_do_fails_clearly(connect, case, error, words):
    reply = connect.run(case)
    assert reply[0] == "error" and reply[1] == error, reply
    for w in words:
        assert w in reply[2], reply
    assert ok(connect.run("ping")) == 3  # the session is still usable
