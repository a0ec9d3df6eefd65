"""`benchmarks/train.py` pieces that are cheap and real: the namespace/shaping commands and their
privilege fallback, and the result writer on a tiny real run of the single-process configuration."""

import argparse
import json
import os
import stat
import subprocess
import sys

import pytest

from lab import netns, train


def test_wrap_builds_namespace_and_tbf_commands():
    cmd = netns.wrap(["python", "-c", "pass"], "1gbit", is_root=True)
    assert cmd[:4] == ["unshare", "--net", "--", "sh"]
    script = cmd[5]
    assert "ip link set lo up" in script
    assert "tc qdisc add dev lo root tbf rate 1gbit burst 4mb latency 400ms" in script
    assert "tc qdisc del dev lo root" in script  # torn down before the namespace goes
    assert cmd[-3:] == ["python", "-c", "pass"]
    unprivileged = netns.wrap(["true"], "100mbit", is_root=False)
    assert unprivileged[:3] == ["unshare", "--net", "--map-root-user"]
    assert "rate 100mbit" in unprivileged[unprivileged.index("-c") + 1]
    assert "tc " not in netns.setup_script(None)  # unshaped: a private lo, no qdisc


def test_wrap_rejects_unknown_links_and_rates():
    with pytest.raises(ValueError, match="link must be one of"):
        netns.wrap(["true"], "10gbit")
    with pytest.raises(ValueError, match="rate must be one of"):
        netns.setup_script("1tbit")
    with pytest.raises(ValueError, match="command"):
        netns.wrap([], "unshaped")


