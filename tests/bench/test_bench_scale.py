"""`gradshare bench scale`: a small real run end to end, the --peers parser, and the projection model."""

from __future__ import annotations

import argparse
import json

import pytest

from gradshare.bench import scale, scale_model
from gradshare.cli import main


@pytest.mark.sockets
def test_small_run_writes_json_and_png_with_exactly_once_and_the_per_rank_traffic(tmp_path, capsys):
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    assert (
        main(
            [
                "bench",
                "scale",
                "--peers",
                "2,3",
                "--params",
                "20000",
                "--density",
                "0.02",
                "--steps",
                "4",
                "--seconds",
                "2",
                "--heartbeat-peers",
                "2,70",
                "--json",
                str(out),
                "--png",
                str(png),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert png.stat().st_size > 10_000
    assert [r["peers"] for r in res["runs"]] == [2, 3]
    for r in res["runs"]:
        n = r["peers"]
        assert r["exactly_once"] and r["steps"] == 4
        # per-rank forwarding: every update leaves the relay once per other peer, chunk for chunk
        assert r["forwarded_datagrams_per_step"] == pytest.approx(n * (n - 1) * r["datagrams_per_update"])
        model = n * (n - 1) * r["forwarded_bytes_per_update"]
        assert r["model_egress_bytes_per_step"] == pytest.approx(model)
        # egress = the forwards + control (ACKs, STATUS pages): more than the model, not twice it
        assert model <= r["egress_bytes_per_step"] < 2 * model + 2000
        assert r["relay_cpu_per_step_s"] > 0 and r["latency_p99_ms"] >= r["latency_p50_ms"] > 0
    assert [h["peers"] for h in res["heartbeats"]] == [2, 70]
    assert {row["peers"] for row in res["projection"]["table"]} == set(scale_model.PROJECT_TO)
    assert "max(8*E/B, C)" in res["projection"]["model"]
    text = capsys.readouterr().out
    assert "projected step communication" in text and "heartbeat traffic" in text


@pytest.mark.parametrize("text", ["", "1,4", "a,b", "4,-2"])
def test_peers_argument_is_checked(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--peers"):
        scale.peer_counts(text)


def test_an_unknown_forwarding_mode_is_refused_naming_the_modes(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "scale", "--forwarding", "aggregated"])
    err = capsys.readouterr().err
    assert "per-rank" in err and "'aggregate'" in err


@pytest.mark.sockets
def test_aggregate_run_is_exactly_once_per_step_with_one_message_per_peer(tmp_path):
    # --steps ends each run: --seconds is far above what 4 steps take on a loaded host, so none is cut short
    out = tmp_path / "scale.json"
    args = "--forwarding aggregate --peers 3,5 --params 200000 --density 0.02 --steps 4 --seconds 300"
    assert main(["bench", "scale", *args.split(), "--heartbeat-peers", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for r in res["runs"]:
        n = r["peers"]
        assert r["exactly_once"] and r["steps"] == 4 and r["forwarding"] == "aggregate"
        # one aggregate per step and peer, each sent once: N copies of it, not the ranks' N·(N−1) messages;
        # NAKs' resends (a loaded host's late reads) are counted apart and so is the control traffic
        assert r["forwarded_bytes_per_step"] == pytest.approx(n * r["forwarded_bytes_per_update"])
        assert r["forwarded_bytes_per_step"] <= r["target_egress_bytes_per_step"]
        assert r["egress_bytes_per_step"] >= r["forwarded_bytes_per_step"]
        assert r["latency_p99_ms"] >= r["latency_p50_ms"] > 0
    assert "E(N) = N*w" in res["projection"]["model"] and res["projection"]["costs"]["per_step_s"] >= 0


def _row(n: int, cpu: float, d: float = 2.0, w: float = 2800.0) -> dict:
    return {
        "peers": n,
        "forwarded_datagrams_per_step": n * (n - 1) * d,
        "relay_cpu_per_step_s": cpu,
        "datagrams_per_update": d,
        "forwarded_bytes_per_update": w,
    }


def test_projection_fits_the_costs_and_takes_the_slower_of_link_and_cpu():
    a, b = 10e-6, 200e-6  # 10 µs per forwarded datagram, 200 µs per update
    rows = [_row(n, a * n * (n - 1) * 2.0 + b * n) for n in (2, 4, 8, 16)]
    p = scale_model.project(rows, sizes=(4, 256), links=(1, 25))
    assert p["costs"]["per_datagram_s"] == pytest.approx(a, rel=1e-6)
    assert p["costs"]["per_update_s"] == pytest.approx(b, rel=1e-6)
    small, big = p["table"]
    # N = 256: 65,280 pairs × 2,800 B = 183 MB: 1.46 s at 1 Gbit/s (link-bound), 58 ms at 25 Gbit/s, below
    # the relay's 1.36 s of CPU (CPU-bound)
    assert big["egress_bytes"] == pytest.approx(256 * 255 * 2800.0)
    assert big["1gbit_s"] == pytest.approx(8 * 256 * 255 * 2800.0 / 1e9) and big["1gbit_bound"] == "link"
    assert big["25gbit_s"] == pytest.approx(a * 256 * 255 * 2 + b * 256) and big["25gbit_bound"] == "relay cpu"
    assert small["25gbit_s"] == pytest.approx(a * 12 * 2 + b * 4)
