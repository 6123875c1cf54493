"""A replacement rank fetches its step from the holders' bulk ports itself, and falls back to a pull through the
sidecars when it cannot.

Real sidecars and a coordinator run in this process (:class:`~tests.deployments.InProcess`) with their data planes
on loopback TCP, where bulk ports serve. Ranks 0 and 1 snapshot on nodes A and B (rank 0's step held on B and C,
two replicas); node A is lost and rank 0 restarts on D, whose sidecar pulls its step from B and C.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.client import snapshotter as snapshotter_module
from snapshotd.client.fetch import RestoreFetcher
from snapshotd.proto import RestoreFetch, RestoreFetched

from ..deployments import InProcess, restore_all, snapshot_then_crash

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STEPS = 2
FLOATS = 300_000  # 1.2 MB: 293 chunks of 4 KiB


def _state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(FLOATS, generator=gen), "t": torch.randn(64, 32, generator=gen), "loop": {"step": step}}


def _fresh() -> dict:
    """A restarted rank's state: ``t`` is a transposed view, not contiguous, so it has no restore target and its
    bytes come through the slot while ``w``'s go straight into it."""
    return {"w": torch.zeros(FLOATS), "t": torch.zeros(32, 64).t(), "loop": {}}


def _replace_node_a(dep: InProcess, job: str) -> tuple[list[dict], list[int | BaseException], list[dict]]:
    """Snapshot, lose A, restart both ranks (rank 0 on D) and restore them: the restored states, the outcomes and
    each rank's ``restored``."""
    ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
    dep.start_sidecar("C")
    snapshot_then_crash(ipcs, job, STEPS, _state)
    dep.lose_node("A")
    dep.wait_dead("A")
    ipcs[0] = dep.start_sidecar("D")
    restored = [_fresh() for _ in (0, 1)]
    snaps = [Snapshotter(restored[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=10) for r in (0, 1)]
    try:
        outcome = restore_all(snaps, timeout=30)
        return restored, outcome, [dict(s.restored) for s in snaps]
    finally:
        for s in snaps:
            s.close()


def _assert_restored(restored: dict, rank: int) -> None:
    expected = _state(rank, STEPS)
    assert torch.equal(restored["w"], expected["w"]) and torch.equal(restored["t"], expected["t"])
    assert restored["loop"] == {"step": STEPS}


def _restore_lines(caplog: pytest.LogCaptureFixture, job: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"rank 0 of job {job} restores step" in r.getMessage()]


@pytest.mark.parametrize("bulk_port", [0, None], ids=["bulk", "bulk-off"])
def test_a_replacement_rank_fetches_its_step_itself_where_bulk_ports_serve(
    caplog: pytest.LogCaptureFixture, bulk_port: int | None
) -> None:
    caplog.set_level(logging.INFO, logger="snapshotd.sidecar.restore")
    job = f"fetch-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096, replicas=2, tcp=True, bulk_port=bulk_port) as dep:
        restored, outcome, how = _replace_node_a(dep, job)
    assert outcome == [STEPS, STEPS]
    for r in (0, 1):
        _assert_restored(restored[r], r)
    assert how[0]["source"] == "pull" and how[0]["direct"]
    (line,) = _restore_lines(caplog, job)
    assert ("fetched by the rank" in line) == (bulk_port is not None), line
    assert "into its tensors" in line


def test_a_fetch_that_fails_is_followed_by_a_pull_through_the_sidecars(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="snapshotd.sidecar.restore")
    asked: list[RestoreFetch] = []

    class Failing(RestoreFetcher):
        def run(self) -> RestoreFetched:
            asked.append(self.msg)
            return self._failed("the test's network is down")

    monkeypatch.setattr(snapshotter_module, "RestoreFetcher", Failing)
    job = f"nofetch-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096, replicas=2, tcp=True) as dep:
        restored, outcome, how = _replace_node_a(dep, job)
    assert outcome == [STEPS, STEPS]
    _assert_restored(restored[0], 0)
    assert len(asked) == 1 and asked[0].step == STEPS and len(asked[0].holders) == 2
    assert how[0]["source"] == "pull"
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not fetch step" in m and "the test's network is down" in m for m in messages), messages
    (line,) = _restore_lines(caplog, job)
    assert "fetched by the rank" not in line, line
