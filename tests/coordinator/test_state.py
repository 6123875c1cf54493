"""CoordinatorState: placement, watermarks, expiry, incarnations, plans, re-replication, status (no sockets)."""

from __future__ import annotations

import logging
import random

import msgpack
import pytest

import snapshotd.coordinator.replication as replication_module
from snapshotd.coordinator import CoordinatorConfig, CoordinatorState
from snapshotd.proto import (
    Heartbeat,
    HeartbeatReply,
    InventoryItem,
    MemberQuery,
    PlanReply,
    PlanRequest,
    RankInfo,
    RegisterSidecar,
    ReplicateTask,
)

T0 = 1000.0
LATER = T0 + 10.0  # past the rebuild window (heartbeat_timeout 3 s)


def make(replicas: int = 1) -> CoordinatorState:
    return CoordinatorState(CoordinatorConfig(replicas=replicas, heartbeat_timeout=3.0), now=T0)


def addr(node: str) -> str:
    return f"tcp://{node}:9000"


def register(st: CoordinatorState, node: str, now: float = T0, rack: str = "", inc: str = "i1") -> None:
    reply = st.register(RegisterSidecar(node=node, rack=rack, data_addr=addr(node), incarnation=inc), now)
    assert reply.heartbeat_interval == 0.5


def ranks(job: str, world: int, *rs: int, alive: bool = True) -> tuple[RankInfo, ...]:
    return tuple(RankInfo(job=job, rank=r, world_size=world, pid=100 + r, alive=alive) for r in rs)


def inv(job: str, rank: int, *steps: int, local: bool = False) -> tuple[InventoryItem, ...]:
    return tuple(InventoryItem(job=job, rank=rank, step=s, local=local) for s in steps)


def beat(st: CoordinatorState, node: str, now: float, ranks=(), inventory=(), changed=True, inc="i1", **kw):
    msg = Heartbeat(node=node, incarnation=inc, changed=changed, ranks=tuple(ranks), inventory=tuple(inventory), **kw)
    return st.heartbeat(msg, now)


def keep_alive(st: CoordinatorState, now: float, *nodes: str) -> dict[str, HeartbeatReply]:
    """Run the expiry timer at ``now`` (tasks it issues go out with the replies), then heartbeat ``nodes``."""
    st.expire(now)
    return {n: beat(st, n, now, changed=False) for n in nodes}


def watermark(reply: HeartbeatReply, job: str = "j") -> tuple[int, int]:
    (wm,) = [w for w in reply.watermarks if w.job == job]
    return wm.recoverable, wm.durable


def plan(st: CoordinatorState, rank: int, node: str, now: float = LATER, world: int = 2, job: str = "j") -> PlanReply:
    return st.plans.plan(PlanRequest(job=job, rank=rank, world_size=world, node=node), now).reply()


def two_node_job(st: CoordinatorState) -> None:
    """Job j, world 2: rank 0 on a, rank 1 on b, each backing up the other; steps 5 and 6 local, 5 on buddies."""
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 5, 6, local=True) + inv("j", 1, 5))
    beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5))


# ------------------------------------------------------------------------------------------------ placement


def test_buddies_never_on_own_node_or_rack() -> None:
    st = make(replicas=2)
    for node, rack in (("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2"), ("e", "")):
        register(st, node, rack=rack)
    reply = beat(st, "a", T0, ranks("j", 3, 0))
    assert reply.assignments[0].buddies == (addr("c"), addr("d"))  # b shares a's rack
    reply = beat(st, "c", T0, ranks("j", 3, 1))
    assert reply.assignments[0].buddies == (addr("e"), addr("a"))  # d shares c's rack; e is its own rack
    reply = beat(st, "e", T0, ranks("j", 3, 2))
    assert reply.assignments[0].buddies == (addr("a"), addr("b"))  # ring wraps after e


