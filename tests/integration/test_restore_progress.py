"""``restore()`` shows its progress in the training process, where the user looks, and only there.

Three ranks snapshot two steps (rank 0 on node A, ranks 1 and 2 on node B); node A is lost and a replacement C
starts, in A's rack (so no copy of rank 0's is re-replicated to it: it never goes to the rank's own failure
domain). The ranks restart as real processes: rank 0 on C, its stderr a pseudo-terminal, pulls its step from B
and draws the restore (source, bytes, the bar); rank 1, on a terminal too but not its node's first local rank
(``LOCAL_RANK=1``), and rank 2, whose stderr is a pipe, draw nothing. The sidecars and the coordinator are real
processes (:class:`~tests.deployments.Processes`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
import uuid

import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.units import format_bytes

from ..deployments import Processes, restore_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORLD = 3
STEPS = 2
FLOATS = 1_000_000  # 4 MB a rank
TIMEOUT = 60.0

_RANK = """
import json, sys, torch
from snapshotd.client import Snapshotter
job, rank, sidecar = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = {"w": torch.zeros(int(sys.argv[4])), "loop": {}}
with Snapshotter(state, job=job, rank=rank, world_size=int(sys.argv[5]), sidecar=sidecar, timeout=10) as snap:
    step = snap.restore(timeout=30)
    print(json.dumps({"step": step, "source": snap.restored["source"], "w": float(state["w"][-1])}), flush=True)
"""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _state(rank: int, step: int) -> dict:
    return {"w": torch.full((FLOATS,), float(rank * 100 + step)), "loop": {"step": step}}


def _snapshot_then_crash(ipcs: dict[int, str], job: str) -> None:
    """Every rank starts fresh and snapshots steps 1..STEPS, each complete on its buddies, then crashes."""
    states = [_state(r, 0) for r in range(WORLD)]
    snaps = [
        Snapshotter(
            states[r], job=job, rank=r, world_size=WORLD, sidecar=ipcs[r], timeout=10, when_busy="block"
        )
        for r in range(WORLD)
    ]
    assert restore_all(snaps) == [0] * WORLD
    for step in range(1, STEPS + 1):
        for r, snap in enumerate(snaps):
            states[r]["w"].fill_(float(r * 100 + step))
            states[r]["loop"]["step"] = step
            assert snap.capture(step)
        assert all(s.wait(30) for s in snaps), [s.stats for s in snaps]
    for s in snaps:
        s.close(unregister=False)


def _pty(columns: int = 160) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) of ``columns`` columns."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    return master, slave


def _run_ranks(job: str, ipcs: dict[int, str]) -> tuple[list[dict], dict[int, str], str]:
    """Start the three ranks (see the module docstring) and read their terminals until they exit: their results,
    what each terminal showed (ANSI codes removed), and rank 2's stderr."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")
    }
    env["TERM"] = "xterm-256color"
    masters: dict[int, int] = {}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(WORLD):
            stderr: int
            if rank < 2:
                masters[rank], stderr = _pty()
            else:
                stderr = subprocess.PIPE
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _RANK, job, str(rank), ipcs[rank], str(FLOATS), str(WORLD)],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    env={**env, "LOCAL_RANK": "1"} if rank == 1 else env,
                )
            )
            if rank < 2:
                # the child holds the slave: reading the master ends (EIO) when the child exits
                os.close(stderr)
        shown = {rank: b"" for rank in masters}
        open_ = set(masters)
        deadline = time.monotonic() + TIMEOUT
        while open_:  # drain the terminals as the children draw (a full pty would block them)
            assert time.monotonic() < deadline, f"the ranks did not finish within {TIMEOUT:.0f} s"
            ready, _, _ = select.select([masters[r] for r in open_], [], [], 0.5)
            for rank in [r for r in open_ if masters[r] in ready]:
                try:
                    data = os.read(masters[rank], 65536)
                except OSError:  # EIO: every holder of the slave exited
                    data = b""
                if data:
                    shown[rank] += data
                else:
                    open_.discard(rank)
        results = []
        stderr2 = ""
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, (
                f"rank {rank} exited with {proc.returncode}: {err!r} {shown.get(rank)!r}"
            )
            results.append(json.loads(out))
            if rank == 2:
                stderr2 = err.decode()
        text = {rank: _ANSI.sub("", data.decode(errors="replace")) for rank, data in shown.items()}
        return results, text, stderr2
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for fd in masters.values():
            os.close(fd)


def test_restore_draws_its_progress_on_the_first_local_ranks_terminal_only(tmp_path) -> None:
    job = f"progress-{uuid.uuid4().hex[:6]}"
    with Processes(str(tmp_path)) as dep:
        cluster = dep.cluster

        def node(name: str, rack: str) -> str:
            cluster.start_sidecar(f"{name}-{dep.tag}", "--rack", rack)
            return cluster.ipc_path(f"{name}-{dep.tag}")

        a, b = node("A", "r1"), node("B", "r2")
        _snapshot_then_crash({0: a, 1: b, 2: b}, job)
        dep.lose_node("A")
        dep.wait_dead("A")
        c = node("C", "r1")
        results, shown, piped = _run_ranks(job, {0: c, 1: b, 2: b})
        sidecar_c = cluster.tail(cluster.sidecars[f"C-{dep.tag}"], 200)

    assert [r["step"] for r in results] == [STEPS] * WORLD
    assert [r["w"] for r in results] == [float(r * 100 + STEPS) for r in range(WORLD)]
    assert [r["source"] for r in results] == ["pull", "local", "local"]

    size = format_bytes(4 * FLOATS)
    drawn = shown[0]
    assert f"restore {job} rank 0 step {STEPS}: pull from tcp://127.0.0.1:" in drawn, drawn
    assert f"({size})" in drawn
    assert "waiting for the recovery plan" in drawn  # drawn while every rank had yet to ask
    final = [
        ln for ln in drawn.replace("\r", "\n").splitlines() if ln.startswith(f"restore rank 0 step {STEPS}")
    ]
    assert final and f"100% {size}/{size}" in final[-1] and "/s" in final[-1], drawn

    assert shown[1].strip() == "", shown[1]  # LOCAL_RANK=1: a terminal, but not the node's first rank
    assert "restore" not in piped and "\x1b" not in piped, piped  # not a terminal

    # the sidecar logs one line per restore, not a bar
    lines = [ln for ln in sidecar_c.splitlines() if f"job {job} restores step" in ln]
    assert len(lines) == 1 and f"rank 0 of job {job} restores step {STEPS}: pull from tcp://" in lines[0], (
        sidecar_c
    )
    assert size in lines[0] and "/s" in lines[0]
