"""``snapshotd-bench transport`` run tiny: real coordinator, sidecars, driver and raw-socket processes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from snapshotd.bench import cli, transport

LOOPBACK_KEYS = ["state_bytes", "sidecar_GBps", "raw_socket_GBps", "loopback_ratio", "sidecar_rss_bytes"]
SIZE = 8 << 20


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    transport.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run_cli(tmp_path: Path, *argv: str) -> dict:
    path = tmp_path / "transport.json"
    assert (
        cli.main(["transport", "--heartbeat-timeout", "1.5", "--timeout", "60", *argv, "--json", str(path)])
        == 0
    )
    doc = json.loads(path.read_text())
    assert doc["bench"] == "transport"
    return doc


def _check_sidecar_rows(doc: dict) -> None:
    rows = [r for r in doc["results"] if "sidecar" in r["run"]]
    assert rows
    for row in rows:
        assert row["replications"] == 0, row  # no redundant re-replication raced the streams
        assert len(row["seconds"]) >= 2 and all(s > 0 for s in row["seconds"])
        assert row["receiver_rss_bytes"] >= row["state_bytes"]  # the buddy holds at least one copy


def test_loopback_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _run_cli(tmp_path, "--size", "8MiB", "--repeat", "2", "--no-links", "--security")
    summary = doc["summary"]
    assert list(summary) == [*LOOPBACK_KEYS, "curve_GBps", "members_GBps"]
    assert summary["curve_GBps"] > 1e-3 and summary["members_GBps"] > 1e-3
    runs = [r["run"] for r in doc["results"]]
    assert "loopback sidecar, curve" in runs and "loopback sidecar, members" in runs
    assert summary["state_bytes"] == SIZE
    assert summary["sidecar_GBps"] > 1e-3 and summary["raw_socket_GBps"] > 1e-3
    assert summary["loopback_ratio"] == pytest.approx(summary["sidecar_GBps"] / summary["raw_socket_GBps"])
    (raw,) = [
        r for r in doc["results"] if r["run"] == "loopback raw socket"
    ]  # run before and after the sidecars
    assert raw["stream_Bps"] == pytest.approx((raw["raw_before_Bps"] + raw["raw_after_Bps"]) / 2)
    assert raw["stream_Bps"] == pytest.approx(summary["raw_socket_GBps"] * 1e9)
    # the buddy holds a few 8 MiB snapshots; far from 1 GiB unless it leaks
    assert SIZE <= summary["sidecar_rss_bytes"] < 1 << 30
    assert doc["config"]["links"] == "disabled by --no-links"
    _check_sidecar_rows(doc)
    assert "shaped links skipped: disabled by --no-links" in capsys.readouterr().err


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        transport.run(_args("--size", "6", "--no-links"))
    with pytest.raises(ValueError, match=">= 1"):
        transport.run(_args("--repeat", "0", "--no-links"))