def test_placement_recomputed_when_membership_changes() -> None:
    st = make()
    for n in "abc":
        register(st, n)
    assert beat(st, "a", T0, ranks("j", 1, 0)).assignments[0].buddies == (addr("b"),)
    keep_alive(st, T0 + 2.0, "a", "c")
    keep_alive(st, T0 + 4.0, "a", "c")  # b silent for 4 s > 3 s: dead
    assert beat(st, "a", T0 + 4.1, changed=False).assignments[0].buddies == (addr("c"),)
    register(st, "a2", now=T0 + 4.2)  # sorts between a and b
    assert beat(st, "a", T0 + 4.3, changed=False).assignments[0].buddies == (addr("a2"),)


def test_fewer_buddies_than_replicas_places_what_exists(caplog: pytest.LogCaptureFixture) -> None:
    st = make(replicas=2)
    for n in "abc":
        register(st, n, rack="r1" if n != "c" else "r2")
    with caplog.at_level(logging.WARNING):
        assert beat(st, "a", T0, ranks("j", 1, 0)).assignments[0].buddies == (addr("c"),)
        assert beat(st, "b", T0, ranks("k", 1, 0)).assignments[0].buddies == (addr("c"),)
    assert sum("placing fewer buddies" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------------------------------------ watermarks


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
    reply = beat(st, "b", T0 + 0.1, ranks("j", 2, 1), inv("j", 1, 7, 9, 11, local=True) + inv("j", 0, 7, 8, 10))
    assert reply.watermarks[0].unusable == (8, 9, 10)  # rank 1 passed 10 without it


def test_dead_node_expiry_drops_its_inventory_and_homes() -> None:
    st = make()
    two_node_job(st)
    keep_alive(st, T0 + 2.0, "a")
    keep_alive(st, T0 + 3.5, "a")  # b last seen at T0: dead
    reply = beat(st, "a", T0 + 3.6, changed=False)
    assert watermark(reply) == (5, -1)  # rank 1 only in a's buddy copy at 5; nothing off rank 0's home
    doc = st.status(T0 + 3.6)
    b = next(n for n in doc["nodes"] if n["node"] == "b")
    assert b["alive"] is False and b["ranks"] == [["j", 1, False]]
    job = doc["jobs"][0]
    assert [r["node"] for r in job["ranks"]] == ["a", None]
    assert beat(st, "b", T0 + 3.7, changed=False).known is False  # must register again


def test_status_parts_join_to_the_document_while_the_state_changes_between_them(monkeypatch) -> None:
    monkeypatch.setattr("snapshotd.coordinator.status.STATUS_PART_ENTRIES", 1)
    st = make()
    two_node_job(st)
    parts = st.status_parts(T0 + 1.0)
    made = [next(parts), next(parts)]  # the head and node a
    register(st, "c", now=T0 + 1.0)  # neither listed nor breaking the rest
    beat(st, "b", T0 + 1.0, ranks("j", 2, 1), inv("j", 1, 5, 6, 7, local=True) + inv("j", 0, 5))
    made += list(parts)
    assert len(made) == 8  # head, a, b, jobs, job j's head, rank 0, rank 1, its round
    doc = msgpack.unpackb(b"".join(made))
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]
    assert [r["newest_step"] for r in doc["jobs"][0]["ranks"]] == [6, 7]  # each entry read as it is packed
    assert doc["jobs"][0]["recoverable"] == 6 and doc["jobs"][0]["round"] is None
    assert st.status(T0 + 1.0)["nodes"][2]["node"] == "c"


def test_new_incarnation_drops_old_data() -> None:
    st = make()
    two_node_job(st)
    register(st, "b", now=T0 + 1.0, inc="i2")
    assert beat(st, "b", T0 + 1.1, changed=False, inc="i1").known is False  # the old process
    reply = beat(st, "b", T0 + 1.2, changed=False, inc="i2")
    assert reply.known and reply.assignments == () and reply.watermarks == ()
    assert watermark(beat(st, "a", T0 + 1.3, changed=False)) == (5, -1)


