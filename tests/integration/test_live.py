"""Live recovery with real processes: 2 emulated nodes x 2 DDP ranks on gloo, a node SIGKILLed mid-run, the
survivors recovering in their own processes while the replacement node's ranks start and pull their state."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import subprocess
import time
import uuid

import pytest
import torch.distributed as dist

from snapshotd.bench.live import LiveRanks
from snapshotd.client import RecoveryFailed, SidecarRefused
from snapshotd.client.seat import request_seat
from snapshotd.status import fetch_status
from tests.waits import wait_until

from .conftest import Cluster

pytestmark = pytest.mark.integration

STEPS = 10
FLAGS = ["--steps", str(STEPS), "--pg-timeout", "5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, store: str) -> list[dict]:
    """The failure-free run of the job, snapshotd left out (``--no-snapshot``): its results by rank."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    ref = LiveRanks(
        workdir,
        tag="ref",
        job=f"ref-{uuid.uuid4().hex[:8]}",
        store=store,
        nodes=2,
        per_node=2,
        flags=[*FLAGS, "--no-snapshot"],
    )
    try:
        ref.start_node("A", "unused", 0)
        ref.start_node("B", "unused", 1)
        return ref.wait(180)
    finally:
        ref.kill()


def _durable(cluster: Cluster, job: str, step: int) -> bool:
    with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
        jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=1.0)["jobs"]
        return any(j["job"] == job and j["durable"] >= step for j in jobs)
    return False


def _fewest_copies(cluster: Cluster, job: str) -> int:
    """The fewest live nodes holding any rank's copy of the job's recoverable step G (0 before it is known)."""
    with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
        jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=1.0)["jobs"]
        ranks = next((j["ranks"] for j in jobs if j["job"] == job), [])
        return min((r["copies"] for r in ranks), default=0)
    return 0


def _arrived(store: str, job: str, epoch: int) -> int:
    """How many ranks arrived in ``epoch`` of ``job`` (live mode's membership count in the rendezvous store)."""
    host, port = store.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    return int(client.add(f"snapshotd/{job}/e{epoch}/arrived", 0))


def _run_to_loss(
    tmp_path,
    cluster: Cluster,
    store: str,
    *,
    seated: bool = False,
    spare: str | None = None,
    dying: bool = False,
    hang: bool = False,
    flags: tuple[str, ...] = (),
) -> tuple[LiveRanks, dict[int, int], int, list[int]]:
    """Start the job on nodes A and B (ranks 0, 1 and 2, 3; or, ``seated``, wherever snapshotd seats them), start
    the ranks of node ``spare`` (seated; its sidecar runs from the start, as a spare node's would, so the buddies
    placed on it do not change while the job runs) once the job runs, then SIGKILL node B (its sidecar and ranks) once step 3
    is durable; ``hang``: SIGSTOP them instead, in a job whose group timeout is 120 s. ``dying``: rank 1 runs as
    label ``A1``, with ``--die-in-rollback``. ``flags``: more of the trainer's flags. The job, every rank's pid before the loss, the newest step any rank
    had completed, and the ranks that survive (node A's)."""
    job = LiveRanks(
        str(tmp_path),
        tag="live",
        job=cluster.job("live"),
        store=store,
        nodes=2,
        per_node=2,
        flags=[*FLAGS, "--step-delay", "0.3", *(["--pg-timeout", "120"] if hang else []), *flags],
    )
    if spare is not None:
        cluster.start(spare)
    if dying:
        job.start_node("A", cluster.ipc("A"), 0, local=[0])
        job.start_node("A1", cluster.ipc("A"), 0, local=[1], flags=["--die-in-rollback"])
        job.start_node("B", cluster.ipc("B"), 1)
    else:
        for i, label in enumerate("AB"):
            job.start_node(label, cluster.ipc(label), None if seated else i)
    wait_until(
        lambda: bool(job.failed()) or (job.progress(0)["step"] >= 1 and job.progress(2)["step"] >= 1),
        "the job's first step",
        120,
    )
    if spare is not None:
        job.start_node(spare, cluster.ipc(spare))
    wait_until(
        lambda: bool(job.failed()) or (job.progress(0)["step"] >= 4 and _durable(cluster, job.job, 3)),
        "step 4, with step 3 durable",
        120,
    )
    assert not job.failed(), job.failed()
    pids = {r: job.progress(r)["pid"] for r in range(job.world)}
    survivors = sorted(job.ranks_of("A") + (job.ranks_of("A1") if dying else []))
    assert len(survivors) == 2 and (seated or survivors == [0, 1])
    reached = max(job.progress(r)["step"] for r in range(job.world))
    assert reached < STEPS, (
        f"the job reached its last step ({reached}) before step 3 was durable: nothing to lose"
    )
    if hang:
        _signal_node(cluster, job, "B", signal.SIGSTOP)
    else:
        cluster.lose_node(cluster.sidecar("B"), job.lose("B"))
    # the ranks may have completed another step (and B snapshotted it) between the reading above and the loss
    reached = max(reached, *(job.progress(r)["step"] for r in range(job.world)))
    return job, pids, reached, survivors


