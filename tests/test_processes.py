"""Warm starts: a process forked from a server that imported its modules once runs its module as a cold one would,
and its holder sees its pid, signals and exit code as ``Popen``'s."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotd.harness import processes as warm
from snapshotd.harness.processes import ForkedProcess, ForkServer
from snapshotd.shm import pid_alive

_PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "ppid": os.getppid(), "var": os.environ.get("SNAPSHOTD_PROBE"),
                  "preloaded": "csv" in sys.modules, "name": __name__}))
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
"""
"""A module that tells what it was started with: arguments, working directory, parent, environment, and whether
the server's preload (``csv``, which nothing here imports) is in it."""

pytestmark = pytest.mark.integration  # rank processes forked and started cold: the serial pass


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ForkServer]:
    # started elsewhere: its children take the caller's directory
    server = ForkServer(preload=("json", "csv"))
    (tmp_path / "probe_mod.py").write_text(_PROBE)
    # the probe is found as a cold ``python -m`` would find it: in the working directory
    monkeypatch.chdir(tmp_path)
    yield server
    server.close()


def _report(path: Path) -> dict[str, object]:
    return json.loads(path.read_text().splitlines()[-1])


def test_a_forked_start_runs_its_module_with_its_arguments_environment_output_input_and_exit_code(
    tmp_path: Path, server: ForkServer
) -> None:
    env = {**os.environ, "SNAPSHOTD_PROBE": "seen"}  # a variable read as it runs: still forked
    proc = server.popen("probe_mod", ["7", "x"], output=str(tmp_path / "probe.log"), env=env)
    assert isinstance(proc, ForkedProcess) and proc.pid != server.pid
    assert proc.wait(60) == 7 and proc.returncode == 7 and proc.poll() == 7
    report = _report(tmp_path / "probe.log")
    assert report == {
        "argv": ["7", "x"],
        "cwd": str(tmp_path),
        "ppid": server.pid,
        "var": "seen",
        "preloaded": True,
        "name": "__main__",
    }

    piped = server.popen("json.tool", [], output=str(tmp_path / "piped.log"), stdin=True)
    assert piped.stdin is not None
    piped.stdin.write(b'{"x": true}')
    piped.stdin.close()
    assert piped.wait(60) == 0 and json.loads((tmp_path / "piped.log").read_text()) == {"x": True}

    failed = server.popen("json.tool", [str(tmp_path / "missing.json")], output=str(tmp_path / "failed.log"))
    assert failed.wait(60) != 0 and "missing.json" in (tmp_path / "failed.log").read_text()


def test_signals_reach_the_forked_process_and_its_end_by_signal_is_its_exit_code(
    tmp_path: Path, server: ForkServer
) -> None:
    # waits for its input
    proc = server.popen("json.tool", [], output=str(tmp_path / "waiting.log"), stdin=True)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL and not pid_alive(proc.pid)
    proc.kill()  # once it has ended, as Popen's: nothing is signalled
    assert proc.stdin is not None
    proc.stdin.close()


def test_starts_from_many_threads_each_get_their_own_process(tmp_path: Path, server: ForkServer) -> None:
    def start(i: int) -> tuple[int, int]:
        proc = server.popen("probe_mod", [str(i)], output=str(tmp_path / f"p{i}.log"))
        return proc.pid, proc.wait(60)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(start, range(12)))
    assert [code for _, code in results] == list(range(12)) and len({pid for pid, _ in results}) == 12
    assert [_report(tmp_path / f"p{i}.log")["argv"] for i in range(12)] == [[str(i)] for i in range(12)]


def test_an_interpreter_setting_that_differs_starts_cold_and_a_closed_server_refuses(
    tmp_path: Path, server: ForkServer
) -> None:
    # read as the interpreter starts: the server has its own
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
    }
    proc = server.popen("probe_mod", [], output=str(tmp_path / "cold.log"), env=env)
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert _report(tmp_path / "cold.log")["ppid"] == os.getpid()

    running = server.popen("json.tool", [], output=str(tmp_path / "running.log"), stdin=True)
    server.close()
    assert not pid_alive(server.pid)
    assert pid_alive(running.pid)  # the processes it started run on; their exit status is lost with it
    with pytest.raises(RuntimeError, match="status is lost"):
        running.wait(10)
    running.kill()
    assert running.stdin is not None
    running.stdin.close()
    with pytest.raises(RuntimeError, match="closed"):
        server.popen("probe_mod", [], output=str(tmp_path / "never.log"))


def test_a_failed_preload_is_told_in_the_program_output_and_the_program_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "probe_mod.py").write_text(_PROBE)
    monkeypatch.chdir(tmp_path)
    server = ForkServer(preload=("csv", "no_such_module_here"))
    try:
        proc = server.popen("probe_mod", [], output=str(tmp_path / "probe.log"))
        assert proc.wait(60) == 0
    finally:
        server.close()
    text = (tmp_path / "probe.log").read_text()
    assert "a preload failed" in text and "no_such_module_here" in text
    assert _report(tmp_path / "probe.log")["ppid"] == server.pid


def test_a_request_that_gives_up_leaves_no_process_behind_and_the_next_gets_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(1.0)\n")
    (tmp_path / "probe_mod.py").write_text(_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    server = ForkServer(preload=("slow_preload",))  # answers its first request a second from now
    try:
        monkeypatch.setattr(warm, "_REPLY_TIMEOUT", 0.1)
        with pytest.raises(RuntimeError, match="did not start"):
            server.popen("probe_mod", ["5"], output=str(tmp_path / "given-up.log"))
        monkeypatch.setattr(warm, "_REPLY_TIMEOUT", 60.0)
        proc = server.popen("probe_mod", ["3"], output=str(tmp_path / "own.log"))
        assert proc.wait(60) == 3 and _report(tmp_path / "own.log")["argv"] == ["3"]  # not the one given up
        # the process started for the request that gave up was killed: the server has no child left
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children")
        deadline = time.monotonic() + 30
        while children.read_text().split():
            assert time.monotonic() < deadline, f"the server still has children: {children.read_text()}"
            time.sleep(0.05)
    finally:
        server.close()