def test_same_incarnation_reregistering_keeps_data() -> None:
    st = make()
    two_node_job(st)
    register(st, "b", now=T0 + 1.0)  # e.g. its first registration reply was lost
    assert watermark(beat(st, "b", T0 + 1.1, changed=False)) == (6, 5)


def test_members_are_the_hosts_of_live_data_addresses() -> None:
    st = make()
    st.register(RegisterSidecar(node="a", data_addr="tcp://10.0.0.5:7071", incarnation="i1"), T0)
    st.register(RegisterSidecar(node="b", data_addr="tcp://10.0.0.6:7071", incarnation="i1"), T0)
    st.register(RegisterSidecar(node="c", data_addr="tcp://10.0.0.6:7072", incarnation="i1"), T0)  # same host
    assert st.membership.member(MemberQuery(host="10.0.0.5")).node == "a"
    assert st.membership.member(MemberQuery(host="10.0.0.6")).member
    assert not st.membership.member(MemberQuery(host="10.0.0.7")).member
    st.register(RegisterSidecar(node="d", data_addr="tcp://trainer-7:7071", incarnation="i1"), T0)  # a name
    assert not st.membership.member(MemberQuery(host="trainer-7")).member and not st.membership.member(MemberQuery(host="")).member
    st.register(RegisterSidecar(node="a", data_addr="tcp://10.0.0.8:7071", incarnation="i2"), T0 + 1.0)  # moved
    assert not st.membership.member(MemberQuery(host="10.0.0.5")).member
    assert st.membership.member(MemberQuery(host="10.0.0.8")).member
    keep_alive(st, T0 + 2.0, "a", "c")
    keep_alive(st, T0 + 3.5, "a", "c")  # b last seen at T0: dead; c still on its host
    assert st.membership.member(MemberQuery(host="10.0.0.6")).node == "c"
    keep_alive(st, T0 + 5.0, "a")
    keep_alive(st, T0 + 6.6, "a")  # c dead too
    reply = st.membership.member(MemberQuery(host="10.0.0.6"))
    assert not reply.member and reply.node == "" and reply.host == "10.0.0.6"


def test_unknown_node_gets_known_false() -> None:
    st = make()
    assert beat(st, "ghost", T0).known is False


def test_unchanged_heartbeat_keeps_ranks_and_inventory() -> None:
    st = make()
    two_node_job(st)
    reply = beat(st, "a", T0 + 0.5, changed=False)
    assert [a.rank for a in reply.assignments] == [0] and watermark(reply) == (6, 5)


def test_dead_rank_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    st = make()
    two_node_job(st)
    with caplog.at_level(logging.WARNING):
        beat(st, "b", T0 + 1.0, ranks("j", 2, 1, alive=False), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5))
        beat(st, "b", T0 + 1.5, ranks("j", 2, 1, alive=False), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5))
    assert [r.message for r in caplog.records if "died" in r.message] == ["rank 1 of job j on node b died (pid 101)"]


def test_live_report_keeps_the_home_against_a_dead_process_report() -> None:
    st = make()
    for n in "abc":
        register(st, n)
    beat(st, "a", T0, ranks("j", 1, 0))
    beat(st, "c", T0 + 1, ranks("j", 1, 0))  # the restarted rank on c: latest report wins
    beat(st, "a", T0 + 2, ranks("j", 1, 0, alive=False))  # a still lists the dead process
    assert st.status(T0 + 2)["jobs"][0]["ranks"][0]["node"] == "c"


def test_rank_outside_world_size_is_refused() -> None:
    st = make()
    register(st, "a")
    with pytest.raises(ValueError, match="outside its world size"):
        beat(st, "a", T0, (RankInfo(job="j", rank=4, world_size=4, pid=1, alive=True),))
    with pytest.raises(ValueError, match="outside its world size"):
        plan(st, 2, "a", world=2)


# ------------------------------------------------------------------------------------------------ plans


