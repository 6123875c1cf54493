"""snapshotd.bench.report (table, summary, JSON, PNG, progress) and the snapshotd-bench CLI."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest

from snapshotd.bench import cli
from snapshotd.bench.report import Report, emit, format_table, machine_info, progress

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _report(**kw: object) -> Report:
    fields: dict = {
        "bench": "demo",
        "config": {"size_bytes": 1 << 20},
        "results": [
            {"chunk_bytes": 1 << 20, "rate_Bps": 1.5e9, "step_s": 0.25, "lag_ms": 3.0, "codec": "raw"},
            {"chunk_bytes": 4 << 20, "rate_Bps": 2.5e9, "step_s": 0.5, "lag_ms": 1.5, "codec": "lz4"},
        ],
        "summary": {"best_Bps": 2.5e9, "speedup": 1.6667},
        "machine": {"hostname": "test"},
    }
    fields.update(kw)
    return Report(**fields)


def test_machine_info_has_the_documented_keys() -> None:
    info = machine_info()
    assert {"hostname", "cpu", "cores", "memory_bytes", "python", "torch", "cuda_device", "kernel"} <= set(
        info
    )
    assert info["cores"] >= 1 and info["memory_bytes"] > 0
    assert info["torch"]  # torch is installed in this environment
    assert Report("x", {}, [], {}).machine["hostname"] == info["hostname"]


def test_emit_prints_table_in_human_units_and_summary(tmp_path) -> None:
    out = io.StringIO()
    emit(_report(), json_path=None, plot_path=None, out=out)
    text = out.getvalue()
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("chunk_bytes"))
    assert header.split() == ["chunk_bytes", "rate_Bps", "step_s", "lag_ms", "codec"]
    assert "1.00 MiB" in text and "4.00 MiB" in text
    assert "1.50 GB/s" in text and "250.0 ms" in text and "3.0 ms" in text
    assert "best_Bps: 2.50 GB/s" in lines and "speedup: 1.667" in lines
    assert lines.index("best_Bps: 2.50 GB/s") > lines.index(header)  # summary after the table


def test_emit_uses_explicit_columns_and_fills_missing_cells() -> None:
    out = io.StringIO()
    report = _report(results=[{"a": 1, "b": None}, {"a": 2, "c": "x"}], columns=["c", "a"])
    emit(report, json_path=None, plot_path=None, out=out)
    lines = out.getvalue().splitlines()
    assert lines[1].split() == ["c", "a"]
    assert lines[3].split() == ["1"] and lines[4].split() == ["x", "2"]


def test_emit_writes_json_with_required_keys(tmp_path) -> None:
    path = tmp_path / "r.json"
    report = _report(summary={"best_Bps": 2.5e9, "nan": float("nan")})
    emit(report, json_path=str(path), plot_path=None, out=io.StringIO())
    doc = json.loads(path.read_text())
    assert set(doc) == {"bench", "machine", "config", "results", "summary"}
    assert doc["bench"] == "demo" and doc["results"] == report.results
    assert doc["summary"] == {"best_Bps": 2.5e9, "nan": None}  # strict JSON: no NaN literal
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


@pytest.mark.parametrize(
    "results",
    [
        pytest.param(None, id="results-vs-first-column"),
        pytest.param([], id="summary-bars"),
        pytest.param([{"name": "a"}], id="nothing-numeric"),
    ],
)
def test_emit_writes_default_png(tmp_path, results) -> None:
    path = tmp_path / "r.png"
    report = _report() if results is None else _report(results=results)
    if results == [{"name": "a"}]:
        report.summary = {}
    emit(report, json_path=None, plot_path=str(path), out=io.StringIO())
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF"), (".PNG", PNG_MAGIC)])
def test_the_plot_s_format_is_the_one_its_file_name_asks_for(tmp_path, suffix: str, magic: bytes) -> None:
    path = tmp_path / f"r{suffix}"
    emit(_report(), json_path=None, plot_path=str(path), out=io.StringIO())
    assert path.read_bytes().startswith(magic)


def test_the_recovery_benchmarks_draw_their_phases_stacked_with_the_total(tmp_path) -> None:
    from snapshotd.bench import live, torchrun_trial

    rows = [
        {"mode": m, "ranks_per_node": 2, "detection_seconds": 0.2, "group_seconds": g, "restore_seconds": 0.05,
         "first_step_seconds": 0.07, "total_seconds": 0.32 + g}
        for m, g in (("restart", 5.5), ("shrink", 0.2))
    ]  # fmt: skip
    live.plot(_report(bench="live", results=rows), str(tmp_path / "live.svg"))
    drawn = (tmp_path / "live.svg").read_text()
    assert all(
        word in drawn for word in ("restart, 2 ranks/node", "detection", "first step", "5.82 s", "0.52 s")
    )
    split = dict.fromkeys(torchrun_trial._SPLIT_COLUMNS, 0.5)
    torchrun_trial.plot(_report(bench="torchrun", results=[{"run": 1, **split}]), str(tmp_path / "t.svg"))
    assert "3.00 s" in (tmp_path / "t.svg").read_text()  # the launcher's path: six phases of 0.5 s


def test_a_plot_named_in_no_known_format_is_refused_before_the_run(capsys) -> None:
    assert cli.main(["codec", "--plot", "out.jpg"]) == 2
    assert "name a .png, .svg or .pdf file" in capsys.readouterr().err


def test_emit_calls_plot_fn(tmp_path) -> None:
    seen = []
    emit(
        _report(),
        json_path=None,
        plot_path=str(tmp_path / "p.png"),
        plot_fn=lambda r, p: seen.append((r.bench, p)),
        out=io.StringIO(),
    )
    assert seen == [("demo", str(tmp_path / "p.png"))]


def test_the_table_is_plain_text_with_a_dashed_rule_under_the_header() -> None:
    lines = format_table(_report()).splitlines()
    assert lines == [
        "chunk_bytes    rate_Bps     step_s   lag_ms   codec",
        "------------ ----------- ---------- -------- ------",
        "   1.00 MiB   1.50 GB/s   250.0 ms   3.0 ms   raw",
        "   4.00 MiB   2.50 GB/s   500.0 ms   1.5 ms   lz4",
    ]
    # no colour, no trailing blanks off a tty
    assert all(ln == ln.rstrip() and "\x1b" not in ln for ln in lines)


def test_progress_off_a_tty_prints_its_final_state_once() -> None:
    stream = io.StringIO()
    with progress(unit="bytes", stream=stream) as bar:
        task = bar.add_task("pull", total=100 << 20)
        for _ in range(100):
            bar.advance(task, 1 << 20)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "\x1b" not in lines[0]
    assert lines[0].startswith("pull ") and "100% 100.00 MiB/100.00 MiB" in lines[0] and "/s" in lines[0]


def test_progress_of_items_counts_them() -> None:
    stream = io.StringIO()
    with progress(unit="steps", stream=stream) as bar:
        task = bar.add_task("overhead steps", total=10)
        bar.update(task, completed=5)
    assert "5/10 steps" in stream.getvalue() and "steps/s" in stream.getvalue()


def test_progress_on_a_tty_redraws_one_line() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    with progress(stream=stream, auto_refresh=False) as bar:
        task = bar.add_task("items", total=10)
        for _ in range(10):
            bar.update(task, advance=1, refresh=True)
    text = stream.getvalue()
    assert text.count("\r") >= 10 and text.count("\n") == 1
    assert "10/10 items" in text


def test_cli_help_lists_every_subcommand(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, help_) in cli.SUBCOMMANDS.items():
        assert f"{name:<10} {help_}" in out


def test_cli_module_runs_with_python_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "snapshotd.bench.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "transport" in proc.stdout


def test_cli_unbuilt_subcommand_returns_2(monkeypatch, capsys) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "nosuch", ("snapshotd.bench.nosuch_bench_module", "not a module"))
    assert cli.main(["nosuch", "--json", "x.json"]) == 2
    assert capsys.readouterr().err.strip() == "snapshotd-bench nosuch: not built yet"


def test_cli_unknown_subcommand_returns_2(capsys) -> None:
    assert cli.main(["bogus"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_runs_a_subcommand_and_emits(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "fake_bench_for_cli_test.py").write_text(
        textwrap.dedent("""
        from snapshotd.bench.report import Report

        def add_arguments(parser):
            parser.add_argument("--size", type=int, default=3)

        def run(args):
            rows = [{"n": i, "time_s": 0.1 * (i + 1)} for i in range(args.size)]
            return Report("fake", {"size": args.size}, rows, {"total_s": 0.6}, machine={"hostname": "h"})
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("fake_bench_for_cli_test", "a fake benchmark"))
    json_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    assert cli.main(["fake", "--size", "4", "--json", str(json_path), "--plot", str(png_path)]) == 0
    out = capsys.readouterr().out
    assert "total_s: 600.0 ms" in out
    doc = json.loads(json_path.read_text())
    assert doc["config"] == {"size": 4} and len(doc["results"]) == 4
    assert png_path.read_bytes()[:8] == PNG_MAGIC
