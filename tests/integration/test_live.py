"""Live recovery with real processes: 2 emulated nodes x 2 DDP ranks on gloo, a node SIGKILLed mid-run, the
survivors recovering in their own processes while the replacement node's ranks start and pull their state."""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from snapshotd.bench.live import STORE_SCRIPT, LiveRanks
from snapshotd.bench.nodes import RendezvousStore
from snapshotd.demo import wait_for
from snapshotd.status import fetch_status

from .conftest import Cluster

STEPS = 10
FLAGS = ["--steps", str(STEPS), "--pg-timeout", "5"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The rendezvous store (the example's ``rdzv_store.py``) on a host of its own; its ``host:port``."""
    server = RendezvousStore(STORE_SCRIPT, str(tmp_path_factory.mktemp("store")))
    try:
        yield server.endpoint
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, store: str) -> list[dict]:
    """The failure-free run of the job, snapshotd left out (``--no-snapshot``): its results by rank."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    ref = LiveRanks(workdir, tag="ref", job=f"ref-{uuid.uuid4().hex[:8]}", store=store, nodes=2, per_node=2,
                    flags=[*FLAGS, "--no-snapshot"])  # fmt: skip
    try:
        ref.start_node(0, "unused")
        ref.start_node(1, "unused")
        return ref.wait(180)
    finally:
        ref.kill()


def _durable(cluster: Cluster, job: str, step: int) -> bool:
    with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
        jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=1.0)["jobs"]
        return any(j["job"] == job and j["durable"] >= step for j in jobs)
    return False


def _arrived(store: str, job: str, epoch: int) -> int:
    """How many ranks arrived in ``epoch`` of ``job`` (live mode's membership count in the rendezvous store)."""
    host, port = store.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    return int(client.add(f"snapshotd/{job}/e{epoch}/arrived", 0))


def _run_to_loss(tmp_path, cluster: Cluster, store: str) -> tuple[LiveRanks, dict[int, int], int]:
    """Start the job and SIGKILL node B (sidecar and ranks 2, 3) once step 3 is durable; the job, the pids
    before the loss and the newest step any rank had completed."""
    job = LiveRanks(str(tmp_path), tag="live", job=cluster.job("live"), store=store, nodes=2, per_node=2,
                    flags=[*FLAGS, "--step-delay", "0.3"])  # fmt: skip
    job.start_node(0, cluster.ipc("A"))
    job.start_node(1, cluster.ipc("B"))
    wait_for(lambda: bool(job.failed()) or (job.progress(0)["step"] >= 4 and _durable(cluster, job.job, 3)), 120,
             "step 4, with step 3 durable")  # fmt: skip
    assert not job.failed(), job.log_tail(min(job.failed()))
    pids = {r: p.pid for r, p in job.procs.items()}
    reached = max(job.progress(r)["step"] for r in range(job.world))
    cluster.lose_node(cluster.sidecar("B"), job.node_procs(1))
    return job, pids, reached


def _check(results: list[dict], reference: list[dict], pids: dict[int, int], reached: int) -> None:
    for r, res in enumerate(results):
        assert res["digest"] == reference[r]["digest"], f"rank {r}: final state differs from the failure-free run"
        assert all(reference[r]["losses"][k] == v for k, v in res["losses"].items()), f"rank {r}: losses differ"
    survivors, replacements = results[:2], results[2:]
    for res in survivors:
        assert res["pid"] == pids[res["rank"]], "a survivor's process was restarted"
        assert res["start_step"] == 0 and len(res["recoveries"]) >= 1
        step = res["recoveries"][-1]["step"]
        assert reached - 1 <= step <= reached, f"recovered step {step}, reached {reached}: more than one step lost"
        assert res["restored"]["source"] == "local"
    for res in replacements:
        assert res["pid"] != pids[res["rank"]]
        assert res["start_step"] == survivors[0]["recoveries"][-1]["step"]
        assert res["restored"]["source"] in ("replica", "pull")
    assert len({res["epoch"] for res in results}) == 1


@pytest.mark.timeout(400)
def test_survivors_recover_in_place_and_the_run_stays_bit_identical(tmp_path, cluster: Cluster, store: str,
                                                                    reference: list[dict]) -> None:  # fmt: skip
    cluster.start("A")
    cluster.start("B")
    job, pids, reached = _run_to_loss(tmp_path, cluster, store)
    try:
        cluster.start("C")  # the replacement node: its sidecar, then the lost ranks, as the scheduler starts them
        job.start_node(1, cluster.ipc("C"))
        results = job.wait(180)
    finally:
        job.kill()
    _check(results, reference, pids, reached)
    recovery = results[0]["recoveries"][-1]
    assert recovery["epoch"] == 1 and recovery["restore_s"] < 5


@pytest.mark.timeout(400)
def test_a_replacement_that_dies_while_joining_is_replaced_and_recovery_completes(
    tmp_path, cluster: Cluster, store: str, reference: list[dict]
) -> None:
    """The first replacement node dies while the group forms (its ranks SIGKILLed once one has arrived); the
    survivors' attempt fails on every rank, and with the next replacement the job completes, bit-identical."""
    cluster.start("A")
    cluster.start("B")
    job, pids, reached = _run_to_loss(tmp_path, cluster, store)
    try:
        first = cluster.start("C")
        job.start_node(1, cluster.ipc("C"))
        wait_for(lambda: _arrived(store, job.job, 1) >= 3, 60, "the first replacement arriving in epoch 1")
        cluster.lose_node(first, job.node_procs(1))
        cluster.start("D")
        job.start_node(1, cluster.ipc("D"))
        results = job.wait(240)
    finally:
        job.kill()
    _check(results, reference, pids, reached)