def test_plan_waits_for_every_rank_then_all_get_the_same_step() -> None:
    st = make()
    two_node_job(st)
    first = plan(st, 0, "a", now=LATER)
    assert first.status == "wait" and "1 of 2 ranks" in first.reason and "rank(s) 1" in first.reason
    # Seconds later, before rank 1 asks, new snapshots arrive: the plan is frozen only when rank 1 asks.
    beat(st, "a", LATER + 1, ranks("j", 2, 0), inv("j", 0, 6, 7, local=True) + inv("j", 1, 6))
    beat(st, "b", LATER + 1, ranks("j", 2, 1), inv("j", 1, 6, 7, local=True) + inv("j", 0, 6))
    second = plan(st, 1, "b", now=LATER + 3)
    assert (second.status, second.step) == ("ready", 7)
    # More snapshots arrive; rank 0's next poll still gets the frozen step.
    beat(st, "a", LATER + 4, ranks("j", 2, 0), inv("j", 0, 7, 8, local=True) + inv("j", 1, 7))
    beat(st, "b", LATER + 4, ranks("j", 2, 1), inv("j", 1, 7, 8, local=True) + inv("j", 0, 7))
    again = plan(st, 0, "a", now=LATER + 5)
    assert (again.status, again.step, again.local) == ("ready", 7, True)


def test_plan_local_flag_and_sources() -> None:
    st = make()
    two_node_job(st)
    register(st, "c")  # a replacement node for rank 1
    plan(st, 0, "a")
    on_c = plan(st, 1, "c")
    assert (on_c.status, on_c.step, on_c.local, on_c.sources) == ("ready", 6, False, (addr("b"),))
    on_a = plan(st, 0, "a")
    assert (on_a.local, on_a.sources) == (True, ())


def test_plan_sources_are_every_other_live_holder() -> None:
    st = make(replicas=2)
    for n in "abc":
        register(st, n)
    beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 4, local=True))
    beat(st, "b", T0, (), inv("j", 0, 4))
    beat(st, "c", T0, (), inv("j", 0, 4))
    for t in range(2, 11, 2):
        keep_alive(st, T0 + t, "b", "c")  # a (the rank's node) dies
    reply = plan(st, 0, "d", now=LATER, world=1)
    assert (reply.status, reply.step, reply.local, reply.sources) == ("ready", 4, False, (addr("b"), addr("c")))


def test_plan_fresh_when_no_snapshot_was_ever_seen() -> None:
    st = make()
    register(st, "a")
    assert plan(st, 0, "a").status == "wait"
    reply = plan(st, 1, "a")
    assert (reply.status, reply.step) == ("fresh", 0)
    assert plan(st, 0, "a").status == "fresh"


def test_plan_none_names_the_rank_without_snapshots() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 4, 0, 1, 2), inv("j", 0, 3, local=True) + inv("j", 1, 3, local=True)
         + inv("j", 2, 3, local=True))  # fmt: skip
    for r in range(3):
        assert plan(st, r, "a", world=4).status == "wait"
    reply = plan(st, 3, "b", world=4)
    assert reply.status == "none" and reply.step == -1
    assert "rank 3 has no complete snapshot on a live node" in reply.reason
    assert "disk checkpoint" in reply.reason


def test_plan_none_lists_what_each_rank_holds() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 9, 11, 12, local=True))
    beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 8, 10, local=True))
    assert plan(st, 0, "a").status == "wait"
    reply = plan(st, 1, "b")
    assert reply.status == "none"
    assert "rank 0 holds steps 9, 11, 12; rank 1 holds steps 8, 10;" in reply.reason


def test_answered_rank_asking_again_starts_a_new_round() -> None:
    st = make()
    two_node_job(st)
    plan(st, 0, "a")
    assert plan(st, 1, "b").status == "ready"
    assert plan(st, 0, "a").status == "ready"
    assert plan(st, 0, "a").status == "wait"  # rank 0 restarted again: everyone must ask again
    assert plan(st, 1, "b").status == "ready"