def test_script_runs_the_command_and_passes_its_exit_code(tmp_path):
    # The generated shell text itself, with harmless stand-ins for ip/tc on PATH.
    for tool in ("ip", "tc"):
        path = tmp_path / tool
        path.write_text(f'#!/bin/sh\necho {tool} "$@" >> {tmp_path}/calls\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    p = subprocess.run(["sh", "-c", netns.setup_script("1gbit"), "x", "sh", "-c", "exit 7"], env=env, timeout=10)
    assert p.returncode == 7
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [
        "ip link set lo up",
        "tc qdisc add dev lo root tbf rate 1gbit burst 4mb latency 400ms",
        "tc qdisc del dev lo root",
    ]


def test_probe_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare, ip or tc
    ok, why = netns.probe()
    assert not ok and "unshare" in why and "tc" in why
    # tools present but namespaces refused, as for an unprivileged user without user namespaces
    for tool, body in (
        ("unshare", "echo 'unshare: unshare failed: Operation not permitted' >&2; exit 1"),
        ("ip", "exit 0"),
        ("tc", "exit 0"),
    ):
        path = tmp_path / tool
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:/bin:/usr/bin")
    ok, why = netns.probe()
    assert not ok and "Operation not permitted" in why and "user namespaces" in why


@pytest.mark.sockets
def test_fresh_namespace_has_only_loopback_and_counts_its_bytes():
    # As root (as on the development machine) a namespace must work, so a failure fails. Only an
    # unprivileged user whose kernel refuses user namespaces cannot build one: the benchmark then
    # falls back (test_probe_names_what_is_missing) and this test has nothing to run.
    ok, why = netns.probe()
    assert ok or os.geteuid() != 0, f"root, yet no shaped namespace: {why}"
    if not ok:
        pytest.skip(f"unprivileged and no user namespaces: {why}")
    code = (
        "from lab.netns import interfaces; from lab.profile import lo_tx_bytes;"
        "import socket; a=lo_tx_bytes(); s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
        "s.sendto(b'x'*1000, ('127.0.0.1', 9)); print(interfaces(), lo_tx_bytes()-a)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([root, os.path.join(root, "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    )
    p = subprocess.run(
        netns.wrap([sys.executable, "-c", code], "100mbit"), capture_output=True, text=True, timeout=30, env=env
    )
    assert p.returncode == 0, p.stderr
    names, sent = p.stdout.rsplit("]", 1)
    assert names + "]" == "['lo']"
    assert int(sent) >= 1000  # the datagram (plus headers) crossed the namespace's lo


def _args(*argv):
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_settings_validate_arguments_and_quick_bounds_the_run():
    with pytest.raises(ValueError, match="--systems"):
        train.settings(_args("--systems", "gradshare,horovod"))
    with pytest.raises(ValueError, match="--links"):
        train.settings(_args("--links", "10gbit"))
    with pytest.raises(ValueError, match="--budget"):
        train.settings(_args("--budget", "0"))
    with pytest.raises(ValueError, match="--gradshare-lr"):
        train.settings(_args("--gradshare-lr", "0"))
    with pytest.raises(ValueError, match="--residual-clip"):
        train.settings(_args("--residual-clip", "-1"))
    assert train.settings(_args("--residual-clip", "0"))["residual_clip"] is None  # 0: clipping off
    cfg = train.settings(_args("--quick", "--budget", "600"))
    assert cfg["rows"] == train.QUICK["rows"] and cfg["budget"] == train.QUICK["budget"]
    assert set(cfg["epochs"].values()) == {train.QUICK["epochs"]}


def test_single_process_run_writes_table_json_and_plot(tmp_path):
    from lab import report

    cfg = train.settings(
        _args(
            "--workloads",
            "cnn,mlp",
            "--systems",
            "single",
            "--rows",
            "160",
            "--epochs",
            "2",
            "--batch-size",
            "64",
            "--target",
            "0.3",
        )
    )
    rows = train.run_configs(cfg, "unshaped", ["single"])
    assert [r["workload"] for r in rows] == ["cnn", "mlp"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["steps"] == 2 * 3  # 160 rows, batch 64 -> 3 steps per epoch, 2 epochs
        assert len(r["curve"]) == 2 and r["curve"][0][0] < r["curve"][1][0]
        assert 0.0 <= r["final_accuracy"] <= 1.0 and r["sec_per_step"] > 0
        assert r["lo_bytes_per_step"] is not None  # a single process sends nothing, but it is measured
    assert rows[1]["n_params"] == 10_512_394 and rows[0]["n_params"] < 100_000
    doc = report.write_json(str(tmp_path / "r.json"), rows, command="test", config=cfg, notes=["n"])
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["results"][1]["steps"] == 6 and back["machine"]["cpus"] == os.cpu_count()
    assert back["targets"] == doc["targets"]  # no gradshare rows: every check is "not measured"
    assert all(c["met"] is None for c in back["targets"]["mlp"])
    text = report.table(rows)
    assert text.count(" single ") == 2 and "1.00" in text  # header says ×single
    report.plot(str(tmp_path / "r.png"), rows)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_checks_compare_the_right_rows():
    from lab import report

    def r(system, link, sps, bps, ttt, acc):
        return {
            "system": system,
            "workload": "mlp",
            "link": link,
            "status": "ok",
            "sec_per_step": sps,
            "lo_bytes_per_step": bps,
            "time_to_target": ttt,
            "final_accuracy": acc,
        }

    rows = [
        r("single", "unshaped", 0.10, 0, 5.0, 0.95),
        r("gradshare", "1gbit", 0.12, 1e5, 8.0, 0.948),
        r("ddp", "1gbit", 0.60, 8e7, 40.0, 0.95),
        r("powersgd", "1gbit", 0.2, 1e6, 10.0, 0.95),
        r("gradshare", "100mbit", 0.13, 1e5, 9.0, 0.948),
        r("ddp", "100mbit", 2.0, 8e7, None, 0.5),
    ]
    checks = {c["target"]: c for c in report.targets(rows)}
    assert checks["1gbit: gradshare s/step ÷ single s/step"]["value"] == pytest.approx(1.2)
    assert checks["1gbit: gradshare s/step ÷ single s/step"]["met"] is False  # target: at most 1.15
    assert checks["1gbit: gradshare s/step ÷ DDP dense s/step"]["value"] == pytest.approx(0.2)
    assert checks["100mbit: gradshare s/step ÷ DDP dense s/step"]["met"] is False  # 0.065 > 0.05
    assert checks["1gbit: gradshare time-to-target ÷ DDP+PowerSGD"]["value"] == pytest.approx(0.8)
    assert checks["1gbit: gradshare time-to-target ÷ DDP dense"]["value"] == pytest.approx(0.2)
    assert checks["100mbit: gradshare time-to-target ÷ DDP dense"]["value"] == 0.0  # DDP never got there
    assert checks["100mbit: gradshare time-to-target ÷ DDP dense"]["met"] is True
    assert checks["1gbit: gradshare time-to-target ÷ single"]["value"] == pytest.approx(1.6)  # 8 s vs 5 s
    assert checks["1gbit: gradshare time-to-target ÷ single"]["met"] is False  # target: at most 0.7
    assert checks["1gbit: single − gradshare final acc. (pp, last 3)"]["value"] == pytest.approx(0.2)
    assert checks["1gbit: DDP dense ÷ gradshare bytes/step (lo)"]["value"] == pytest.approx(800)


def test_final_accuracy_is_the_mean_of_the_last_evaluations():
    from lab import report
    from lab.systems import Measured

    curve = [(1.0, 0.5), (2.0, 0.9), (3.0, 0.96), (4.0, 0.92), (5.0, 0.97)]
    assert report.final_accuracy(curve) == pytest.approx((0.96 + 0.92 + 0.97) / 3)
    assert report.final_accuracy(curve, evals=1) == 0.97
    assert report.final_accuracy(curve[:2]) == pytest.approx(0.7)  # fewer points than the window: all
    assert report.final_accuracy([]) is None
    with pytest.raises(ValueError, match="evals"):
        report.final_accuracy(curve, evals=0)
    r = report.row("single", "mlp", "unshaped", Measured([0.1] * 10, curve, 0, 10), 0.9)
    assert r["final_accuracy"] == pytest.approx(0.95) and r["last_accuracy"] == 0.97
    assert r["time_to_target"] == 2.0  # the first crossing, unchanged


def test_lr_schedule_flag_takes_every_shared_schedule(capsys):
    from lab import systems

    # the train and convergence studies build their schedulers with the one systems.lr_scheduler_factory
    # (its formulas: tests/lab/test_lab_convergence.py)
    for schedule in systems.LR_SCHEDULES:
        assert train.settings(_args("--lr-schedule", schedule))["lr_schedule"] == schedule
    with pytest.raises(SystemExit):
        _args("--lr-schedule", "linear")
    assert "invalid choice" in capsys.readouterr().err
