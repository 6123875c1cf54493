"""One recovery story, held by the in-memory deployment and by real processes alike (a contract test).

Two ranks of a job (rank 0 on node A, rank 1 on node B) snapshot four steps; both crash, node B is lost with
its sidecar, a replacement node C starts, and both ranks restart and restore: rank 0 from A's own memory,
rank 1 from the copy its buddy A held. Each restored state equals the one snapshotted last, bit for bit. The
story runs on :class:`~tests.deployments.InProcess` (coordinator, sidecars and ranks in this process, over the
in-memory transport: fast, and deterministic where it waits) and on :class:`~tests.deployments.Processes`
(``snapshotd`` processes over ZeroMQ).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from snapshotd.client import Snapshotter

from .deployments import Deployment, InProcess, Processes, restore_all, snapshot_then_crash

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STEPS = 4


def _state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(50_000, generator=gen), "loop": {"step": step, "note": f"rank {rank}"}}


def recovery_story(dep: Deployment) -> None:
    job = f"contract-{uuid.uuid4().hex[:6]}"
    nodes = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
    snapshot_then_crash(nodes, job, STEPS, _state)

    dep.lose_node("B")
    dep.wait_dead("B")
    nodes[1] = dep.start_sidecar("C")
    restored = [{"w": torch.zeros(50_000), "loop": {}} for _ in (0, 1)]
    snaps = [
        Snapshotter(restored[r], job=job, rank=r, world_size=2, sidecar=nodes[r], timeout=10) for r in (0, 1)
    ]
    try:
        assert restore_all(snaps) == [STEPS, STEPS]
        assert snaps[0].restored["source"] == "local"
        assert snaps[1].restored["source"] in ("replica", "pull")
        for r in (0, 1):
            expected = _state(r, STEPS)
            assert torch.equal(restored[r]["w"], expected["w"])
            assert restored[r]["loop"] == {"step": STEPS, "note": f"rank {r}"}
    finally:
        for s in snaps:
            s.close()


def test_recovery_in_process_over_the_in_memory_transport() -> None:
    with InProcess() as dep:
        recovery_story(dep)


def test_recovery_with_real_processes(tmp_path) -> None:
    with Processes(str(tmp_path)) as dep:
        recovery_story(dep)
