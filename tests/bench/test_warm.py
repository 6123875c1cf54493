"""Warm starts: a process started from an interpreter waiting with torch imported runs its module as a cold one."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotd.bench.warm import WarmPool
from snapshotd.shm import pid_alive


@pytest.fixture
def pool() -> Iterator[WarmPool]:
    pool = WarmPool(1, preload=("json",))
    yield pool
    pool.close()


def test_a_warm_start_runs_its_module_with_its_arguments_output_input_and_exit_code(tmp_path: Path,
                                                                                   pool: WarmPool) -> None:  # fmt: skip
    source = tmp_path / "in.json"
    source.write_text('{"b": 1, "a": [2]}')
    waiting = pool.pids
    proc = pool.popen("json.tool", ["--sort-keys", str(source)], output=str(tmp_path / "sorted.log"))
    assert proc.pid == waiting[0] and pool.pids != waiting  # the waiting one became it, another waits now
    assert proc.wait(60) == 0
    assert json.loads((tmp_path / "sorted.log").read_text()) == {"a": [2], "b": 1}

    piped = pool.popen("json.tool", [], output=str(tmp_path / "piped.log"), stdin=True)
    assert piped.stdin is not None
    piped.stdin.write(b'{"x": true}')
    piped.stdin.close()
    assert piped.wait(60) == 0 and json.loads((tmp_path / "piped.log").read_text()) == {"x": True}

    failed = pool.popen("json.tool", [str(tmp_path / "missing.json")], output=str(tmp_path / "failed.log"))
    assert failed.wait(60) != 0 and "missing.json" in (tmp_path / "failed.log").read_text()


def test_an_interpreter_setting_that_differs_starts_cold_and_a_closed_pool_ends_its_waiting_ones(
    tmp_path: Path, pool: WarmPool
) -> None:
    (tmp_path / "hello_warm.py").write_text("print('hello from', __name__)\n")
    waiting = pool.pids
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # read as the interpreter starts: a warm one has its own
    proc = pool.popen("hello_warm", [], output=str(tmp_path / "hello.log"), env=env)
    assert proc.wait(60) == 0 and (tmp_path / "hello.log").read_text() == "hello from __main__\n"
    assert pool.pids == waiting and proc.pid not in waiting
    pool.close()
    assert not [pid for pid in waiting if pid_alive(pid)]
    with pytest.raises(RuntimeError, match="closed"):
        pool.popen("json.tool", [], output=str(tmp_path / "never.log"))
