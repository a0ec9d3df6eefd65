"""The driver's side of the in-job relay without Spark (driver/in_job.py): where a failed stage restarts,
and which failures a restart may pass."""

import pytest

from gradshare.driver.in_job import restart_point, restartable
from gradshare.errors import TrainingError, TransportTimeout
from gradshare.reports import WorkerFailure
from gradshare.task.checkpoint import MANIFEST


def test_a_restart_resumes_from_the_last_complete_checkpoint_and_drops_one_cut_short(tmp_path):
    root = tmp_path / "ckpt"
    assert restart_point(str(root), None) is None  # no directory yet: from scratch
    (root / "epoch-00001").mkdir(parents=True)
    (root / "epoch-00001" / MANIFEST).write_text("{}")
    (root / "epoch-00002" / "rank-0").mkdir(parents=True)  # cut short: no manifest
    assert restart_point(str(root), "/elsewhere") == str(root)
    assert sorted(p.name for p in root.iterdir()) == ["epoch-00001"]
    (root / "epoch-00001" / MANIFEST).unlink()  # nothing complete: the fit's own resume_from
    assert restart_point(str(root), "/elsewhere") == "/elsewhere" and not any(root.iterdir())


@pytest.mark.parametrize(
    "error_type, error_class, again",
    [
        ("RuntimeError", "TrainingError", False),  # the user's model
        ("ValueError", "ValueError", False),  # the user's data
        ("TransportTimeout", "TransportTimeout", True),  # a peer or the relay went silent
        ("ConnectionResetError", "TrainingError", True),
        ("MemoryError", "TrainingError", True),
    ],
)
def test_a_restart_is_for_what_may_pass_not_for_the_users_error(error_type, error_class, again):
    error = WorkerFailure(1, 3, error_type, "x", error_class).error()
    assert restartable(error) is again


def test_a_task_that_died_without_a_record_is_restarted_but_a_bad_argument_is_not():
    assert restartable(TrainingError("the Spark training job failed: Python worker exited unexpectedly"))
    assert restartable(TransportTimeout("no worker of the barrier stage reached the relay"))
    assert not restartable(ValueError("partition 0 has 3 rows now"))
