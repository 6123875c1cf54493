"""Zero-wait recovery with real processes: 2 emulated nodes x 2 processes, 4 virtual ranks in exact mode, node B
SIGKILLed mid-run; the survivors carry its virtual ranks at once, and a replacement started later joins."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from snapshotd.bench.live import STORE_SCRIPT, LiveRanks
from snapshotd.bench.nodes import RendezvousStore
from tests.waits import wait_until

from .conftest import Cluster

pytestmark = pytest.mark.integration

STEPS = 16
TRAINER = "snapshotd.bench.elastic_trainer"
FLAGS = ["--steps", str(STEPS), "--pg-timeout", "10", "--params", "100000"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The rendezvous store (the example's ``rdzv_store.py``); its ``host:port``."""
    server = RendezvousStore(STORE_SCRIPT, str(tmp_path_factory.mktemp("store")))
    try:
        yield server.endpoint
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, store: str) -> list[dict]:
    """The failure-free run, snapshotd left out (``--no-snapshot``), with the same exact reduction."""
    ref = LiveRanks(
        str(tmp_path_factory.mktemp("reference")),
        tag="ref",
        job=f"ref-{uuid.uuid4().hex[:8]}",
        store=store,
        nodes=2,
        per_node=2,
        flags=[*FLAGS, "--no-snapshot"],
        trainer=TRAINER,
    )
    try:
        ref.start_node("A", "unused", 0)
        ref.start_node("B", "unused", 1)
        return ref.wait(180)
    finally:
        ref.kill()


@pytest.mark.timeout(400)
def test_the_survivors_carry_the_lost_virtual_ranks_and_the_replacement_joins_later(
    tmp_path, cluster: Cluster, store: str, reference: list[dict]
) -> None:
    """Node B dies after step 3 is durable; the survivors (their pids kept) carry virtual ranks 2 and 3 and
    train on; a replacement node C started 5 steps later joins at a step boundary and takes them back. Every loss
    of every (step, virtual rank), the final model and optimizer, and every virtual rank's data position and
    random streams equal the failure-free run's; at most one step is lost."""
    cluster.start("A")
    cluster.start("B")
    job = LiveRanks(
        str(tmp_path),
        tag="elastic",
        job=cluster.job("elastic"),
        store=store,
        nodes=2,
        per_node=2,
        flags=[*FLAGS, "--step-delay", "0.3"],
        trainer=TRAINER,
    )
    try:
        job.start_node("A", cluster.ipc("A"), 0)
        job.start_node("B", cluster.ipc("B"), 1)
        wait_until(lambda: bool(job.failed()) or job.progress(0)["step"] >= 4, "step 4", 120)
        assert not job.failed(), job.failed()
        pids = {r: job.progress(r)["pid"] for r in range(2)}
        cluster.lose_node(cluster.sidecar("B"), job.lose("B"))
        reached = max(job.progress(r)["step"] for r in range(4))
        wait_until(
            lambda: bool(job.failed()) or job.progress(0)["carried"] == [0, 2],
            "the survivors carrying the lost virtual ranks",
            60,
        )
        shrunk_at = job.progress(0)["step"]
        wait_until(
            lambda: bool(job.failed()) or job.progress(0)["step"] >= shrunk_at + 5,
            "five steps while shrunk",
            120,
        )
        assert not job.failed(), job.failed()
        cluster.start("C")
        job.start_node("C", cluster.ipc("C"), 1)
        results = job.wait(240)
    finally:
        job.kill()
    want = {
        (s, v): loss for res in reference for s, by_v in res["losses"].items() for v, loss in by_v.items()
    }
    got = {(s, v): loss for res in results for s, by_v in res["losses"].items() for v, loss in by_v.items()}
    assert len(want) == 4 * STEPS
    assert {k: want[k] for k in got} == got, "a loss differs from the failure-free run"
    # only node B computed virtual ranks 2 and 3 up to the step the survivors resumed from, and it left no result
    resumed = int(results[0]["recoveries"][0]["step"])
    assert set(want) - set(got) == {(str(s), str(v)) for s in range(1, resumed + 1) for v in (2, 3)}
    assert {res["digest"] for res in results} == {reference[0]["digest"]}, "the shared state differs"
    vranks = {v: d for res in results for v, d in res["vranks"].items()}
    assert vranks == {v: d for res in reference for v, d in res["vranks"].items()}
    survivors = [res for res in results if res["rank"] in (0, 1)]
    for res in survivors:
        assert res["pid"] == pids[res["rank"]], "a survivor's process was restarted"
        (recovery,) = res["recoveries"]
        assert reached - 1 <= recovery["step"] <= reached, "more than one step lost"
        assert recovery["processes"] == 2 and len(recovery["carried"]) == 2
        (growth,) = res["growths"]
        assert growth["processes"] == 4 and growth["step"] >= shrunk_at + 5
    for res in results:
        if res["rank"] in (2, 3):
            assert res["start_step"] == survivors[0]["growths"][0]["step"], "the replacement repeated a step"