def _signal_node(cluster: Cluster, job: LiveRanks, label: str, sig: signal.Signals) -> None:
    """Send ``sig`` to node ``label``'s sidecar and ranks."""
    for pid in [cluster.sidecar(label).proc.pid, *(p.pid for p in job.procs.get(label, ()))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _restart_when_killed(
    job: LiveRanks, cluster: Cluster, label: str, restart: str, node: str, index: int, local_rank: int
) -> list[dict]:
    """Once the one process of ``label`` has killed itself (SIGKILL), start it again as ``restart`` on ``node``
    (node index ``index``, local rank ``local_rank``), as its launcher would; the job's results."""
    (dead,) = job.lose(label)
    assert dead.wait(120) == -signal.SIGKILL, job.log_tail(label)
    job.start_node(restart, cluster.ipc(node), index, local=[local_rank])
    return job.wait(240)


def _check(
    results: list[dict],
    reference: list[dict],
    pids: dict[int, int],
    reached: int,
    survivors: list[int],
    restarted: tuple[int, ...] = (),
) -> None:
    """Every rank ended bit-identical to the failure-free run in one epoch; the ``survivors`` kept their processes
    and rolled back at most one step from their own memory; the others (the lost node's ranks, and ``restarted``:
    survivors that died later and restarted on their node) are new processes that restored the same step."""
    for r, res in enumerate(results):
        assert res["rank"] == r
        assert res["digest"] == reference[r]["digest"], (
            f"rank {r}: final state differs from the failure-free run"
        )
        assert all(reference[r]["losses"][k] == v for k, v in res["losses"].items()), (
            f"rank {r}: losses differ"
        )
    kept = [res for res in results if res["rank"] in survivors]
    replacements = [res for res in results if res["rank"] not in survivors]
    assert all(res["start_step"] == 0 and len(res["recoveries"]) >= 1 for res in kept)
    # the step each survivor had completed when its last failure surfaced: after the loss it may still complete the
    # step the node had done its part of, and a story with a second failure trains on between the two
    reached = max([reached, *(res["recoveries"][-1]["reached"] for res in kept)])
    for res in kept:
        assert res["pid"] == pids[res["rank"]], "a survivor's process was restarted"
        step = res["recoveries"][-1]["step"]
        assert reached - 1 <= step <= reached, (
            f"recovered step {step}, reached {reached}: more than one step lost"
        )
        assert res["restored"]["source"] == "local"
    for res in replacements:
        assert res["pid"] != pids[res["rank"]]
        assert res["start_step"] == kept[0]["recoveries"][-1]["step"]
        assert res["restored"]["source"] in (("local",) if res["rank"] in restarted else ("replica", "pull"))
    assert len({res["epoch"] for res in results}) == 1


@pytest.mark.timeout(400)
@pytest.mark.parametrize("cluster", [5.0], indirect=True)  # a death declared by the probe, never by timeout
def test_a_spare_takes_the_lost_seat_and_when_it_dies_joining_the_next_node_does(
    tmp_path, cluster: Cluster, store: str, reference: list[dict]
) -> None:
    """The whole story, every node seated by snapshotd: node B is SIGKILLed mid-run and the survivors recover in
    their own processes. A spare node started while the job runs waits for a seat; when node B dies it takes B's
    seat, and dies itself while the group forms (its ranks SIGKILLed once one has arrived):
    the survivors' attempt fails on every rank, the next node started takes the seat once the spare is declared
    dead, and the job completes, bit-identical."""
    cluster.start("A")
    cluster.start("B")
    job, pids, reached, survivors = _run_to_loss(tmp_path, cluster, store, seated=True, spare="C")
    try:
        wait_until(
            lambda: bool(job.failed()) or _arrived(store, job.job, 1) >= 3,
            "the spare taking the lost seat and arriving in epoch 1",
            60,
        )
        assert not job.failed(), job.failed()
        wait_until(
            lambda: _fewest_copies(cluster, job.job) >= 2,
            "every rank's copy of G on two live nodes again (re-replicated after B's loss), so C may die",
            60,
        )
        cluster.lose_node(cluster.sidecar("C"), job.lose("C"))
        cluster.start("D")
        job.start_node("D", cluster.ipc("D"))
        results = job.wait(240)
    finally:
        job.kill()
    _check(results, reference, pids, reached, survivors)
    assert sorted(job.ranks_of("D")) == sorted(set(range(4)) - set(survivors))
    assert results[survivors[0]]["recoveries"][-1]["restore_s"] < 5
    # B was declared dead by the probe a survivor's lost-peer report started, not after the death timeout
    assert re.search(
        rf"node {cluster.node('B')} refused a connection to its data address .* lost a peer\): declared "
        "dead",
        cluster.tail(cluster.coordinator, 400),
    ), cluster.tail(cluster.coordinator)


@pytest.mark.timeout(400)
def test_a_hung_node_is_replaced_long_before_the_group_timeout_and_its_ranks_are_refused_when_they_wake(
    tmp_path, cluster: Cluster, store: str, reference: list[dict]
) -> None:
    """Node B hangs (its sidecar and ranks SIGSTOPped) in a job whose group timeout is 120 s, the survivors blocked
    in a collective on it. The coordinator declares B dead after its death timeout (1.5 s), the spare takes B's
    seat and opens the job's next epoch, and the survivors' watchdogs see it and leave the old group: they
    recover with the spare within seconds. When B wakes (SIGCONT), its ranks find their group gone and their seat
    taken, and exit with an error that says so; the job completes, bit-identical. The optimizer is snapshotted
    once across the ranks (``replicated=``): the replica group moves to the new group with DDP."""
    cluster.start("A")
    cluster.start("B")
    job, pids, reached, survivors = _run_to_loss(
        tmp_path, cluster, store, seated=True, spare="C", hang=True, flags=("--replicated", "optim")
    )
    hung_at = time.time()
    woken: list[subprocess.Popen[bytes]] = []
    try:
        wait_until(
            lambda: bool(job.failed()) or all(job.progress(r)["step"] > reached for r in range(4)),
            "the survivors and the spare training past the step reached before the hang",
            60,
        )
        assert not job.failed(), job.failed()
        _signal_node(cluster, job, "B", signal.SIGCONT)
        woken = job.lose("B")  # not waited for with the job's ranks
        for proc in woken:
            assert proc.wait(60) != 0, job.log_tail("B")
        assert "was given to node" in job.log_tail("B") and "must not rejoin" in job.log_tail("B"), (
            job.log_tail("B")
        )
        results = job.wait(240)
    finally:
        _signal_node(cluster, job, "B", signal.SIGCONT)  # whatever happened, nothing stays stopped
        for proc in woken:
            proc.kill()
            proc.wait(10)
        job.kill()
    _check(results, reference, pids, reached, survivors)
    assert sorted(job.ranks_of("C")) == sorted(set(range(4)) - set(survivors))
    for r in survivors:
        recovery = results[r]["recoveries"][-1]
        # the watchdog's doing: the group timeout is 120 s
        assert recovery["failed_at"] - hung_at < 20, recovery


@pytest.mark.timeout(400)
def test_a_survivor_that_dies_during_its_rollback_is_restarted_and_recovery_completes(
    tmp_path, cluster: Cluster, store: str, reference: list[dict]
) -> None:
    """Node B dies; survivor rank 1 kills itself 0.2 s into its rollback (``--die-in-rollback``) and is restarted
    on its node, as a launcher restarts a worker; rank 0 and the replacement's ranks find it gone at their next
    collective and recover again with it; the job completes, bit-identical, in one epoch."""
    cluster.start("A")
    cluster.start("B")
    job, pids, reached, _ = _run_to_loss(tmp_path, cluster, store, dying=True)
    try:
        cluster.start("C")
        job.start_node("C", cluster.ipc("C"), 1)
        results = _restart_when_killed(job, cluster, "A1", "A2", "A", 0, 1)
    finally:
        job.kill()
    _check(results, reference, pids, reached, [0], restarted=(1,))
    assert len(results[0]["recoveries"]) >= 2, "rank 0 recovered once more, with the restarted rank 1"


@pytest.mark.timeout(400)
def test_a_replacement_that_dies_before_its_restore_is_restarted_and_the_others_follow_it_to_the_next_group(
    tmp_path, cluster: Cluster, store: str, reference: list[dict]
) -> None:
    """Node B dies; the replacement node's ranks form the group with the survivors and run DDP's constructor, and
    one of them dies before it asks for its restore (``--die-before-restore``), the others waiting for theirs.
    Restarted on its node, as a launcher restarts a worker, it arrives in that epoch a second time and opens the
    next; the watchdogs see it, and the survivors (in ``recover()``) and the other replacement rank (in
    ``restore()``, its process kept) leave their waits and form the next group with it, long before the restore's
    timeout (300 s); the job completes, bit-identical."""
    cluster.start("A")
    cluster.start("B")
    job, pids, reached, survivors = _run_to_loss(tmp_path, cluster, store)
    try:
        cluster.start("C")
        job.start_node("C", cluster.ipc("C"), 1, local=[0], flags=["--die-before-restore"])
        job.start_node("C1", cluster.ipc("C"), 1, local=[1])
        results = _restart_when_killed(job, cluster, "C", "C2", "C", 1, 0)
    finally:
        job.kill()
    _check(results, reference, pids, reached, survivors)
    for r in survivors:
        recovery = results[r]["recoveries"][-1]
        assert recovery["epoch"] == 2 and recovery["seconds"] < 60, recovery
    (follower,) = job.procs["C1"]
    assert results[3]["pid"] == follower.pid and results[3]["started"]["epoch"] == 2, results[3]
    assert "joining it" in job.log_tail("C1", 200), job.log_tail("C1")
    assert "the job opened a newer group while this rank waited" in job.log_tail("A", 200), job.log_tail("A")


def test_seats_through_real_sidecars_are_kept_per_node_a_spare_waits_and_bad_requests_are_named(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for label in "ABC":
        cluster.start(label)
    job = cluster.job("seats")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert request_seat(job, 2, cluster.ipc("B"), 30) == (0, 4)  # the first node to ask gets seat 0
    assert request_seat(job, 2, cluster.ipc("A"), 30) == (2, 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert request_seat(job, 2, cluster.ipc("B"), 30) == (1, 4)  # the node's other rank: the same seat
    with pytest.raises(
        RecoveryFailed, match=r"no seat for this node within 1 s: all 2 seats of job .* are held"
    ):
        request_seat(job, 2, cluster.ipc("C"), 1.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(SidecarRefused, match="asked for seats of 2 of 4 ranks, this one for 4 of 8"):
        request_seat(job, 2, cluster.ipc("C"), 5.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert request_seat(job, 2, cluster.ipc("A"), 30) == (3, 4), "a refused request changed nothing"
