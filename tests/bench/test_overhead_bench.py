"""``snapshotd-bench overhead`` at tiny sizes: real gloo ranks, two real sidecars, every variant, one round."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapshotd.bench import overhead, sidecars
from snapshotd.bench.report import Report, emit
from snapshotd.harness.ranks import run_ranks
from snapshotd.harness.workloads import config_for_params

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_PARAMS = 30_000
TINY_RUN = (
    "--params",
    str(TINY_PARAMS),
    "--steps",
    "5",
    "--warmup",
    "1",
    "--rounds",
    "1",
    "--ranks",
    "2",
    "--batch",
    "1",
)
"""The smallest run that measures anything: a tiny model, one round of five steps, two ranks of one sequence."""
SUMMARY_KEYS = {
    "scenario",
    "state_bytes_per_rank",
    "step_ratio",
    "mean_ratio",
    "capture_ms_median",
    "fence_ms_median",
    "snapshots_durable",
    "snapshots_skipped",
    "torch_save_ratio",
    "dcp_async_ratio",
    "minimum_cpu_ms",
    "minimum_copy_ms",
    "minimum_wire_ms",
    "checksum_ms",
    "copy_Bps",
}
SCENARIO_KEYS = (
    "step_ratio",
    "mean_ratio",
    "skipped",
    "cpu_ms_per_snapshot",
    "cpu_vs_minimum",
    "rank_cpu_ms_per_snapshot",
    "sidecar_user_ms_per_snapshot",
    "sidecar_system_ms_per_snapshot",
    "staging_Bps",
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    workdir = tmp_path_factory.mktemp("overhead")
    args = _args(
        *TINY_RUN,
        "--scenario",
        "headroom",
        "--workdir",
        str(workdir),
        "--timeout",
        "90",
    )
    return overhead.run(args)


def test_summary_has_exactly_the_documented_keys(report: Report) -> None:
    assert set(report.summary) == SUMMARY_KEYS | {f"headroom_{key}" for key in SCENARIO_KEYS}
    assert report.summary["scenario"] == "headroom"
    assert report.summary["headroom_step_ratio"] > 0 and report.summary["headroom_mean_ratio"] > 0
    assert report.summary["headroom_skipped"] >= 0
    # a snapshot costs at least about the physical minimum measured beside it: a memcpy and the kernel's copies
    assert report.summary["headroom_cpu_vs_minimum"] > 0.5
    assert report.summary["minimum_cpu_ms"] > 0
    # where the time goes: its parts add up, and each is measured
    summary = report.summary
    parts = ("rank_cpu_ms_per_snapshot", "sidecar_user_ms_per_snapshot", "sidecar_system_ms_per_snapshot")
    assert sum(summary[f"headroom_{part}"] for part in parts) == pytest.approx(
        summary["headroom_cpu_ms_per_snapshot"]
    )
    # /proc counts in clock ticks: a part may read 0
    assert all(summary[f"headroom_{part}"] >= 0 for part in parts)
    assert summary["minimum_copy_ms"] + summary["minimum_wire_ms"] == pytest.approx(summary["minimum_cpu_ms"])
    assert summary["checksum_ms"] > 0 and summary["copy_Bps"] > 0 and summary["headroom_staging_Bps"] > 0
    cfg = config_for_params(TINY_PARAMS)
    # fp32 parameters + AdamW exp_avg + exp_avg_sq, the tied embedding twice (the model's state dict holds it
    # under both names), one 4-byte step counter per parameter tensor
    tied = 4 * cfg.vocab * cfg.d_model
    assert (
        12 * cfg.n_params + tied <= report.summary["state_bytes_per_rank"] < 12 * cfg.n_params + tied + 4096
    )
    for key in ("step_ratio", "torch_save_ratio", "dcp_async_ratio", "capture_ms_median"):
        assert report.summary[key] > 0, key
    assert report.summary["fence_ms_median"] >= 0
    assert report.summary["snapshots_durable"] > 0  # node A really streamed to node B
    assert report.summary["snapshots_skipped"] >= 0


def test_one_row_per_variant_with_consistent_figures(report: Report) -> None:
    assert [(r["scenario"], r["variant"]) for r in report.results] == [
        ("headroom", v) for v in overhead.VARIANTS
    ]
    rows = {r["variant"]: r for r in report.results}
    assert rows["snapshotd"]["mean_ratio"] == report.summary["headroom_mean_ratio"]
    assert rows["none"]["step_ratio"] == 1.0
    assert rows["none"]["moved_per_step_bytes"] == 0 and rows["none"]["completed_every"] is None
    assert rows["snapshotd"]["step_ratio"] == report.summary["step_ratio"]
    assert rows["torch_save"]["step_ratio"] == report.summary["torch_save_ratio"]
    assert rows["dcp_async"]["step_ratio"] == report.summary["dcp_async_ratio"]
    state = report.summary["state_bytes_per_rank"]
    for name in ("torch_save", "dcp_async"):  # interval 1: every step saved, and every save completed
        assert rows[name]["completed_every"] == pytest.approx(1.0)
        assert rows[name]["moved_per_step_bytes"] > 0.5 * state  # a whole replica reaches disk each step
    assert rows["snapshotd"]["completed_every"] >= 1.0
    assert rows["snapshotd"]["moved_per_step_bytes"] > 0
    for row in report.results:
        assert row["step_p99_ms"] >= row["step_median_ms"] > 0
        assert row["blocked_mean_ms"] >= 0
        assert len(row["step_ms"]) == 4  # 5 steps, 1 warmup, 1 run
    assert rows["none"]["blocked_mean_ms"] == 0


def test_report_prints_saves_and_draws(report: Report, tmp_path: Path) -> None:
    json_path, png_path = tmp_path / "o.json", tmp_path / "o.png"
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        emit(report, json_path=str(json_path), plot_path=str(png_path), plot_fn=overhead.plot, out=f)
    text = out.read_text()
    assert "snapshotd-bench overhead" in text and "dcp_async" in text and "step_ratio:" in text
    doc = json.loads(json_path.read_text())
    assert doc["bench"] == "overhead" and set(doc["summary"]) == set(report.summary)
    assert "node A" in doc["config"]["setup"]
    assert png_path.read_bytes().startswith(PNG_MAGIC)


def test_defaults_snapshot_at_least_100_mb_per_rank_in_both_scenarios() -> None:
    args = _args()
    assert args.scenario == "both" and args.variants == list(overhead.VARIANTS) and args.interval == [1]
    assert 12 * config_for_params(args.params).n_params >= 100e6
    saturated, headroom = overhead._shaped(args, "saturated"), overhead._shaped(args, "headroom")
    assert (saturated.ranks, saturated.threads) == (2, 1)
    assert headroom.threads == 1 and headroom.ranks == max(1, (os.cpu_count() or 2) // 2)


@pytest.mark.parametrize(
    "argv",
    [
        ["--variants", "snapshotd"],
        ["--variants", "none,bogus"],
        ["--interval", "0"],
        ["--interval", "x"],
        ["--max-rate", "fast"],
        ["--every", "0"],
        ["--every", "sometimes"],
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)


@pytest.mark.long  # its schedule's rules are unit-tested in tests/client/test_schedule.py
def test_every_auto_runs_its_own_schedule(tmp_path: Path) -> None:
    args = _args(
        *TINY_RUN,
        "--variants",
        "none,snapshotd",
        "--every",
        "auto",
        "--workdir",
        str(tmp_path),
        "--timeout",
        "90",
    )
    assert args.every == "auto" and args.scenario == "both"
    report = overhead.run(args)
    # both scenarios in one run, each with its rows and keys; the headline keys are headroom's
    assert [(r["scenario"], r["variant"]) for r in report.results] == [
        (s, v) for s in overhead.SCENARIOS for v in ("none", "snapshotd")
    ]
    assert set(report.summary) == SUMMARY_KEYS | {
        f"{s}_{k}" for s in overhead.SCENARIOS for k in SCENARIO_KEYS
    }
    saturated = next(
        r for r in report.results if r["scenario"] == "saturated" and r["variant"] == "snapshotd"
    )
    assert saturated["step_ratio"] == report.summary["saturated_step_ratio"]
    assert report.config["scenarios"]["saturated"]["ranks"] == 2
    (row,) = [r for r in report.results if r["variant"] == "snapshotd" and r["scenario"] == "headroom"]
    assert row["interval"] == 1 and report.config["every"] == "auto"
    assert report.summary["snapshots_durable"] >= 1  # the first step is always due


def test_warmup_must_leave_steps_to_measure() -> None:
    with pytest.raises(ValueError, match="warmup"):
        overhead.run(_args("--steps", "3", "--warmup", "3"))


def test_a_failing_rank_is_a_clear_error_with_its_log(tmp_path: Path) -> None:
    seen: list[int] = []
    with pytest.raises(RuntimeError, match=r"rank \d exited with 2:(.|\n)*--steps"):
        run_ranks(str(tmp_path), 2, ["--steps", "many"], timeout=60, on_progress=seen.append)
    assert all(n == 0 for n in seen)


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass  # it exited meanwhile
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_benchmark_and_every_process_it_started(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "snapshotd.bench.cli",
        "overhead",
        "--params",
        "200000",
        "--steps",
        "200",
        "--rounds",
        "1",
        "--variants",
        "none,snapshotd",
        "--scenario",
        "saturated",
        "--workdir",
        str(tmp_path / "work"),
    ]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        started: set[int] = set()
        while len(started) < 5:  # a coordinator, two sidecars and two ranks
            assert bench.poll() is None and time.monotonic() < deadline, (
                "the benchmark's processes never started"
            )
            # SIGTERM then often lands while the last rank starts, which once left it running
            time.sleep(0.002)
            started = {p for p in _descendants(bench.pid) if "python" in _exe(p)}
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    assert bench.returncode == 130, err.decode()[-2000:]
    assert b"interrupted" in err
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in started if _alive(p)] == []  # coordinator, sidecars and ranks all stopped


def test_the_node_scenario_reports_the_rate_the_node_sustains_and_its_cpu_per_gb(tmp_path: Path) -> None:
    args = _args(
        "--params",
        "100000",
        "--steps",
        "4",
        "--ranks",
        "2",
        "--scenario",
        "node",
        "--workdir",
        str(tmp_path),
        "--timeout",
        "90",
    )
    summary = overhead.run(args).summary
    assert summary["node_ranks"] == 2 and summary["node_state_bytes_per_rank"] == 1_200_000
    assert summary["node_durable_Bps"] > 0 and summary["node_raw_socket_Bps"] > 0
    assert summary["node_ratio"] == pytest.approx(
        summary["node_durable_Bps"] / summary["node_raw_socket_Bps"]
    )
    assert summary["node_sidecar_user_ms_per_GB"] >= 0 and summary["node_sidecar_system_ms_per_GB"] > 0


def test_the_ideal_scenario_prices_the_least_work_beside_training(tmp_path: Path) -> None:
    args = _args(*TINY_RUN, "--scenario", "ideal", "--workdir", str(tmp_path))
    report = overhead.run(args)
    summary = report.summary
    cfg = config_for_params(TINY_PARAMS)
    assert (
        12 * cfg.n_params <= summary["ideal_state_bytes"] < 12 * cfg.n_params + 4096
    )  # parameters, 2 moments
    assert summary["ideal_step_ratio"] > 0 and summary["ideal_mean_ratio"] > 0
    # /proc counts the pair's CPU in clock ticks, and a tiny transfer takes less than one: it may read below 0
    assert summary["ideal_cpu_ms_per_snapshot"] == pytest.approx(
        summary["ideal_rank_cpu_ms_per_snapshot"] + summary["ideal_pair_cpu_ms_per_snapshot"]
    )
    assert summary["minimum_cpu_ms"] > 0 and summary["ideal_vs_minimum"] == pytest.approx(
        summary["ideal_cpu_ms_per_snapshot"] / summary["minimum_cpu_ms"]
    )
    assert 0 <= summary["ideal_waited"] <= 4
    assert [(r["variant"], r["steps"]) for r in report.results] == [
        ("none", 4),
        ("ideal", 4),
    ]  # warmup left out
    assert all(r["step_median_s"] > 0 and r["rank_cpu_ms"] >= 0 for r in report.results)
    assert not list(tmp_path.rglob("ideal-arena"))  # the shared arena is gone


def test_the_sidecars_scenario_prices_their_work_against_the_floor_of_a_checked_transfer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it checks the report's arithmetic, not a figure: a short idle rate to subtract will do
    monkeypatch.setattr(sidecars, "IDLE_SECONDS", 0.2)
    args = _args(
        *TINY_RUN, "--scenario", "sidecars", "--steps", "2", "--rounds", "2", "--workdir", str(tmp_path)
    )
    report = overhead.run(args)
    summary = report.summary
    cfg = config_for_params(TINY_PARAMS)
    assert 12 * cfg.n_params <= summary["sidecars_state_bytes"] < 12 * cfg.n_params + 4096
    assert (summary["sidecars_started"], summary["sidecars_skipped"], summary["sidecars_failed"]) == (4, 0, 0)
    assert [(r["block"], r["snapshots"]) for r in report.results] == [(0, 2), (1, 2)]  # rounds x steps
    assert all(rate >= 0 for rate in summary["sidecars_idle_cores"])
    for row in report.results:  # /proc counts in clock ticks: a tiny snapshot's share may read below 0
        assert row["cpu_ms"] == pytest.approx(row["user_ms"] + row["system_ms"])
    assert summary["sidecars_floor_ms"] == pytest.approx(
        summary["minimum_wire_ms"] + 2 * summary["checksum_ms"]
    )
    assert summary["sidecars_vs_floor"] == pytest.approx(
        summary["sidecars_cpu_ms_per_snapshot"] / summary["sidecars_floor_ms"]
    )
