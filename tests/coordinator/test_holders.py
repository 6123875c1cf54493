"""The holders of a step, as ``snapshotd export`` asks for them."""

from __future__ import annotations

from snapshotd.coordinator.holders import holders
from snapshotd.proto import Error, ErrorCode, HoldersQuery, HoldersReply

from .scenario import T0, addr, beat, inv, keep_alive, make, ranks, two_node_job


def _ask(st, **kw) -> HoldersReply | Error:
    return holders(st.jobs, st.membership, HoldersQuery(job=kw.pop("job", "j"), **kw))


def test_the_durable_step_by_default_buddy_copies_first() -> None:
    st = make()
    two_node_job(st)  # steps 5 and 6 local, 5 on the buddies: D = 5, G = 6
    reply = _ask(st)
    assert isinstance(reply, HoldersReply)
    assert (reply.step, reply.world_size, reply.recoverable, reply.durable) == (5, 2, 6, 5)
    assert reply.sources == ((addr("b"), addr("a")), (addr("a"), addr("b")))
    assert _ask(st, step=6).sources == ((addr("a"),), (addr("b"),))  # type: ignore[union-attr]
    assert _ask(st, step=7).sources == ((), ())  # type: ignore[union-attr]
    assert _ask(st, step=5, first=1, count=5).sources == ((addr("a"), addr("b")),)  # type: ignore[union-attr]


def test_a_dead_node_holds_nothing() -> None:
    st = make()
    two_node_job(st)
    keep_alive(st, T0 + 2.0, "a")
    keep_alive(st, T0 + 4.0, "a")  # b silent for 4 s: dead
    assert _ask(st, step=5).sources == ((addr("a"),), (addr("a"),))  # type: ignore[union-attr]


def test_unknown_job_no_durable_step_and_no_step_at_all() -> None:
    st = make()
    two_node_job(st)
    reply = _ask(st, job="nope")
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_FOUND and "no job 'nope'" in reply.message
    beat(st, "a", T0, ranks("k", 1, 0), inv("k", 0, 3, local=True))  # only the rank's own copy: G 3, no D
    reply = _ask(st, job="k")
    assert isinstance(reply, HoldersReply) and (reply.step, reply.recoverable, reply.durable) == (3, 3, -1)
    assert len(reply.sources) == 1 and len(reply.sources[0]) == 1
    beat(st, "b", T0, ranks("m", 1, 0))  # a rank that never snapshotted: nothing to export
    reply = _ask(st, job="m")
    assert isinstance(reply, HoldersReply) and (reply.step, reply.durable, reply.sources) == (-1, -1, ())


def test_a_stale_step_is_refused() -> None:
    st = make()
    two_node_job(st)
    st.jobs["j"].fork(5)  # a plan round froze at 5 while step 6 was held: 6 may be the failed run's
    reply = _ask(st, step=6)
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_FOUND and "stale" in reply.message
    assert isinstance(_ask(st, step=5), HoldersReply)