def test_rebuild_window_answers_wait() -> None:
    st = make()
    two_node_job(st)
    early = plan(st, 0, "a", now=T0 + 1.0)
    assert early.status == "wait" and "started" in early.reason
    assert plan(st, 1, "b", now=T0 + 2.0).status == "wait"  # not recorded: rank 0 must ask again
    keep_alive(st, T0 + 2.5, "a", "b")
    assert plan(st, 1, "b", now=T0 + 3.1).status == "wait"
    assert plan(st, 0, "a", now=T0 + 3.2).status == "ready"


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
    reply = beat(st, "b", LATER + 2, ranks("j", 2, 1), inv("j", 1, 6, 7, 8, local=True) + inv("j", 0, 6, 7, 8))
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


# ------------------------------------------------------------------------------------------------ re-replication


def replication_setup() -> CoordinatorState:
    """a hosts rank 0 with steps 5 local and on buddy b; c is spare; d shares a's rack."""
    st = make()
    for n, rack in (("a", "r1"), ("b", "r2"), ("c", "r3"), ("d", "r1")):
        register(st, n, rack=rack)
    beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 5, local=True))
    beat(st, "b", T0, (), inv("j", 0, 5))
    return st


def test_no_task_while_copies_suffice() -> None:
    st = replication_setup()
    replies = keep_alive(st, T0 + 1.0, "a", "b", "c", "d")
    assert all(r.tasks == () for r in replies.values())
    assert not any(keep_alive(st, T0 + 2.0, "a", "b", "c", "d")[n].tasks for n in "abcd")


def test_lost_home_is_replicated_at_once_and_not_reissued_within_the_window() -> None:
    st = replication_setup()
    keep_alive(st, T0 + 2.0, "b", "c", "d")
    replies = keep_alive(st, T0 + 3.5, "b", "c", "d")  # a dead: rank 0 step 5 has 1 of 2 copies, on b
    expected = ReplicateTask(job="j", rank=0, step=5, sources=(addr("b"),))
    assert replies["c"].tasks == (expected,)  # not d: a's rack
    assert replies["b"].tasks == replies["d"].tasks == ()
    for t in range(4, 14):  # remembered ~10 s
        assert all(r.tasks == () for r in keep_alive(st, T0 + t, "b", "c", "d").values())
    assert keep_alive(st, T0 + 14.0, "b", "c", "d")["c"].tasks == (expected,)  # still missing: again
    beat(st, "c", T0 + 14.5, (), inv("j", 0, 5))  # done
    for t in range(15, 30):
        assert all(r.tasks == () for r in keep_alive(st, T0 + t, "b", "c", "d").values())


def test_lost_buddy_waits_for_the_regular_stream_first() -> None:
    st = replication_setup()
    keep_alive(st, T0 + 2.0, "a", "c", "d")
    keep_alive(st, T0 + 3.5, "a", "c", "d")  # b dead: a's new buddy is c, a still holds step 5
    assert not any(keep_alive(st, T0 + 4.5, "a", "c", "d")[n].tasks for n in "acd")
    replies = keep_alive(st, T0 + 7.0, "a", "c", "d")  # the deficit outlived heartbeat_timeout
    assert replies["c"].tasks == (ReplicateTask(job="j", rank=0, step=5, sources=(addr("a"),)),)


def test_replication_prefers_assigned_buddies_then_racks_without_a_copy() -> None:
    st = make(replicas=2)
    for n, rack in (("a", "r1"), ("b", "r2"), ("c", "r2"), ("d", "r1"), ("e", "r3")):
        register(st, n, rack=rack)
    beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 5, local=True))  # a's buddies: b, c
    beat(st, "b", T0, (), inv("j", 0, 5))
    for t in (1.0, 2.5):  # G = 5 is first seen at T0 + 1: settling (the regular stream may land) until T0 + 4
        assert not any(r.tasks for r in keep_alive(st, T0 + t, "a", "b", "c", "d", "e").values())
    replies = keep_alive(st, T0 + 4.5, "a", "b", "c", "d", "e")  # 2 of 3 copies
    assert [n for n, r in replies.items() if r.tasks] == ["c"]  # the assigned buddy, though b shares its rack
    keep_alive(st, T0 + 6.0, "b", "c", "d", "e")
    replies = keep_alive(st, T0 + 7.6, "b", "c", "d", "e")  # a died: the copy on c is pending, one more needed
    assert [n for n, r in replies.items() if r.tasks] == ["e"]  # r3 holds no copy yet; never d (a's rack)


