"""Plan requests covering several ranks: the state's answers, drafts confirmed or refused, held requests replaced,
and plan replies packed straight from rows, byte for byte what ``encode`` produces."""

from __future__ import annotations

import time

import pytest

from snapshotd.coordinator import CoordinatorState
from snapshotd.coordinator.held import HeldPlans
from snapshotd.coordinator.plans import PlanAnswer
from snapshotd.coordinator.replies import PlanReplies
from snapshotd.proto import (
    Heartbeat,
    HeartbeatReply,
    LimitExceeded,
    PlanReply,
    PlanRequest,
    RankPlan,
    decode,
    encode,
)
from snapshotd.proto import limits as L

from .scenario import LATER, T0, addr, beat, inv, make, ranks, register
from .test_server import TIMEOUT, dealer, start  # noqa: F401 (fixtures)
from .test_server import ask as server_ask
from .test_server import register as server_register


def four_rank_job(st: CoordinatorState) -> None:
    """Job j, world 4: ranks 0, 1 on a and 2, 3 on b, each node backing up the other's; step 5 everywhere."""
    for n in "ab":
        register(st, n)
    beat(
        st,
        "a",
        T0,
        ranks("j", 4, 0, 1),
        inv("j", 0, 5, local=True) + inv("j", 1, 5, local=True) + inv("j", 2, 5) + inv("j", 3, 5),
    )
    beat(
        st,
        "b",
        T0,
        ranks("j", 4, 2, 3),
        inv("j", 2, 5, local=True) + inv("j", 3, 5, local=True) + inv("j", 0, 5) + inv("j", 1, 5),
    )


def answer(st: CoordinatorState, req: PlanRequest, now: float, *, held: bool = False) -> PlanReply:
    """The state's answer to ``req``, as the reply it is sent as."""
    return st.plans.plan(req, now, held=held).reply()


def ask(node: str, *rs: int, world: int = 4) -> PlanRequest:
    return PlanRequest(job="j", rank=rs[0], world_size=world, node=node, ranks=rs[1:])


def summary(reply: PlanReply) -> list[tuple[int, str, int, bool, tuple[str, ...]]]:
    return [(p.rank, p.status, p.step, p.local, p.sources) for p in reply.answers()]


def test_a_request_for_several_ranks_waits_as_one_and_is_answered_per_rank() -> None:
    st = make()
    four_rank_job(st)
    register(st, "c")  # a replacement for b's ranks
    first = answer(st, ask("a", 0, 1), LATER)
    assert first.status == "wait" and first.plans == () and "2 of 4 ranks" in first.reason
    waits = answer(st, ask("c", 3, 2), LATER)  # b holds their own copies and is not declared dead yet
    assert waits.status == "wait" and "node b" in waits.reason
    # in the request's order; b taken at its word after the timeout
    last = answer(st, ask("c", 3, 2), LATER + 3.1)
    assert summary(last) == [
        (3, "ready", 5, False, (addr("a"), addr("b"))),
        (2, "ready", 5, False, (addr("a"), addr("b"))),
    ]
    again = answer(st, ask("a", 0, 1), LATER + 3.1, held=True)
    assert summary(again) == [(0, "ready", 5, True, (addr("b"),)), (1, "ready", 5, True, (addr("b"),))]


def test_a_request_with_a_rank_outside_the_world_or_twice_is_refused_and_records_nothing() -> None:
    st = make()
    four_rank_job(st)
    with pytest.raises(ValueError, match="rank 7 of job j is outside its world size 4"):
        answer(st, ask("a", 0, 7), LATER)
    with pytest.raises(ValueError, match=r"rank\(s\) 1 asked for twice"):
        answer(st, ask("a", 1, 0, 1), LATER)
    assert answer(st, ask("a", 0, 1), LATER).reason.startswith("2 of 4 ranks")  # neither was recorded


def test_a_rank_of_the_batch_answered_before_opens_a_new_round_for_all() -> None:
    st = make()
    four_rank_job(st)
    answer(st, ask("a", 0, 1), LATER)
    assert answer(st, ask("b", 2, 3), LATER).status == "ready"
    # not held: but every one of them not answered yet
    assert answer(st, ask("a", 1, 0), LATER).status == "ready"
    assert answer(st, ask("b", 3), LATER).status == "wait"  # rank 3 restarted: a new round


