"""A replacement rank fetches its step from the holders' bulk ports itself, and falls back to a pull through the
sidecars when it cannot.

Most stories run real sidecars and a coordinator in this process (:class:`~tests.deployments.InProcess`) with
their data planes on loopback TCP, where bulk ports serve. Ranks 0 and 1 snapshot on nodes A and B (rank 0's step
held on B and C, two replicas); node A is lost and rank 0 restarts on D, whose sidecar pulls its step from B and
C. The last runs ``snapshotd`` processes with a secret and ``members`` data planes, each node on a loopback
address of its own.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.client import restoring as restoring_module
from snapshotd.client.fetch import RestoreFetcher
from snapshotd.harness.cluster import LocalCluster
from snapshotd.proto import RestoreFetch, RestoreFetched
from snapshotd.status import fetch_status
from tests.waits import wait_until

from ..deployments import InProcess, restore_all, snapshot_then_crash

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STEPS = 2
FLOATS = 300_000  # 1.2 MB: 293 chunks of 4 KiB


def _state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "w": torch.randn(FLOATS, generator=gen),
        "t": torch.randn(64, 32, generator=gen),
        "loop": {"step": step},
    }


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
    ipcs[0] = dep.replace_node("A", "D")
    restored = [_fresh() for _ in (0, 1)]
    snaps = [
        Snapshotter(restored[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=10) for r in (0, 1)
    ]
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


def test_a_replacement_rank_fetches_its_step_itself_where_bulk_ports_serve(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="snapshotd.sidecar.restore")
    job = f"fetch-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096, replicas=2, tcp=True) as dep:
        restored, outcome, how = _replace_node_a(dep, job)
    assert outcome == [STEPS, STEPS]
    for r in (0, 1):
        _assert_restored(restored[r], r)
    assert how[0]["source"] == "pull" and how[0]["direct"] and how[0]["fetched"]
    assert not how[1]["fetched"]  # rank 1 restored from its own shared memory
    (line,) = _restore_lines(caplog, job)
    assert "fetched by the rank" in line and "into its tensors" in line, line


def test_in_members_mode_the_replacement_fetches_from_a_holder_behind_the_member_check(tmp_path) -> None:
    """Nodes A (127.0.0.1, rack r1) and B (127.0.0.2, r2) hold ranks 0 and 1; A is lost and C (127.0.0.3) starts in
    A's rack, so no copy of rank 0 is re-replicated to it: rank 0, restarted on C, fetches its step from B."""
    job = f"members-{uuid.uuid4().hex[:6]}"
    secret = uuid.uuid4().hex
    members = ("--data-security", "members")
    with LocalCluster(str(tmp_path), env={"SNAPSHOTD_SECRET": secret}) as cluster:
        cluster.start_coordinator()
        for node, rack, host in (("A", "r1", "127.0.0.1"), ("B", "r2", "127.0.0.2")):
            cluster.start_sidecar(
                node, *members, "--rack", rack, "--advertise", host, data_bind=f"tcp://{host}:0"
            )
        snapshot_then_crash({0: cluster.ipc_path("A"), 1: cluster.ipc_path("B")}, job, STEPS, _state)
        cluster.kill(cluster.sidecars["A"])
        wait_until(
            lambda: any(
                n["node"] == "A" and not n["alive"]
                for n in fetch_status(cluster.coordinator_addr, secret=secret)["nodes"]
            ),
            "node A declared dead",
            15,
        )
        cluster.start_sidecar(
            "C", *members, "--rack", "r1", "--advertise", "127.0.0.3", data_bind="tcp://127.0.0.3:0"
        )
        restored = [_fresh() for _ in (0, 1)]
        ipcs = {0: cluster.ipc_path("C"), 1: cluster.ipc_path("B")}
        snaps = [
            Snapshotter(restored[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=10)
            for r in (0, 1)
        ]
        try:
            assert restore_all(snaps, timeout=30) == [STEPS, STEPS]
            how = [dict(s.restored) for s in snaps]
        finally:
            for s in snaps:
                s.close()
        log_c = cluster.tail(cluster.sidecars["C"], 200)
    for r in (0, 1):
        _assert_restored(restored[r], r)
    assert how[0]["source"] == "pull" and how[0]["fetched"], how
    assert "fetched by the rank" in log_c, log_c


def test_a_fetch_that_fails_is_followed_by_a_pull_through_the_sidecars(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="snapshotd.sidecar.restore")
    caplog.set_level(logging.INFO, logger="snapshotd.sidecar.restore_fetch")
    asked: list[RestoreFetch] = []

    class Failing(RestoreFetcher):
        def run(self) -> RestoreFetched:
            asked.append(self.msg)
            return self._failed("the test's network is down")

    monkeypatch.setattr(restoring_module, "RestoreFetcher", Failing)
    job = f"nofetch-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096, replicas=2, tcp=True) as dep:
        restored, outcome, how = _replace_node_a(dep, job)
    assert outcome == [STEPS, STEPS]
    _assert_restored(restored[0], 0)
    assert len(asked) == 1 and asked[0].step == STEPS and len(asked[0].holders) == 2
    assert how[0]["source"] == "pull" and not how[0]["fetched"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not fetch step" in m and "the test's network is down" in m for m in messages), messages
    (line,) = _restore_lines(caplog, job)
    assert "fetched by the rank" not in line, line


def test_a_fetch_asked_after_the_restore_ended_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """The addresses a restore named may hold other data once it returned: a late RestoreFetch starts nothing."""
    caplog.set_level(logging.INFO, logger="snapshotd.client.restoring")
    job = f"late-{uuid.uuid4().hex[:6]}"
    state = {"w": torch.zeros(8)}
    with (
        InProcess() as dep,
        Snapshotter(state, job=job, rank=0, world_size=1, sidecar=dep.start_sidecar("A"), timeout=10) as snap,
    ):
        assert snap.restore(timeout=30) == 0
        snap._session.on_message(
            RestoreFetch(
                job=job,
                rank=0,
                step=1,
                fetch=9,
                data_bytes=32,
                chunk_bytes=4096,
                arena="/dev/shm/none",
                slot_bytes=4096,
                slots=1,
                slot=0,
                holders=("127.0.0.1:1",),
                tokens=bytes(16),
            )
        )
        assert snap._restorer._fetching is None
    assert any("after the restore ended: ignored" in r.getMessage() for r in caplog.records)
    assert torch.equal(state["w"], torch.zeros(8))