def test_sweep_runs_in_slices_one_per_expiry_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replication_module, "SWEEP_SLICE_RANKS", 2)
    st = make()
    for n, rack in (("a", "r1"), ("b", "r2"), ("c", "r3")):
        register(st, n, rack=rack)
    beat(st, "a", T0, ranks("j", 5, *range(5)), [i for r in range(5) for i in inv("j", r, 5, local=True)])
    beat(st, "b", T0, (), [i for r in range(5) for i in inv("j", r, 5)])
    for _ in range(3):  # one sweep, three slices: nothing is missing
        assert not any(r.tasks for r in keep_alive(st, T0 + 2.0, "b", "c").values())
    # a dies; the next sweep starts (a second after the last) and finds every rank with 1 of 2 copies, on b
    for t, expected in ((3.5, [0, 1]), (3.6, [2, 3]), (3.7, [4]), (3.8, [])):
        replies = keep_alive(st, T0 + t, "b", "c")
        assert [task.rank for task in replies["c"].tasks] == expected
        assert all(task.sources == (addr("b"),) for task in replies["c"].tasks) and not replies["b"].tasks


def test_no_target_outside_the_homes_rack_means_no_task() -> None:
    st = make()
    for n, rack in (("a", "r1"), ("b", "r2"), ("d", "r1")):
        register(st, n, rack=rack)
    beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 5, local=True))
    beat(st, "b", T0, (), inv("j", 0, 5))
    for t in range(1, 20):
        replies = keep_alive(st, T0 + t, "a", "d")  # b dies; only d, in a's rack, is left
        assert all(r.tasks == () for r in replies.values())


# ------------------------------------------------------------------------------------------------ status


def test_status_document() -> None:
    st = make()
    two_node_job(st)
    beat(st, "a", T0 + 1.0, changed=False, bytes_out=1000, bytes_in=10, stored_bytes=77)
    beat(st, "a", T0 + 3.0, changed=False, bytes_out=5000, bytes_in=20, stored_bytes=88)
    doc = st.status(T0 + 3.0)
    assert doc["coordinator"]["heartbeats"] == 4 and doc["coordinator"]["replicas"] == 1
    a = doc["nodes"][0]
    assert (a["node"], a["alive"], a["ranks"], a["stored_bytes"]) == ("a", True, [["j", 0, True]], 88)
    assert (a["out_Bps"], a["in_Bps"]) == (2000.0, 5.0)
    (job,) = doc["jobs"]
    assert (job["job"], job["world_size"], job["recoverable"], job["durable"]) == ("j", 2, 6, 5)
    assert job["ranks"][0] == {"rank": 0, "node": "a", "newest_step": 6, "lag_steps": 0, "copies": 1}
    assert job["round"] is None  # no rank asked for a plan yet
    plan(st, 0, "a")
    assert st.status(T0 + 3.0)["jobs"][0]["round"] == {
        "outcome": "asking", "step": -1, "asked": 1, "answered": 0, "age_s": None, "answer_s": None}


# ------------------------------------------------------------------------------------ heartbeat interval scaling


