"""The torchrun trial's parts that need no torchrun job: logs, outcomes, a node's processes, the store.

The trial itself (two torchrun agents, a node loss, a replacement) runs in
``tests/integration/test_torchrun.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from snapshotd.bench import cli
from snapshotd.bench.nodes import MARKER, AgentLine, RendezvousStore, marked_processes, node_processes
from snapshotd.bench.torchrun_trial import (
    EXAMPLE_DIR,
    TrialConfig,
    _coordinator_dead_at,
    _is_host,
    compare,
    read_outcome,
)


def test_the_subcommand_is_listed_with_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["torchrun", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--runs",
        "--kill-after",
        "--rdzv-conf",
        "--share-store",
        "--store-on-node",
        "--replacement-first",
    ):
        assert flag in out


def test_agent_line_parses_torch_log_lines_in_local_time() -> None:
    line = (
        "I1125 04:45:52.370000 8456 torch/distributed/elastic/agent/server/api.py:942] [default] Worker "
        "group FAILED. 3/3 attempts left; will restart worker group"
    )
    parsed = AgentLine.parse(line, 2026)
    assert parsed is not None and parsed.level == "I"
    assert parsed.message.endswith("will restart worker group")
    assert parsed.t == datetime.datetime(2026, 11, 25, 4, 45, 52, 370000).timestamp()
    assert AgentLine.parse("[rank0]: Traceback (most recent call last):", 2026) is None


def test_coordinator_dead_at_reads_the_declaring_line(tmp_path: Path) -> None:
    log = tmp_path / "coordinator.log"
    log.write_text(
        "2026-11-25 04:50:10,187 snapshotd.coordinator.state WARNING node B1-x missed heartbeats "
        "for 1.5 s: declared dead\n"
    )
    expected = datetime.datetime(2026, 11, 25, 4, 50, 10, 187000).timestamp()
    assert _coordinator_dead_at(str(log), "B1-x") == expected
    assert _coordinator_dead_at(str(log), "B1") is None
    assert _coordinator_dead_at(str(tmp_path / "missing.log"), "B1-x") is None


def test_is_host_replaces_the_setting() -> None:
    assert _is_host("is_host=false,read_timeout=60", True) == "read_timeout=60,is_host=true"
    assert _is_host("", False) == "is_host=false"


def test_trial_config_checks_its_values_and_orders_the_replacement() -> None:
    cfg = TrialConfig()
    assert [cfg.node_addr(i) for i in range(3)] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert TrialConfig(replacement_first=True).node_addr(2) == "127.0.0.1"
    for bad in (
        {"nodes": 1},
        {"kill_after": 0},
        {"kill_after": 16},
        {"lose": 2},
        {"store_on": 5},
        {"max_restarts": 0},
        {"step_delay": -1.0},
    ):
        with pytest.raises(ValueError):
            TrialConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        TrialConfig(example_dir="/nonexistent")
    assert (EXAMPLE_DIR / "train.py").is_file()


Run = tuple[int, float, list[tuple[int, float]], str | None]


def _write_run(out: Path, rank: int, runs: list[Run]) -> None:
    """Per process of ``rank``: (pid, start time, [(step, loss) or (step, loss, stride)], restored source, None
    for a fresh start)."""
    out.mkdir(exist_ok=True)
    losses_path, events_path = out / f"losses-rank{rank}.jsonl", out / f"events-rank{rank}.jsonl"
    with open(losses_path, "a") as losses, open(events_path, "a") as e:
        for pid, t, steps, source in runs:
            first = steps[0][0] - 1
            e.write(json.dumps({"event": "start", "t": t, "pid": pid}) + "\n")
            e.write(
                json.dumps(
                    {"event": "restored", "t": t + 1, "pid": pid, "step": first, "source": source or "fresh"}
                )
                + "\n"
            )
            for i, (step, loss, *stride) in enumerate(steps):
                line = {"step": step, "loss": loss, "t": t + 2 + i, "pid": pid}
                losses.write(json.dumps({**line, "stride": stride[0]} if stride else line) + "\n")
    (out / f"final-rank{rank}.json").write_text(json.dumps({"digest": "d", "state_digest": "s"}))


def test_read_outcome_and_compare(tmp_path: Path) -> None:
    ref, trial = tmp_path / "ref", tmp_path / "trial"
    for rank in range(2):
        _write_run(ref, rank, [(10 + rank, 100.0, [(1, 3.0), (2, 2.5), (3, 2.0), (4, 1.5)], None)])
    # rank 0 reached step 3 before the kill at t=105 and re-ran step 3 after restoring step 2; rank 1 reached
    # 2. Rank 0's stride was 2 at its last step before the kill (4 earlier); rank 1 logged none before it, and
    # its restarted process's wider stride comes after the loss
    _write_run(
        trial,
        0,
        [
            (20, 100.0, [(1, 3.0, 4), (2, 2.5, 2), (3, 2.0, 2)], None),
            (30, 110.0, [(3, 2.0), (4, 1.5)], "local"),
        ],
    )
    _write_run(
        trial, 1, [(21, 100.0, [(1, 3.0), (2, 2.5)], None), (31, 110.0, [(3, 2.0, 8), (4, 1.25, 8)], "pull")]
    )
    reference = read_outcome(str(ref), 2, "ref", {}, None)
    assert reference.stride_at_loss is None  # no failure: no loss to bound
    result = read_outcome(str(trial), 2, "trial", {}, killed_at=105.0)
    assert result.reached == 3 and result.steps_lost == 1 and result.stride_at_loss == 2
    assert {r: e["source"] for r, e in result.restored.items()} == {0: "local", 1: "pull"}
    assert result.losses[0] == {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.5} and not any(result.rerun_mismatches.values())
    same = compare(reference, result)
    assert not same["losses_identical"] and same["first_difference"] == (1, 4)
    assert same["digests_equal"] and same["states_equal"] and same["reruns_identical"]


def test_node_processes_follow_the_marker(tmp_path: Path) -> None:
    marker = f"test-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, MARKER: marker}
    argv = [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        # until the child runs (exec'd), /proc shows the environment it was forked with: the test's, unmarked
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert marked_processes(marker, exact=True) == {child.pid}
        assert child.pid in marked_processes(marker[:-2])
        assert node_processes(None, marker) == {child.pid}
        assert os.getpid() in node_processes(os.getpid(), "no-such-marker")  # a root and its descendants
    finally:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        assert child.wait(10) == 0
        child.stdout.close()
    assert not marked_processes(marker)


@pytest.mark.integration
def test_rendezvous_store_serves_on_its_own_address_and_stops_cleanly(tmp_path: Path) -> None:
    store = RendezvousStore(str(tmp_path), host="127.0.0.9")
    try:
        host, port = store.endpoint.rsplit(":", 1)
        assert host == "127.0.0.9"
        client = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("key", "value")
        assert client.get("key") == b"value"
        del client
    finally:
        assert store.stop() == 0
