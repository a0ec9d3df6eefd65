"""`gradshare bench encoding`: options, JSON keys, consistency of the figures (not their speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradshare.bench import encoding as bench
from gradshare.cli import main

ROOT = Path(__file__).resolve().parents[2]  # tests/bench/ -> the repo
KEYS = {
    "params",
    "density_requested",
    "density",
    "entries",
    "threshold",
    "repeat",
    "threads",
    "encode_s",
    "numpy_add_s",
    "encode_over_numpy_add",
    "apply_s",
    "apply_entries_per_s",
    "apply_warm_s",
    "apply_warm_entries_per_s",
    "decode_entries_per_s",
    "form",
    "message_bytes",
    "dense_bytes",
    "compression_ratio",
    "bytes_per_entry",
    "dl4j_bytes_per_entry",
    "cold_start_s",
    "cold_start_first_s",
    "python",
    "numpy",
    "numba",
}


def _json_run(capsys, *argv: str) -> dict:
    assert main(["bench", "encoding", *argv, "--json", "--no-cold-start"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys_and_consistency(capsys):
    res = _json_run(capsys, "--params", "1000000", "--density", "0.001", "--repeat", "3")
    assert set(res) == KEYS
    assert res["params"] == 1_000_000 and res["repeat"] == 3 and res["threads"] == 1
    assert 700 <= res["entries"] <= 1300  # density asked 1e-3 of 1e6: binomial, sd ~32
    assert res["density"] == res["entries"] / res["params"]
    assert res["form"] == "rice"  # Golomb-Rice beats varints on random gaps
    assert res["dense_bytes"] == 4_000_000
    assert res["compression_ratio"] == pytest.approx(res["dense_bytes"] / res["message_bytes"])
    # wire size at 1e-3 (target: <= 2.2 bytes per entry; the 32-byte header included)
    assert res["bytes_per_entry"]["sparse"] <= 2.2
    assert res["bytes_per_entry"]["rice"] < res["bytes_per_entry"]["sparse"]
    assert res["message_bytes"] == round(res["bytes_per_entry"]["rice"] * res["entries"])
    assert res["bytes_per_entry"]["bitmap"] == pytest.approx((32 + 250_000) / res["entries"])
    assert res["apply_entries_per_s"] == pytest.approx(res["entries"] / res["apply_s"])
    assert res["encode_s"] > 0 and res["numpy_add_s"] > 0 and res["encode_over_numpy_add"] > 0
    assert res["cold_start_s"] is None


def test_dense_step_with_threads(capsys):
    res = _json_run(capsys, "--params", "200000", "--density", "0.5", "--repeat", "1", "--threads", "2")
    assert res["threads"] == 2 and 0.45 < res["density"] < 0.55
    sizes = {form: round(bpe * res["entries"]) for form, bpe in res["bytes_per_entry"].items()}
    assert sizes["bitmap"] == 32 + 50_000
    assert res["message_bytes"] == min(sizes.values()) and sizes[res["form"]] == res["message_bytes"]


def test_table_output(capsys):
    assert main(["bench", "encoding", "--params", "100000", "--repeat", "1", "--no-cold-start"]) == 0
    out = capsys.readouterr().out
    for text in (
        "fused accumulate+encode",
        "numpy.add(r, u, out=r)",
        "encode / numpy.add",
        "decode-apply",
        "wire bytes per entry",
        "smaller than dense float32",
    ):
        assert text in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--params", "0"],
        ["--params", "x"],
        ["--density", "0"],
        ["--density", "1"],
        ["--repeat", "0"],
        ["--threads", "0"],
    ],
)
def test_bad_options_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "encoding", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cold_start_is_measured_in_fresh_processes():
    res = bench.measure(50_000, 0.01, 1, cold_start=True)
    assert 0 < res["cold_start_s"] < 120 and 0 < res["cold_start_first_s"] < 120


def test_script_and_light_imports():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "import sys, gradshare.bench.encoding, gradshare.cli; print('numpy' in sys.modules, 'numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr  # the CLI parser must not load numpy/numba
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradshare.cli",
            "bench",
            "encoding",
            "--params",
            "1e5",
            "--repeat",
            "1",
            "--json",
            "--no-cold-start",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params"] == 100_000
