"""snapshotd-bench recovery: a real node loss and pull restore with a tiny state, beside torch.load."""

from __future__ import annotations

import importlib.util
import json

import pytest

from snapshotd.bench import cli
from snapshotd.bench.recovery import make_state, state_digest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "state_bytes",
    "detection_seconds",
    "restore_seconds",
    "restore_GBps",
    "torch_load_seconds",
    "raw_socket_GBps",
    "restore_vs_raw",
    "pull_vs_raw",
    "raw_state_GBps",
    "restore_vs_raw_state",
    "restore_cpu_seconds",
    "restore_busy_cores",
}


def test_make_state_is_deterministic_and_sized() -> None:
    a, b = make_state(4000, 3), make_state(4000, 3)
    assert [t.numel() for t in a] == [334, 333, 333]
    assert sum(t.numel() * t.element_size() for t in a) == 4000
    assert state_digest(a) == state_digest(b)
    assert state_digest(make_state(4000, 3, seed=1)) != state_digest(a)
    a[1][5] += 1.0
    assert state_digest(a) != state_digest(b)


@pytest.mark.parametrize(("size", "parts"), [(0, 1), (6, 1), (8, 3)])
def test_make_state_rejects_bad_sizes(size: int, parts: int) -> None:
    with pytest.raises(ValueError):
        make_state(size, parts)


@pytest.mark.integration
def test_recovery_bench_restores_a_tiny_state_from_buddies(tmp_path, capsys) -> None:
    out, png = tmp_path / "recovery.json", tmp_path / "recovery.png"
    code = cli.main(
        [
            "recovery",
            "--size",
            "8MiB",
            "--tensors",
            "2",
            "--interval",
            "10,100",
            "--step-seconds",
            "0.5",
            "--restart-seconds",
            "2",
            "--repeat",
            "2",
            "--timeout",
            "60",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    printed = capsys.readouterr()
    assert "== snapshotd-bench recovery ==" in printed.out
    doc = json.loads(out.read_text())
    assert doc["bench"] == "recovery" and {"machine", "config", "results"} <= set(doc)
    s = doc["summary"]
    assert set(s) >= SUMMARY_KEYS
    assert s["state_bytes"] == 8 << 20
    assert 0.5 < s["detection_seconds"] < 15  # heartbeat timeout 1.5 s
    assert s["re_replication_seconds"] >= s["detection_seconds"]
    assert s["restore_source"] == "pull"  # the replacement pulled; it held no copy
    assert 0 < s["pull_seconds"] <= s["restore_seconds"] < 30
    assert s["restore_GBps"] == pytest.approx(s["state_bytes"] / s["restore_seconds"] / 1e9)
    assert s["torch_load_seconds"] > 0
    assert s["raw_socket_GBps"] > 0
    assert s["restore_vs_raw"] == pytest.approx(s["restore_GBps"] / s["raw_socket_GBps"])
    assert s["pull_vs_raw"] >= s["restore_vs_raw"]  # the pull is the restore's share
    assert s["restore_vs_raw_state"] == pytest.approx(s["restore_GBps"] / s["raw_state_GBps"])
    parts = [s[f"restore_cpu_{p}_seconds"] for p in ("rank", "sidecar", "holders")]
    # in clock ticks: a tiny pull may take less than one
    assert min(parts) >= 0 and s["restore_cpu_seconds"] > 0
    assert s["restore_cpu_seconds"] == pytest.approx(sum(parts))
    assert s["restore_busy_cores"] == pytest.approx(s["restore_cpu_seconds"] / s["restore_seconds"])
    rows = {r["path"]: r for r in doc["results"]}
    assert rows["raw TCP socket, loopback"]["rate_Bps"] == pytest.approx(s["raw_socket_GBps"] * 1e9)
    assert rows["raw TCP socket, loopback, state to state"]["rate_Bps"] == pytest.approx(
        s["raw_state_GBps"] * 1e9
    )
    restore = rows["snapshotd restore (pull)"]
    assert restore["note"].startswith("8.00 MiB pulled from 2 live holders")
    assert "median of 2 (" in restore["note"] and doc["config"]["repeat"] == 2  # two replacement nodes pulled
    fixed = s["detection_seconds"] + 2
    assert rows["failure: snapshotd"]["wasted_seconds"] == pytest.approx(fixed + s["restore_seconds"] + 0.5)
    for n in (10, 100):
        row = rows[f"failure: checkpoint every {n}"]
        assert row["wasted_seconds"] == pytest.approx(fixed + s["torch_load_seconds"] + n / 2 * 0.5)
    if importlib.util.find_spec("torchft") is None:
        assert "torchft_seconds" not in s
        assert rows["torchft HTTPTransport"]["note"] == "torchft not installed; skipped"
        assert "torchft not installed; skipped" in printed.err
    else:
        assert s["torchft_seconds"] > 0
        assert s["torchft_ratio"] == pytest.approx(s["torchft_seconds"] / s["restore_seconds"])
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_recovery_bench_rejects_bad_arguments(capsys) -> None:
    assert cli.main(["recovery", "--interval", "0"]) == 2  # a usage error, before anything starts
    assert "positive integers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="multiple of 4"):
        cli.main(["recovery", "--size", "6"])
    with pytest.raises(ValueError, match="--repeat"):
        cli.main(["recovery", "--repeat", "0"])