def test_a_draft_is_the_held_requests_answer_while_nothing_changes() -> None:
    st = make()
    four_rank_job(st)
    req = ask("a", 0, 1)
    assert answer(st, req, LATER).status == "wait"
    drafted = st.plans.draft(req)
    assert drafted is not None
    token, drafted_answer = drafted
    assert not st.plans.confirm(req, token, LATER)  # the round is not frozen yet
    answer(st, ask("b", 2, 3), LATER)  # the last ranks: frozen at step 5
    assert st.status(LATER + 1)["jobs"][0]["round"] == {
        "outcome": "ready",
        "step": 5,
        "asked": 4,
        "answered": 2,
        "age_s": 1.0,
        "answer_s": None,
    }
    assert st.plans.confirm(req, token, LATER + 0.25)
    # every rank answered, 0.25 s after the freeze
    assert st.status(LATER + 1)["jobs"][0]["round"]["answer_s"] == 0.25
    reply = answer(st, req, LATER, held=True)  # what the slow path answers, for comparison
    assert rows_of(drafted_answer.reply()) == rows_of(reply)


def test_a_draft_is_refused_once_holders_or_the_round_changed() -> None:
    st = make()
    four_rank_job(st)
    req = ask("a", 0, 1)
    answer(st, req, LATER)
    drafted = st.plans.draft(req)
    assert drafted is not None
    # b dropped its copy of rank 1: rank 1's sources change
    beat(
        st,
        "b",
        LATER,
        ranks("j", 4, 2, 3),
        inv("j", 2, 5, local=True) + inv("j", 3, 5, local=True) + inv("j", 0, 5),
    )
    answer(st, ask("b", 2, 3), LATER)
    assert not st.plans.confirm(req, drafted[0], LATER)
    assert summary(answer(st, req, LATER, held=True))[1] == (1, "ready", 5, True, ())
    # a new round: the old draft names the old round
    answer(st, ask("a", 0), LATER)
    redrafted = st.plans.draft(ask("a", 0))
    assert redrafted is not None and redrafted[0] != drafted[0]


def test_no_draft_without_a_recoverable_step_or_in_the_rebuild_window() -> None:
    st = make()
    four_rank_job(st)
    assert answer(st, ask("a", 0, 1), T0 + 1.0).status == "wait"  # rebuild window
    assert st.plans.draft(ask("a", 0, 1)) is None
    register(st, "c")
    answer(st, ask("c", 9, world=10), LATER)  # another world size: nothing is complete for ranks 4..9
    assert st.plans.draft(ask("c", 9, world=10)) is None


def test_a_held_request_is_replaced_by_one_of_the_same_peer_asking_for_all_its_ranks_and_more() -> None:
    held = HeldPlans(hold=1.5)
    env, other = [b"peer-1"], [b"peer-2"]
    one = held.hold(env, ask("a", 0), 0.0)
    two = held.hold(env, ask("a", 1), 0.0)
    elsewhere = held.hold(other, ask("b", 2, 3), 0.0)
    assert one and two and elsewhere and len(held) == 3
    both = held.hold(env, ask("a", 0, 1, 4), 0.1)  # replaces one and two, not the other peer's
    assert both and len(held) == 2
    fewer = held.hold(env, ask("a", 1), 0.2)  # does not cover 0 and 4: both stay held
    assert fewer and len(held) == 3
    assert [h.msg.all_ranks for h in held.take_expired(1.65, 10)] == [(2, 3), (0, 1, 4)]
    held.wake("j")
    assert [h.msg.all_ranks for h in held.due] == [(1,)] and len(held) == 1
    assert HeldPlans(hold=0.0).hold(env, ask("a", 0), 0.0) is None


def rows_of(reply: PlanReply) -> list:
    return [(p.rank, p.status, p.step, p.local, p.sources, p.reason) for p in reply.answers()]


def answer_of(reply: PlanReply) -> PlanAnswer:
    """The state's form of ``reply``: each rank's plan as a RankPlan's fields."""
    if reply.status == "wait":
        return PlanAnswer(reply.job, reply.rank, reason=reply.reason)
    return PlanAnswer(reply.job, reply.rank, plans=tuple(rows_of(reply)))


