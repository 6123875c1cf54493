"""Plan rounds: every rank waits for the others, then all get the same step; fresh, none and new rounds."""

from __future__ import annotations

from snapshotd.proto import (
    PlanRequest,
)

from .scenario import (
    LATER,
    T0,
    addr,
    beat,
    inv,
    keep_alive,
    make,
    plan,
    ranks,
    register,
    two_node_job,
)


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
    on_c = plan(st, 1, "c")  # b, holding rank 1's own copies, is not declared dead: the round waits for it
    assert on_c.status == "wait" and "node b" in on_c.reason and "declared dead" in on_c.reason, on_c.reason
    on_c = plan(st, 1, "c", now=LATER + 3.1)  # but no longer than the death timeout: b is taken at its word
    assert (on_c.status, on_c.step, on_c.local, on_c.sources) == ("ready", 6, False, (addr("b"),))
    on_a = plan(st, 0, "a", now=LATER + 3.1)
    assert (on_a.local, on_a.sources) == (True, ())


def test_a_rank_asking_from_a_new_node_waits_for_its_old_nodes_death() -> None:
    """A replacement that asks within the death timeout of its old node's loss (a warm spare) must not get a
    step that only the dead node held: its request waits, unrecorded, until the node is declared dead."""
    st = make()
    two_node_job(st)
    register(st, "c")
    assert plan(st, 0, "a").status == "wait"
    assert plan(st, 1, "c").status == "wait"
    # b is probed meanwhile (see test_probes)
    assert [(n.name, why) for n, why in st.membership.take_suspects(8)] == [
        ("b", "(rank 1 of job j asks from node c)")
    ]
    beat(st, "a", LATER + 0.4, ranks("j", 2, 0), inv("j", 0, 5, 6, local=True) + inv("j", 1, 5))
    beat(st, "c", LATER + 0.4, ranks("j", 2, 1), ())
    st.expire(LATER + 0.5)  # b's heartbeats stopped at T0: declared dead now
    on_c = plan(st, 1, "c", now=LATER + 0.5)
    assert on_c.status == "ready" and addr("b") not in on_c.sources, on_c


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
    assert (reply.status, reply.step, reply.local, reply.sources) == (
        "ready",
        4,
        False,
        (addr("b"), addr("c")),
    )


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
    beat(
        st,
        "a",
        T0,
        ranks("j", 4, 0, 1, 2),
        inv("j", 0, 3, local=True) + inv("j", 1, 3, local=True) + inv("j", 2, 3, local=True),
    )
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


def test_a_held_request_gets_its_rounds_answer_even_after_a_duplicate_was_answered() -> None:
    st = make()
    two_node_job(st)
    assert plan(st, 0, "a").status == "wait"
    step = plan(st, 1, "b").step
    assert plan(st, 0, "a").status == "ready"  # rank 0 answered (say, a duplicate of its request) ...
    again = st.plans.plan(PlanRequest(job="j", rank=0, world_size=2, node="a"), LATER, held=True).reply()
    # ... its held request: the same answer, no new round
    assert (again.status, again.step) == (
        "ready",
        step,
    )


def test_a_request_repeated_under_its_attempt_gets_its_answer_again_and_another_attempt_opens_a_round() -> (
    None
):
    st = make()
    two_node_job(st)

    def ask(rank: int, node: str, attempt: int) -> tuple[str, int]:
        reply = st.plans.plan(
            PlanRequest(job="j", rank=rank, world_size=2, node=node, attempt=attempt), LATER
        ).reply()
        return reply.status, reply.step

    assert ask(0, "a", 11)[0] == "wait"
    step = ask(1, "b", 22)[1]
    assert ask(0, "a", 11) == ("ready", step)  # answered under 11
    assert ask(0, "a", 11) == ("ready", step)  # its reply was lost: asked again under 11, the same answer
    assert ask(1, "b", 22) == ("ready", step)  # no new round was opened: rank 1's repeat is answered too
    assert ask(0, "a", 33)[0] == "wait"  # a new call (rank 0 restarted): a new round, which waits for rank 1
    assert ask(1, "b", 22) == ("ready", step)  # rank 1 was not answered in it: its ask completes the round


def test_world_size_change_is_a_plan_change() -> None:
    st = make()
    two_node_job(st)
    st.jobs.plan_changes.clear()
    assert plan(st, 0, "a", world=3).status == "wait"
    assert st.jobs.plan_changes == {"j"}
