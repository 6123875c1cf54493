"""Zero-wait recovery with real processes: 2 emulated nodes x 2 processes, 4 virtual ranks, node B SIGKILLed
mid-run; the survivors carry its virtual ranks at once, and a replacement started later joins. Two jobs run side by
side on the same nodes, one per reduction (exact and equivalent), and meet the same loss."""

from __future__ import annotations

import uuid

import pytest

from snapshotd.bench.live import LiveRanks
from tests.waits import wait_until

from .conftest import Cluster

pytestmark = pytest.mark.integration

STEPS = 16
TRAINER = "snapshotd.bench.elastic_trainer"
FLAGS = ["--steps", str(STEPS), "--pg-timeout", "10", "--params", "100000"]
EQUIVALENT_RTOL = 1e-5
"""How far (relative) a loss of equivalent mode may drift from the failure-free run's within this job's steps:
the sum's order changes the mean gradient's last bits, and AdamW carries them on."""


MODES = ("exact", "equivalent")


def _job(workdir: str, store: str, mode: str, job: str, flags: list[str]) -> LiveRanks:
    return LiveRanks(
        workdir,
        tag=mode,
        job=job,
        store=store,
        nodes=2,
        per_node=2,
        flags=[*FLAGS, "--mode", mode, *flags],
        trainer=TRAINER,
    )


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, store: str) -> dict[str, list[dict]]:
    """The failure-free runs, snapshotd left out (``--no-snapshot``), one per reduction."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    refs = {m: _job(workdir, store, m, f"ref-{m}-{uuid.uuid4().hex[:8]}", ["--no-snapshot"]) for m in MODES}
    try:
        for ref in refs.values():
            ref.start_node("A", "unused", 0)
            ref.start_node("B", "unused", 1)
        return {m: ref.wait(180) for m, ref in refs.items()}
    finally:
        for ref in refs.values():
            ref.kill()


@pytest.mark.timeout(400)
def test_the_survivors_carry_the_lost_virtual_ranks_and_the_replacement_joins_later(
    tmp_path, cluster: Cluster, store: str, references: dict[str, list[dict]]
) -> None:
    """Node B dies after step 4; the survivors (their pids kept) carry virtual ranks 2 and 3 and train on; a
    replacement node C started 5 steps later joins at a step boundary and takes them back. Every virtual rank's
    data position and random streams end as in the failure-free run (each consumed exactly its samples), and at
    most one step is lost. In exact mode every loss of every (step, virtual rank) and the final model and
    optimizer are bit-identical to the failure-free run's; in equivalent mode they are until the loss, and
    within :data:`EQUIVALENT_RTOL` after it."""
    cluster.start("A")
    cluster.start("B")
    jobs = {m: _job(str(tmp_path), store, m, cluster.job(m), ["--step-delay", "0.15"]) for m in MODES}
    try:
        for job in jobs.values():
            job.start_node("A", cluster.ipc("A"), 0)
            job.start_node("B", cluster.ipc("B"), 1)

        def failed() -> dict:
            return {m: f for m, job in jobs.items() if (f := job.failed())}

        def everyone(what: str, test: object, timeout: float) -> None:
            wait_until(lambda: bool(failed()) or all(test(job) for job in jobs.values()), what, timeout)  # type: ignore[operator]
            assert not failed(), failed()

        everyone("step 4", lambda job: job.progress(0)["step"] >= 4, 120)
        pids = {m: {r: job.progress(r)["pid"] for r in range(2)} for m, job in jobs.items()}
        cluster.lose_node(cluster.sidecar("B"), [p for job in jobs.values() for p in job.lose("B")])
        reached = {m: max(job.progress(r)["step"] for r in range(4)) for m, job in jobs.items()}
        everyone(
            "the survivors carrying the lost virtual ranks",
            lambda job: job.progress(0)["carried"] == [0, 2],
            60,
        )
        shrunk_at = {m: job.progress(0)["step"] for m, job in jobs.items()}
        everyone(
            "five steps while shrunk", lambda job: job.progress(0)["step"] >= shrunk_at[job.tag] + 5, 120
        )
        cluster.start("C")
        for job in jobs.values():
            job.start_node("C", cluster.ipc("C"), 1)
        results = {m: job.wait(240) for m, job in jobs.items()}
        # a survivor's copy of the step in flight at the loss, still streaming when it rolled back, does not
        # refuse the snapshot of that step taken again
        logs = "".join(job.log_tail(label, 100_000) for job in jobs.values() for label in ("A", "C"))
        assert "steps only grow" not in logs, logs[-3000:]
    finally:
        for job in jobs.values():
            job.kill()
    for m in MODES:
        _check(m, results[m], references[m], pids[m], reached[m], shrunk_at[m])


def _check(
    mode: str, results: list[dict], reference: list[dict], pids: dict[int, int], reached: int, shrunk_at: int
) -> None:
    want = {
        (s, v): loss for res in reference for s, by_v in res["losses"].items() for v, loss in by_v.items()
    }
    got = {(s, v): loss for res in results for s, by_v in res["losses"].items() for v, loss in by_v.items()}
    assert len(want) == 4 * STEPS
    resumed = int(results[0]["recoveries"][0]["step"])
    # only node B computed virtual ranks 2 and 3 up to the step the survivors resumed from, and it left no result
    assert set(want) - set(got) == {(str(s), str(v)) for s in range(1, resumed + 1) for v in (2, 3)}, mode
    if mode == "exact":
        assert {k: want[k] for k in got} == got, "a loss differs from the failure-free run"
        assert {res["digest"] for res in results} == {reference[0]["digest"]}, "the shared state differs"
    else:
        before = {
            k: v for k, v in got.items() if int(k[0]) <= resumed + 1
        }  # the first shrunk step's losses too
        assert {k: want[k] for k in before} == before
        drift = max(abs(v - want[k]) / abs(want[k]) for k, v in got.items())
        assert drift <= EQUIVALENT_RTOL, f"a loss drifted by {drift:.2e} from the failure-free run's"
        assert len({res["digest"] for res in results}) == 1, "the processes disagree on the model"
    vranks = {v: d for res in results for v, d in res["vranks"].items()}
    assert vranks == {v: d for res in reference for v, d in res["vranks"].items()}, (
        f"{mode}: a virtual rank differs"
    )
    survivors = [res for res in results if res["rank"] in (0, 1)]
    for res in survivors:
        assert res["pid"] == pids[res["rank"]], "a survivor's process was restarted"
        (recovery,) = res["recoveries"]
        assert reached - 1 <= recovery["step"] <= reached, f"{mode}: more than one step lost"
        assert recovery["processes"] == 2 and len(recovery["carried"]) == 2
        (growth,) = res["growths"]
        assert growth["processes"] == 4 and growth["step"] >= shrunk_at + 5
    for res in results:
        if res["rank"] in (2, 3):
            assert res["start_step"] == survivors[0]["growths"][0]["step"], "the replacement repeated a step"