def test_interval_and_death_timeout_stretch_with_the_fleet_and_shrink_back_later() -> None:
    st = CoordinatorState(CoordinatorConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0,
                                            target_heartbeats_per_s=4.0), now=T0)  # fmt: skip
    told = [st.register(RegisterSidecar(node=n, data_addr=addr(n), incarnation="i1"), T0).heartbeat_interval
            for n in "abc"]  # fmt: skip
    assert told == [0.5, 0.5, 0.75]  # two nodes at 0.5 s make 4/s; three at 0.5 s would make 6/s
    assert beat(st, "a", T0).heartbeat_interval == 0.75  # told at once, in every reply while stretched
    register_any(st, "d")
    assert st.membership.heartbeat_interval() == 1.0 and st.membership.death_timeout(T0) == 6.0
    keep_alive(st, T0 + 5.5, "a", "b", "c", "d")  # silent for 5.5 s: alive under the stretched timeout
    assert st.status(T0 + 5.5)["coordinator"]["live_nodes"] == 4
    keep_alive(st, T0 + 9.0, "a", "b")
    replies = keep_alive(st, T0 + 12.0, "a", "b")  # c and d silent for 6.5 s: dead
    assert st.membership.heartbeat_interval() == 0.5 and replies["a"].heartbeat_interval == 0.5  # told the base once ...
    assert beat(st, "a", T0 + 12.1, changed=False).heartbeat_interval == 0.0  # ... then "keep yours"
    assert st.membership.death_timeout(T0 + 12.0) == 6.0  # kept while nodes may still heartbeat every second
    assert st.membership.death_timeout(T0 + 18.5) == 3.0
    assert st.status(T0 + 18.6)["coordinator"]["heartbeat_timeout"] == 3.0


def test_rebuild_window_stretches_with_the_fleet_and_never_reopens() -> None:
    st = CoordinatorState(CoordinatorConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0,
                                            target_heartbeats_per_s=2.0), now=T0)  # fmt: skip
    for n in "ab":
        register_any(st, n)
    assert st.membership.heartbeat_interval() == 1.0 and st.plans.rebuilding(T0 + 5.0)  # window 6 s with 2 nodes
    assert plan(st, 0, "a", now=T0 + 5.0).status == "wait"
    assert not st.plans.rebuilding(T0 + 6.1)
    for n in "cdefgh":
        register_any(st, n, T0 + 6.2)
    assert st.membership.death_timeout(T0 + 6.2) == 24.0 and not st.plans.rebuilding(T0 + 6.2)  # 8 nodes: 4 s, 24 s


def test_a_held_request_gets_its_rounds_answer_even_after_a_duplicate_was_answered() -> None:
    st = make()
    two_node_job(st)
    assert plan(st, 0, "a").status == "wait"
    step = plan(st, 1, "b").step
    assert plan(st, 0, "a").status == "ready"  # rank 0 answered (say, a duplicate of its request) ...
    again = st.plans.plan(PlanRequest(job="j", rank=0, world_size=2, node="a"), LATER, held=True).reply()
    assert (again.status, again.step) == ("ready", step)  # ... its held request: the same answer, no new round


def test_world_size_change_is_a_plan_change() -> None:
    st = make()
    two_node_job(st)
    st.jobs.plan_changes.clear()
    assert plan(st, 0, "a", world=3).status == "wait"
    assert st.jobs.plan_changes == {"j"}


def register_any(st: CoordinatorState, node: str, now: float = T0) -> None:
    st.register(RegisterSidecar(node=node, data_addr=addr(node), incarnation="i1"), now)


# ------------------------------------------------------------------------------------ index invariants


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
        items = [InventoryItem(rnd.choice("jk"), rnd.randrange(w), rnd.randint(1, 5), rnd.random() < 0.5)
                 for _ in range(rnd.randint(0, 10))]  # fmt: skip
        reply = beat(st, node, now, ranks("j", w, *reported, alive=rnd.random() > 0.1), items,
                     changed=rnd.random() > 0.2)  # fmt: skip
        if not reply.known:
            register(st, node, now)
        if rnd.random() < 0.1:
            st.expire(now + rnd.choice([0.0, 5.0]))
        for name, (holders, covered, durable, pairs, newest) in _index_from_scratch(st).items():
            job = st.jobs[name]
            assert (job.holders, job.covered, job.durable, job.durable_pairs) == (holders, covered, durable, pairs)
            assert job.newest == newest
