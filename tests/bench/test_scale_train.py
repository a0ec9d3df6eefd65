"""SharedTrainer with 4 workers on local[4], in a subprocess: the shared test session is
local[2], and a barrier stage of 4 tasks needs 4 slots. 8 workers and local-cluster: the closing figures
(`python -m gradshare.bench.scale_train`, docs/benchmarks/scale.md)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the repo


def test_four_workers_on_local_4_train_bit_identical_with_per_rank_traffic():
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradshare.bench.scale_train",
            "--master",
            "local[4]",
            "--workers",
            "4",
            "--epochs",
            "1",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["workers"] == 4 and out["distinct_executors"] == 4 and out["steps"] >= 10
    assert out["bit_identical"]
    # per-rank forwarding: each update's datagrams go once to each of the 3 other workers; one that had
    # not joined yet when an update arrived gets it as a retransmission (NAK) instead of a forward
    model, updates = out["model_forwarded_datagrams_per_update"], 4 * out["steps"]
    assert out["forwarded_datagrams_per_update"] <= model
    assert out["forwarded_datagrams_per_update"] * updates + out["relay_retransmits"] >= model * updates
    assert out["relay_egress_bytes_per_step"] >= 0.95 * out["model_forward_bytes_per_step"]
    assert out["accuracy"] > 0.3  # one epoch of 11 steps: learning, not converged
