"""The job index and its watermarks: G, D, unusable and stale steps, and the index kept equal to a recount."""

from __future__ import annotations

import random

import pytest

from snapshotd.coordinator import CoordinatorConfig, CoordinatorState
from snapshotd.proto import (
    InventoryItem,
)

from .scenario import (
    LATER,
    T0,
    beat,
    inv,
    keep_alive,
    make,
    plan,
    ranks,
    register,
    two_node_job,
    watermark,
)


def test_recoverable_counts_local_copies_durable_does_not() -> None:
    st = make()
    two_node_job(st)
    reply = beat(st, "a", T0 + 0.1, changed=False)
    assert watermark(reply) == (6, 5)  # 6 only in the ranks' own slots: recoverable, not durable
    # b loses its buddy copy of rank 0: step 5 is no longer durable, still recoverable.
    reply = beat(st, "b", T0 + 0.2, ranks("j", 2, 1), inv("j", 1, 5, 6, local=True))
    assert watermark(reply) == (6, -1)


def test_copy_on_the_home_node_is_not_durable() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    # a holds a non-local copy of its own rank (e.g. pulled back): still on the rank's own node.
    reply = beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 7))
    assert watermark(reply) == (7, -1)
    reply = beat(st, "b", T0, (), inv("j", 0, 7))
    assert watermark(reply) == (7, 7)


def test_recoverable_needs_a_step_common_to_every_rank() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 8, 9, local=True))
    reply = beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 6, 7, local=True))
    assert watermark(reply) == (-1, -1)
    reply = beat(st, "b", T0 + 0.1, ranks("j", 2, 1), inv("j", 1, 7, 8, local=True))
    assert watermark(reply) == (8, -1)


def test_a_step_some_rank_skipped_is_named_unusable() -> None:
    """Rank 1 holds 7 and 9 but not 8: it will never have 8, so no restore can use 8 and a's copies of it need not
    be held; likewise 9, which rank 0 passed. Step 10, which rank 1 has not reached yet, may still be common."""
    st = make()
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 7, 8, 10, local=True) + inv("j", 1, 7, 9))
    reply = beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 7, 9, local=True) + inv("j", 0, 7, 8, 10))
    (wm,) = reply.watermarks
    assert (wm.recoverable, wm.durable, wm.unusable) == (7, 7, (8, 9))
    reply = beat(
        st, "b", T0 + 0.1, ranks("j", 2, 1), inv("j", 1, 7, 9, 11, local=True) + inv("j", 0, 7, 8, 10)
    )
    assert reply.watermarks[0].unusable == (8, 9, 10)  # rank 1 passed 10 without it


def test_durable_capped_at_plan_step_while_the_round_is_open() -> None:
    st = make()
    two_node_job(st)
    plan(st, 1, "b")
    assert (plan(st, 0, "a").step, st.status(LATER)["jobs"][0]["durable"]) == (6, 5)
    # Step 6 and 7 become durable for every rank while rank 1 has not collected its answer.
    beat(st, "a", LATER, ranks("j", 2, 0), inv("j", 0, 6, 7, local=True) + inv("j", 1, 6, 7))
    reply = beat(st, "b", LATER, ranks("j", 2, 1), inv("j", 1, 6, 7, local=True) + inv("j", 0, 6, 7))
    assert watermark(reply) == (7, 6)
    assert plan(st, 1, "b").step == 6  # every rank answered and G moved past 6: the round closes
    assert watermark(beat(st, "b", LATER + 0.1, changed=False)) == (7, 7)


def test_steps_held_when_a_round_froze_stay_out_of_every_watermark_until_durable_passes_them() -> None:
    """The plan freezes at 6 while rank 0 also holds 7 (the failed run's). The resumed run snapshots its own
    step 7 under the same name: neither copy may ever be restored, so 7 is unusable and G and D skip it; the
    next plan round still restores 6. Step 8 is the resumed run's alone: once durable, everything is as usual."""
    st = make()
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 5, 6, 7, local=True) + inv("j", 1, 5, 6))
    beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5, 6, 7))
    plan(st, 1, "b")
    assert plan(st, 0, "a").step == 6
    # The resumed run's step 7 lands on every node before its old copies go.
    beat(st, "a", LATER, ranks("j", 2, 0), inv("j", 0, 6, 7, local=True) + inv("j", 1, 6, 7))
    reply = beat(st, "b", LATER, ranks("j", 2, 1), inv("j", 1, 6, 7, local=True) + inv("j", 0, 6, 7))
    (wm,) = reply.watermarks
    assert (wm.recoverable, wm.durable, wm.unusable) == (6, 6, (7,))
    # Every rank restarts again: the plan is 6, never 7.
    plan(st, 0, "a", now=LATER + 1)
    assert plan(st, 1, "b", now=LATER + 1).step == 6
    assert plan(st, 0, "a", now=LATER + 1).step == 6
    beat(st, "a", LATER + 2, ranks("j", 2, 0), inv("j", 0, 6, 7, 8, local=True) + inv("j", 1, 6, 7, 8))
    reply = beat(
        st, "b", LATER + 2, ranks("j", 2, 1), inv("j", 1, 6, 7, 8, local=True) + inv("j", 0, 6, 7, 8)
    )
    (wm,) = reply.watermarks  # every rank has its answer and G is past 6: the round closes, D moves on
    assert (wm.recoverable, wm.durable, wm.unusable) == (8, 8, ())
    assert st.jobs["j"].stale == (-1, -1)


