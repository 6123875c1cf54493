"""Draining: a stopping node leaves placement at once, what only it holds is placed elsewhere (pulled from it), and
the reply to its drain counts what is left."""

from __future__ import annotations

from snapshotd.proto import Drain, DrainReply, Error, ErrorCode, ReplicateTask

from .scenario import T0, addr, beat, inv, keep_alive, make, ranks, register


def _drain(st, node: str, inc: str = "i1") -> DrainReply | Error:
    return st.drain(Drain(node=node, incarnation=inc))


def _setup():
    """a hosts rank 0 (step 5 local, copy on b); b hosts rank 1 (step 5 local, copy on c); c is also spare."""
    st = make()
    for n in "abc":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 5, local=True))
    beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 5, local=True) + inv("j", 0, 5))
    beat(st, "c", T0, (), inv("j", 1, 5))
    return st


def test_a_leaving_node_leaves_placement_and_its_copies_are_placed_on_nodes_that_stay_before_it_drains() -> (
    None
):
    st = _setup()
    assert st.placement.buddies("a") == ("b",)
    # b holds rank 1's home copy and rank 0's buddy copy: without b each has one copy on a node that stays, and c
    # (rank 0) and a (rank 1) can take another
    assert _drain(st, "b") == DrainReply(remaining=2, unplaceable=0)
    assert (
        "b" not in st.membership.ring and st.membership.nodes["b"].alive and st.membership.nodes["b"].leaving
    )
    assert st.placement.buddies("a") == ("c",)  # a's stream goes to c from now on, not to b
    # b's copies count as sources only: rank 1's copy is placed at once (its home is leaving), rank 0's once its
    # home's stream to its new buddy had time to land
    replies = keep_alive(st, T0 + 1.0, "a", "b", "c")
    assert replies["a"].tasks == (ReplicateTask(job="j", rank=1, step=5, sources=(addr("b"), addr("c"))),)
    assert replies["b"].tasks == replies["c"].tasks == ()
    keep_alive(st, T0 + 2.5, "a", "b", "c")
    replies = keep_alive(st, T0 + 4.5, "a", "b", "c")
    assert replies["c"].tasks == (ReplicateTask(job="j", rank=0, step=5, sources=(addr("a"), addr("b"))),)
    assert replies["b"].tasks == ()  # nothing new for the leaving node
    beat(st, "a", T0 + 5.0, ranks("j", 2, 0), inv("j", 0, 5, local=True) + inv("j", 1, 5))
    assert _drain(st, "b") == DrainReply(remaining=1, unplaceable=0)  # rank 0's copy has not landed yet
    beat(st, "c", T0 + 5.0, (), inv("j", 1, 5) + inv("j", 0, 5))
    assert _drain(st, "b") == DrainReply(remaining=0, unplaceable=0)


def test_a_copy_that_cannot_be_placed_is_not_waited_for_unless_it_is_the_last() -> None:
    st = _setup()
    assert _drain(st, "c") == DrainReply(remaining=1, unplaceable=0)  # rank 1: a can take a copy
    # b leaves too: rank 1's copies are on b and c, both leaving, and a can take one; rank 0's are on a and b, and
    # the one node that stays is its home: nowhere to place another, and a copy stays
    assert _drain(st, "b") == DrainReply(remaining=1, unplaceable=0)
    beat(st, "a", T0 + 0.5, ranks("j", 2, 0), inv("j", 0, 5, local=True) + inv("j", 1, 5))  # rank 1's landed
    # a is the only node that stays: rank 0 and rank 1 have one copy each there and nowhere else to go
    assert _drain(st, "b") == DrainReply(remaining=0, unplaceable=0)
    assert _drain(st, "c") == DrainReply(remaining=0, unplaceable=0)


def test_with_every_node_leaving_nothing_is_placeable_and_the_drain_ends_at_once() -> None:
    st = _setup()
    for n in "abc":
        _drain(st, n)
    assert st.membership.ring == []
    # rank 0: a and b, both leaving; no target
    assert _drain(st, "a") == DrainReply(remaining=0, unplaceable=1)
    assert not any(r.tasks for r in keep_alive(st, T0 + 1.0, "a", "b", "c").values())


def test_a_leaving_node_that_stops_is_dead_and_one_restarted_stays_again() -> None:
    st = _setup()
    _drain(st, "b")
    keep_alive(st, T0 + 2.0, "a", "c")
    keep_alive(st, T0 + 3.5, "a", "c")  # b's heartbeats stopped: it left
    assert not st.membership.nodes["b"].alive and not st.membership.nodes["b"].leaving
    register(st, "b", T0 + 4.0, inc="i2")  # a new incarnation: a member again
    assert "b" in st.membership.ring

    _drain(st, "c")
    # restarted while draining (a new incarnation before it was declared dead)
    register(st, "c", T0 + 4.5, inc="i2")
    assert "c" in st.membership.ring and not st.membership.nodes["c"].leaving


def test_an_unknown_node_or_incarnation_is_told_to_register_first() -> None:
    st = _setup()
    for node, inc in (("zz", "i1"), ("a", "old")):
        reply = _drain(st, node, inc)
        assert (
            isinstance(reply, Error)
            and reply.code == ErrorCode.NOT_REGISTERED
            and "register first" in reply.message
        )
    assert "a" in st.membership.ring  # nothing changed


def test_a_rank_whose_process_ended_still_gets_its_copies_placed_from_a_leaving_node() -> None:
    """Rank 0's process on h has ended (no live home); its step 5 is on h and l. l leaves: c can take a copy."""
    st = make()
    for n in ("h", "l", "c"):
        register(st, n)
    beat(st, "h", T0, ranks("j", 1, 0, alive=False), inv("j", 0, 5, local=True))
    beat(st, "l", T0, (), inv("j", 0, 5))
    beat(st, "c", T0, ())
    assert _drain(st, "l") == DrainReply(remaining=1, unplaceable=0)
    # h is still the rank's home, so the sweep first waits for its stream (as for any deficit)
    for t in (
        1.0,
        2.5,
    ):
        keep_alive(st, T0 + t, "h", "l", "c")
    tasks = keep_alive(st, T0 + 4.5, "h", "l", "c")["c"].tasks
    assert tasks == (ReplicateTask(job="j", rank=0, step=5, sources=(addr("h"), addr("l"))),)


def test_a_rank_beyond_the_world_size_is_not_counted() -> None:
    """The job shrank to one rank: rank 1's copies are kept by nobody's sweep, so a drain does not wait for them."""
    st = _setup()
    beat(st, "a", T0 + 0.5, ranks("j", 1, 0), inv("j", 0, 5, local=True))
    assert st.jobs["j"].world_size == 1
    assert _drain(st, "c") == DrainReply(remaining=0, unplaceable=0)  # c holds only rank 1's copy
