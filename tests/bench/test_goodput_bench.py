"""snapshotd-bench goodput: the wasted-time model, its simulation, and its inputs from the other benchmarks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from snapshotd.bench import cli
from snapshotd.bench.goodput import DEFAULTS, Strategy, expected_ettr, load_inputs, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GB = 1e9


def _write(path: Path, doc: dict) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def recovery_json(tmp_path: Path) -> str:
    summary = {
        "state_bytes": 2 * GB,
        "detection_seconds": 2.0,
        "restore_seconds": 4.0,
        "restore_GBps": 0.5,
        "torch_load_seconds": 20.0,
    }
    return _write(tmp_path / "recovery.json", {"bench": "recovery", "summary": summary, "results": []})


@pytest.fixture
def overhead_json(tmp_path: Path) -> str:
    rows = [
        {"variant": "none", "interval": None, "step_median_ms": 100.0, "step_ms": [100.0, 100.0]},
        {"variant": "snapshotd", "interval": 1, "step_median_ms": 102.0, "step_ms": [102.0, 102.0]},
        {"variant": "torch_save", "interval": 2, "step_median_ms": 100.0, "step_ms": [100.0, 300.0]},
        {
            "variant": "torch_save",
            "interval": 4,
            "step_median_ms": 100.0,
            "step_ms": [100.0, 100.0, 100.0, 500.0],
        },
    ]
    summary = {"state_bytes_per_rank": 1 * GB, "step_ratio": 1.02, "torch_save_ratio": 1.0}
    return _write(tmp_path / "overhead.json", {"bench": "overhead", "summary": summary, "results": rows})


def test_inputs_come_from_the_files_and_say_so(recovery_json: str, overhead_json: str) -> None:
    values, sources = load_inputs(overhead_json, recovery_json)
    assert values["restore_seconds"] == 4.0 and sources["restore_seconds"] == recovery_json
    assert values["state_bytes"] == 2 * GB
    assert (
        values["snapshotd_overhead"] == pytest.approx(0.02) and sources["snapshotd_overhead"] == overhead_json
    )
    # smallest interval (2): mean 200 ms - 100 ms = 0.1 s per step, x 2 steps = 0.2 s per 1 GB checkpoint
    assert values["torch_save_Bps"] == pytest.approx(GB / 0.2)
    assert "dcp_async_Bps" not in values  # that overhead run had no dcp_async rows: no such strategy here
    assert sources["detection_seconds"] == recovery_json


def test_a_cost_is_the_larger_of_step_time_increase_and_blocked_time(tmp_path: Path) -> None:
    rows = [
        {"variant": "none", "step_median_ms": 100.0, "step_ms": [100.0, 110.0]},  # mean 105
        {
            "variant": "snapshotd",
            "interval": 1,
            "step_ms": [100.0, 104.0],
            "blocked_mean_ms": 10.5,
        },  # faster: noise
        {"variant": "dcp_async", "interval": 1, "step_ms": [130.0, 130.0], "blocked_mean_ms": 5.0},
    ]
    path = _write(
        tmp_path / "o.json", {"bench": "overhead", "summary": {"state_bytes_per_rank": GB}, "results": rows}
    )
    values, _ = load_inputs(path, None)
    # blocked time, as the step got no slower
    assert values["snapshotd_overhead"] == pytest.approx(10.5 / 105)
    assert values["dcp_async_Bps"] == pytest.approx(GB / 0.025)  # 25 ms slower steps > 5 ms blocked
    assert "torch_save_Bps" not in values


def test_inputs_default_without_files_and_reject_other_benchmarks(tmp_path: Path, recovery_json: str) -> None:
    values, sources = load_inputs(None, None)
    assert values == DEFAULTS and all(s.startswith("default") for s in sources.values())
    with pytest.raises(ValueError, match="not a snapshotd-bench overhead report"):
        load_inputs(recovery_json, None)


def test_a_report_without_checkpoints_is_a_clear_error(tmp_path: Path, recovery_json: str) -> None:
    rows = [
        {"variant": "none", "step_ms": [100.0]},
        {"variant": "snapshotd", "interval": 1, "step_ms": [101.0]},
    ]
    path = _write(
        tmp_path / "o.json", {"bench": "overhead", "summary": {"state_bytes_per_rank": GB}, "results": rows}
    )
    with pytest.raises(ValueError, match="nothing to compare snapshotd with"):
        cli.main(["goodput", "--overhead-json", path, "--recovery-json", recovery_json, "--trials", "2"])


def test_no_failures_leave_only_the_steady_overhead() -> None:
    snap = Strategy("s", recovery=10.0, overhead=0.25, step=1.0)
    ckpt = Strategy("c", recovery=10.0, interval=90.0, cost=10.0)
    none = np.array([math.inf])
    assert simulate(snap, none, 1000.0) == pytest.approx(0.8)
    assert simulate(ckpt, none, 1000.0) == pytest.approx(0.9)  # 10 cycles of 90 s useful + 10 s checkpoint
    assert expected_ettr(snap, 1e15) == pytest.approx(0.8)  # failures that never come
    assert expected_ettr(ckpt, 1e15) == pytest.approx(0.9)


def test_one_failure_costs_recovery_plus_lost_work() -> None:
    snap = Strategy("s", recovery=10.0, step=1.0)
    ckpt = Strategy("c", recovery=10.0, interval=90.0, cost=10.0)
    at = np.array([250.0])
    # snapshotd: 250 s done minus the 1 s step lost, 10 s recovering, then 740 s
    assert simulate(snap, at, 1000.0) == pytest.approx((249 + 740) / 1000)
    # checkpoint: 2 cycles kept (180 s useful), the 50 s since lost; then 740 s = 7 cycles (630) + 40 s to the end
    assert simulate(ckpt, at, 1000.0) == pytest.approx((180 + 630 + 40) / 1000)
    # a second failure during the recovery starts it over: 5 s more lost
    assert simulate(snap, np.array([250.0, 255.0]), 1000.0) == pytest.approx((249 + 735) / 1000)


def test_simulation_mean_agrees_with_the_closed_form() -> None:
    rng = np.random.default_rng(1)
    mtbf, horizon = 3600.0, 200 * 3600.0
    strategies = [
        Strategy("s", recovery=60.0, overhead=0.02, step=1.0),
        Strategy("c", recovery=120.0, interval=1800.0, cost=30.0),
    ]
    sims = np.array(
        [[simulate(s, np.cumsum(rng.exponential(mtbf, 600)), horizon) for s in strategies] for _ in range(20)]
    )
    for s, mean in zip(strategies, sims.mean(axis=0), strict=True):
        assert mean == pytest.approx(expected_ettr(s, mtbf), abs=0.005)


def test_goodput_bench_end_to_end(tmp_path: Path, recovery_json: str, overhead_json: str, capsys) -> None:
    out, png = tmp_path / "goodput.json", tmp_path / "goodput.png"
    code = cli.main(
        [
            "goodput",
            "--mtbf",
            "3h",
            "--hours",
            "72",
            "--ranks",
            "1024",
            "--trials",
            "50",
            "--intervals",
            "30min,1h",
            "--overhead-json",
            overhead_json,
            "--recovery-json",
            recovery_json,
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "128 nodes, job MTBF 3 h (= 384 h per node)" in printed and f"from {recovery_json}" in printed
    doc = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in doc["results"]}
    names = list(rows)
    assert names[0] == "snapshotd"
    assert names[1:] == [
        "torch_save every 93 s (Young)",
        "torch_save every 30 min",
        "torch_save every 60 min",
    ]
    young = rows["torch_save every 93 s (Young)"]  # checkpoint cost c = 2 GB / 5 GB/s = 0.4 s
    assert young["interval_seconds"] == pytest.approx(math.sqrt(2 * 0.4 * 3 * 3600))
    s = doc["summary"]
    assert s["failures_expected"] == pytest.approx(24)
    snap = rows["snapshotd"]
    assert snap["recovery_seconds"] == pytest.approx(2 + 60 + 4)  # detection + restart + restore
    assert snap["overhead"] == pytest.approx(0.02)
    for r in rows.values():
        assert 0 < r["ettr_sim_p5"] <= r["ettr_sim"] <= r["ettr_sim_p95"] <= 1
        assert r["ettr_sim"] == pytest.approx(r["ettr_expected"], abs=0.01)
    assert s["ettr_snapshotd"] == snap["ettr_sim"]
    assert s["ettr_best_checkpoint"] == max(r["ettr_sim"] for n, r in rows.items() if n != "snapshotd")
    assert s["ettr_gain"] == pytest.approx(s["ettr_snapshotd"] - s["ettr_best_checkpoint"])
    assert doc["config"]["inputs"]["torch_load_seconds"] == {"value": 20.0, "source": recovery_json}
    assert doc["config"]["node_mtbf_seconds"] == pytest.approx(128 * 3 * 3600)
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_storage_rate_slows_every_checkpoint_reload(
    recovery_json: str, overhead_json: str, tmp_path: Path
) -> None:
    out = tmp_path / "g.json"
    argv = [
        "goodput",
        "--trials",
        "2",
        "--intervals",
        "1h",
        "--overhead-json",
        overhead_json,
        "--recovery-json",
        recovery_json,
        "--storage-rate",
        "100GB/s",
        "--ranks",
        "1024",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    # 1024 ranks x 2 GB / 100 GB/s = 20.48 s > 20 s of local torch.load
    assert rows[1]["recovery_seconds"] == pytest.approx(2 + 60 + 20.48)
    assert rows[0]["recovery_seconds"] == pytest.approx(2 + 60 + 4)
