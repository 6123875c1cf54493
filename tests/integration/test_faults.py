"""Network faults on the data and control planes: messages dropped, duplicated, delayed and reordered.

Each story runs a coordinator and three sidecars in this process with every daemon's network interposed
(:mod:`snapshotd.bench.faults`), so that every message either daemon sends on either plane may meet the fault.
Two ranks (0 on node A, 1 on node B) snapshot several steps and crash; node B dies; both ranks restart (rank 1 on
node C) and restore. Whatever the faults did, both ranks restore the same step bit for bit, or fail with a named
error: never a torn or mixed step. Duplicates, delays and reordering must cost nothing at all: every step becomes
durable. A dropped message costs the stream or request it belongs to (the daemons rely on their connection not
losing messages; a lost one is waited out, never mistaken).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from snapshotd.bench.faults import FaultPlan, FaultyNetwork, install
from snapshotd.client import SnapshotdError, Snapshotter

from ..deployments import InProcess, restore_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 5
FLOATS = 60_000  # 240 KB: 15 chunks of 16 KiB per snapshot


def _state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(FLOATS, generator=gen), "loop": {"step": step}}


def _train_and_crash(ipcs: dict[int, str], job: str) -> list[Snapshotter]:
    states = [_state(r, 0) for r in (0, 1)]
    snaps = [
        Snapshotter(states[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=5, when_busy="block")
        for r in (0, 1)
    ]
    fresh = restore_all(snaps, timeout=30)
    assert fresh == [0, 0], fresh
    for step in range(1, STEPS + 1):
        for r in (0, 1):
            now = _state(r, step)
            states[r]["w"].copy_(now["w"])
            states[r]["loop"].update(now["loop"])
            snaps[r].capture(step)
        for s in snaps:
            s.wait(5)
    for s in snaps:
        s.close(unregister=False)
    return snaps


@pytest.mark.parametrize(
    ("fault", "rate"), [("duplicate", 0.1), ("delay", 0.1), ("reorder", 0.1), ("drop", 0.02)]
)
def test_a_restore_after_faults_on_both_planes_is_bit_identical_or_named(fault: str, rate: float) -> None:
    plan = FaultPlan(**{fault: rate}, max_delay=0.05, seed=7)
    networks: list[FaultyNetwork] = []
    job = f"{fault}-{uuid.uuid4().hex[:6]}"
    with install(plan, networks), InProcess(chunk_bytes=16384, request_timeout=1.0) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        ipc_c = dep.start_sidecar("C")
        first = _train_and_crash(ipcs, job)
        dep.lose_node("B")
        dep.wait_dead("B")
        restored = [{"w": torch.zeros(FLOATS), "loop": {}} for _ in (0, 1)]
        snaps = [
            Snapshotter(restored[0], job=job, rank=0, world_size=2, sidecar=ipcs[0], timeout=10),
            Snapshotter(restored[1], job=job, rank=1, world_size=2, sidecar=ipc_c, timeout=10),
        ]
        try:
            outcome = restore_all(snaps, timeout=60)
        finally:
            for s in snaps:
                s.close()
    injected = sum(net.faults.injected() for net in networks)
    assert injected > 0, [net.faults for net in networks]
    steps = [o for o in outcome if isinstance(o, int)]
    for o in outcome:
        if not isinstance(o, int):
            assert isinstance(o, SnapshotdError) and str(o), repr(o)  # named, never a bare crash or a hang
    if fault != "drop":  # nothing is lost, so nothing may fail
        assert outcome == [STEPS, STEPS], (outcome, [s.stats for s in first])
        assert all(s.stats.durable == STEPS and s.stats.failed == 0 for s in first), [s.stats for s in first]
    assert len(set(steps)) <= 1, outcome  # the ranks that restored agree
    for r, o in enumerate(outcome):
        if isinstance(o, int):
            assert torch.equal(restored[r]["w"], _state(r, o)["w"]) and restored[r]["loop"] == {"step": o}