def test_a_fork_inside_stale_steps_keeps_the_newer_ones_stale() -> None:
    """A second restore at 6 while 7-9 are stale from a restore at 5 (and only 7 is held now) keeps 8 and 9
    out too: copies of them from the first failed run may still land."""
    st = make()
    register(st, "a")
    beat(st, "a", LATER, ranks("j", 1, 0), inv("j", 0, 5, 6, 7, local=True))
    job = st.jobs["j"]
    job.stale = (5, 9)
    job.fork(6)
    assert job.stale == (6, 9)
    job.fork(9)
    assert job.stale == (-1, -1)


def _index_from_scratch(st: CoordinatorState) -> dict[str, tuple[dict, dict, dict, set, dict]]:
    """Every job's holders, per-step counts, durable pairs and newest steps, recounted from the live nodes'
    inventories."""
    holders: dict[str, dict[int, dict[int, dict[str, bool]]]] = {}
    for node in st.membership.nodes.values():
        for j, r, s, loc in node.inventory if node.alive else ():
            holders.setdefault(j, {}).setdefault(r, {}).setdefault(s, {})[node.name] = loc
    out = {}
    for name in st.jobs:
        job = st.jobs[name]
        covered: dict[int, int] = {}
        durable: dict[int, int] = {}
        pairs = set()
        newest: dict[int, int] = {}
        for r, by_step in holders.get(name, {}).items():
            if r < job.world_size:
                newest[max(by_step)] = newest.get(max(by_step), 0) + 1
            for s, h in by_step.items() if r < job.world_size else ():
                covered[s] = covered.get(s, 0) + 1
                copies = sum(1 for n, loc in h.items() if not loc and n != job.homes.get(r))
                if copies >= job.replicas:
                    durable[s] = durable.get(s, 0) + 1
                    pairs.add((r, s))
        out[name] = (holders.get(name, {}), covered, durable, pairs, newest)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_incremental_index_equals_a_recount_after_any_sequence_of_reports(seed: int) -> None:
    rnd = random.Random(seed)
    st = make(replicas=rnd.choice([1, 2]))
    nodes = [f"n{i}" for i in range(rnd.randint(2, 5))]
    for n in nodes:
        register(st, n, rack=rnd.choice(["", "r1", "r2"]))
    world, now = rnd.randint(1, 5), T0
    for _ in range(80):
        now += 0.1
        node = rnd.choice(nodes)
        w = world if rnd.random() > 0.05 else rnd.randint(1, 5)  # now and then a world size changes
        reported = rnd.sample(range(w), rnd.randint(0, w))
        items = [
            InventoryItem(rnd.choice("jk"), rnd.randrange(w), rnd.randint(1, 5), rnd.random() < 0.5)
            for _ in range(rnd.randint(0, 10))
        ]
        reply = beat(
            st,
            node,
            now,
            ranks("j", w, *reported, alive=rnd.random() > 0.1),
            items,
            changed=rnd.random() > 0.2,
        )
        if not reply.known:
            register(st, node, now)
        if rnd.random() < 0.1:
            st.expire(now + rnd.choice([0.0, 5.0]))
        for name, (holders, covered, durable, pairs, newest) in _index_from_scratch(st).items():
            job = st.jobs[name]
            assert (job.holders, job.covered, job.durable, job.durable_pairs) == (
                holders,
                covered,
                durable,
                pairs,
            )
            assert job.newest == newest


def test_a_job_no_live_node_reports_is_forgotten_after_a_while_and_one_still_held_is_not() -> None:
    st = CoordinatorState(CoordinatorConfig(heartbeat_timeout=3.0, forget_jobs_after=60.0), now=T0)
    two_node_job(st)  # job j on nodes a and b
    register(st, "c")
    beat(st, "c", T0, ranks("k", 1, 0), inv("k", 0, 1, local=True))  # job k on node c
    for t in range(2, 52, 2):  # a and b are dead from T0 + 4: nothing of j is reported by a live node
        keep_alive(st, T0 + t, "c")
    assert {j["job"] for j in st.status(T0 + 50.0)["jobs"]} == {"j", "k"}  # not yet: j is kept for 60 s
    for t in range(52, 82, 2):
        keep_alive(st, T0 + t, "c")
    assert {j["job"] for j in st.status(T0 + 80.0)["jobs"]} == {"k"}
    register(st, "a", T0 + 81.0, inc="i2")  # j starts again under its name: afresh
    beat(st, "a", T0 + 81.0, ranks("j", 1, 0), inv("j", 0, 1, local=True), inc="i2")
    assert {j["job"]: j["world_size"] for j in st.status(T0 + 81.0)["jobs"]} == {"j": 1, "k": 1}


def test_forget_jobs_after_must_be_a_positive_number() -> None:
    with pytest.raises(ValueError, match="forget_jobs_after"):
        CoordinatorConfig(forget_jobs_after=0)
