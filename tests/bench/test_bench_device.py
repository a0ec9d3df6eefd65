"""`gradshare bench device`: options, JSON keys, the torch path's message equal to the Numba path's (the
benchmark checks it on every row), not the speed."""

from __future__ import annotations

import json

import pytest

from gradshare.cli import main

ROW_KEYS = {
    "params",
    "entries",
    "form",
    "torch_encode_s",
    "torch_add_s",
    "torch_encode_over_add",
    "torch_apply_s",
    "numba_encode_s",
    "numpy_add_s",
    "numba_encode_over_numpy_add",
}


def _json_run(capsys, *argv: str) -> dict:
    assert main(["bench", "device", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_rows_on_the_cpu(capsys):
    res = _json_run(capsys, "--device", "cpu", "--sizes", "100000", "300000", "--repeat", "2")
    assert res["device"] == "cpu" and res["threads"] == 1 and res["repeat"] == 2
    assert [row["params"] for row in res["rows"]] == [100_000, 300_000]
    for row in res["rows"]:
        assert set(row) == ROW_KEYS
        assert 0.5e-3 * row["params"] <= row["entries"] <= 1.5e-3 * row["params"]
        for key in ROW_KEYS - {"params", "entries", "form"}:
            assert row[key] > 0, key


def test_without_numba_and_table_output(capsys):
    res = _json_run(capsys, "--device", "cpu", "--sizes", "50000", "--repeat", "1", "--no-numba")
    assert res["rows"][0]["numba_encode_s"] is None and res["rows"][0]["numba_encode_over_numpy_add"] is None
    assert main(["bench", "device", "--device", "cpu", "--sizes", "50000", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "gradshare bench device: cpu" in out and "enc/add" in out and "50,000" in out


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--density", "1"], ["--repeat", "0"], ["--threads", "0"]])
def test_bad_options_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "device", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_an_unusable_device_is_named():
    with pytest.raises(ValueError, match="device 'cuda:99' was asked for"):
        main(["bench", "device", "--device", "cuda:99", "--sizes", "1000", "--repeat", "1"])