@pytest.mark.parametrize(
    "reply",
    [
        PlanReply(job="j", rank=3, status="ready", step=16, local=True, sources=()),
        PlanReply(
            job="j",
            rank=0,
            status="ready",
            step=16,
            local=False,
            sources=(addr("a"), addr("b")),
            plans=(
                RankPlan(1, "ready", 16, True, (addr("b"),), ""),
                RankPlan(2, "none", -1, False, (), "gone"),
            ),
        ),
        PlanReply(
            job="j",
            rank=0,
            status="fresh",
            step=0,
            reason="no snapshot yet",
            plans=(RankPlan(1, "fresh", 0, False, (), "no snapshot yet"),),
        ),
        PlanReply(job="j", rank=4, status="wait", reason="3 of 8 ranks accounted for"),
    ],
)
def test_plan_replies_are_what_encode_produces(reply: PlanReply) -> None:
    answer = answer_of(reply)
    assert answer.reply() == reply
    frame = PlanReplies().frame(answer)
    assert frame == bytes(encode(reply)[0])
    assert decode([frame]) == reply


def test_plan_replies_refuse_what_encode_would() -> None:
    replies = PlanReplies()
    sources = tuple(f"tcp://n{i}:1" for i in range(65))
    with pytest.raises(LimitExceeded, match="sources"):
        replies.frame(PlanAnswer("j", 0, plans=((0, "ready", 1, False, sources, ""),)))
    with pytest.raises(LimitExceeded):
        encode(PlanReply(job="j", rank=0, status="ready", step=1, sources=sources))
    with pytest.raises(LimitExceeded, match="plans"):
        replies.frame(
            PlanAnswer(
                "j", 0, plans=tuple((r, "ready", 1, True, (), "") for r in range(L.MAX_PLAN_RANKS + 1))
            )
        )


def test_the_server_answers_held_batches_from_their_drafts_when_the_last_ranks_ask(start, dealer) -> None:  # noqa: F811
    coord = start()
    nodes = {n: dealer(coord.endpoint) for n in "ab"}
    hb = {
        "a": Heartbeat(
            node="a",
            incarnation="i1",
            ranks=ranks("j", 4, 0, 1),
            inventory=inv("j", 0, 5, local=True) + inv("j", 1, 5, local=True) + inv("j", 2, 5),
        ),
        "b": Heartbeat(
            node="b",
            incarnation="i1",
            ranks=ranks("j", 4, 2, 3),
            inventory=inv("j", 2, 5, local=True) + inv("j", 3, 5, local=True) + inv("j", 0, 5),
        ),
    }

    def beat_all() -> None:
        for n, sock in nodes.items():
            reply = server_ask(sock, hb[n])
            assert isinstance(reply, HeartbeatReply) and reply.known

    for n, sock in nodes.items():
        server_register(sock, n)
    t0 = time.monotonic()
    while time.monotonic() - coord.started < 0.7:  # past the rebuild window
        beat_all()
        time.sleep(0.05)
    plan_a, plan_b = dealer(coord.endpoint), dealer(coord.endpoint)
    plan_a.send_multipart(encode(ask("a", 1)))
    plan_a.send_multipart(encode(ask("a", 0, 1)))  # rank 0 joined: replaces the held request for rank 1 alone
    beat_all()  # the server drafts held requests while idle
    assert not plan_a.poll(100), "a waiting request is held, not answered"
    plan_b.send_multipart(encode(ask("b", 2, 3)))
    assert plan_a.poll(int(TIMEOUT * 1000)) and plan_b.poll(int(TIMEOUT * 1000))
    reply_a, reply_b = decode(plan_a.recv_multipart()), decode(plan_b.recv_multipart())
    assert isinstance(reply_a, PlanReply) and isinstance(reply_b, PlanReply)
    assert summary(reply_a) == [(0, "ready", 5, True, ("tcp://b:1",)), (1, "ready", 5, True, ())]
    assert summary(reply_b) == [(2, "ready", 5, True, ("tcp://a:1",)), (3, "ready", 5, True, ())]
    assert not plan_a.poll(200), "the replaced request got no answer of its own"
    assert time.monotonic() - t0 < TIMEOUT


def test_a_peer_keeps_at_most_a_nodes_worth_of_held_requests() -> None:
    held = HeldPlans(hold=1.5)
    world = L.MAX_PLAN_RANKS + 2
    for r in range(L.MAX_PLAN_RANKS + 1):
        assert held.hold([b"peer"], ask("a", r, world=world), 0.0)
    assert len(held) == L.MAX_PLAN_RANKS
    held.wake("j")
    assert [h.msg.rank for h in held.due][:2] == [1, 2]  # the oldest (rank 0) was dropped
