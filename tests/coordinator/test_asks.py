"""Held asks: a seat request or drain waits at the coordinator while its answer says "not yet", and is answered
when it changes, when its hold is over, or with the error it would get now should the state refuse it."""

from __future__ import annotations

from snapshotd.coordinator.asks import ANSWER_MARGIN_S, HeldAsks
from snapshotd.proto import Drain, DrainReply, Error, ErrorCode, SeatReply, SeatRequest

from .scenario import LATER, T0, beat, inv, make, ranks, register

J = {"job": "j", "world_size": 4, "per_node": 2}
K = {"job": "k", "world_size": 2, "per_node": 1}


def _seated():
    """a and b hold the seats of job j (two ranks each) and of job k (one each); c is a spare."""
    st = make()
    for n in "abc":
        register(st, n)
    beat(st, "a", T0, ranks("j", 4, 0, 1) + ranks("k", 2, 0))
    beat(st, "b", T0, ranks("j", 4, 2, 3) + ranks("k", 2, 1))
    for n in "ab":
        for seat in (J, K):
            assert st.seats.ask(SeatRequest(node=n, **seat), LATER).status == "given"
    return st


def test_a_held_ask_the_state_now_refuses_is_answered_with_that_error_and_the_others_stay_held() -> None:
    st = _seated()
    asks = HeldAsks(st, hold=10.0)
    assert asks.answer([b"c1"], SeatRequest(node="c", request_id=7, **J), LATER) is None
    assert asks.answer([b"c2"], SeatRequest(node="c", **K), LATER) is None
    assert asks.due(LATER + 0.1) == [] and len(asks) == 2
    beat(st, "a", LATER, ranks("j", 8, 0, 1))  # job j restarted with 8 ranks: c's ask for it no longer fits
    ((envelope, reply),) = asks.due(LATER + 0.2)
    assert envelope == [b"c1"]
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_MESSAGE and reply.request_id == 7
    assert "job j has 8 ranks, not 4" in reply.message
    assert len(asks) == 1, "the ask for job k stays held"
    ((envelope, reply),) = asks.due(LATER + 10.0)  # its hold is over
    assert envelope == [b"c2"] and isinstance(reply, SeatReply) and reply.status == "wait"


def test_an_ask_is_held_a_margin_less_than_its_asker_waits_and_expired_ones_are_answered_alone() -> None:
    st = make()  # a and b hold job k's seats and rank 0's and 1's step 5, b rank 0's only other copy
    for n in "abc":
        register(st, n)
    beat(st, "a", T0, ranks("k", 2, 0), inv("k", 0, 5, local=True))
    beat(st, "b", T0, ranks("k", 2, 1), inv("k", 1, 5, local=True) + inv("k", 0, 5))
    beat(st, "c", T0, (), inv("k", 1, 5))
    for n in "ab":
        assert st.seats.ask(SeatRequest(node=n, **K), LATER).status == "given"
    asks = HeldAsks(st, hold=10.0)
    assert asks.answer([b"d"], Drain(node="b", incarnation="i1", timeout_s=1.0), LATER) is None
    assert asks.answer([b"s"], SeatRequest(node="c", timeout_s=5.0, **K), LATER) is None
    assert asks.answer([b"t"], SeatRequest(node="c", timeout_s=ANSWER_MARGIN_S, **K), LATER) is not None, (
        "an ask that waits no longer than the margin is answered at once"
    )
    assert asks.due(LATER + 1.0 - ANSWER_MARGIN_S - 0.01, expired_only=True) == []
    ((envelope, reply),) = asks.due(LATER + 1.0 - ANSWER_MARGIN_S, expired_only=True)
    assert envelope == [b"d"] and reply == DrainReply(remaining=2, unplaceable=0)
    ((envelope, reply),) = asks.due(LATER + 5.0 - ANSWER_MARGIN_S, expired_only=True)
    assert envelope == [b"s"] and isinstance(reply, SeatReply) and reply.status == "wait"
    assert len(asks) == 0
