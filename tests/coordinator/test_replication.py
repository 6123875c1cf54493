"""Re-replication: tasks for every rank short of copies, issued a slice of the sweep at a time."""

from __future__ import annotations

import pytest

import snapshotd.coordinator.replication as replication_module
from snapshotd.coordinator import CoordinatorState
from snapshotd.proto import (
    ReplicateTask,
)

from .scenario import (
    T0,
    addr,
    beat,
    inv,
    keep_alive,
    make,
    ranks,
    register,
)


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
    # a died: the copy on c is pending, one more needed
    replies = keep_alive(st, T0 + 7.6, "b", "c", "d", "e")
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


def _two_holders_and_a_spare() -> CoordinatorState:
    """a (r1) hosts rank 0 with step 5 local; b (r2) and e (r4) hold copies (replicas=2); c (r3) is spare."""
    st = make(replicas=2)
    for n, rack in (("a", "r1"), ("b", "r2"), ("c", "r3"), ("e", "r4")):
        register(st, n, rack=rack)
    beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 5, local=True))
    beat(st, "b", T0, (), inv("j", 0, 5))
    beat(st, "e", T0, (), inv("j", 0, 5))
    return st


def _tasks_after_a_dies(st: CoordinatorState, unreachable_from_c: tuple) -> list[ReplicateTask]:
    """The tasks every node gets while a is silent long enough to die, c reporting ``unreachable_from_c``."""
    tasks: list[ReplicateTask] = []
    for t in (2.0, 3.5, 5.0):
        st.expire(T0 + t)
        for n in "be":
            tasks += beat(st, n, T0 + t, changed=False).tasks
        tasks += beat(st, "c", T0 + t, changed=False, unreachable=unreachable_from_c).tasks
    return tasks


def test_a_replication_pulls_from_the_holders_its_target_reaches() -> None:
    from snapshotd.proto import PathTrouble

    st = _two_holders_and_a_spare()
    cut = (PathTrouble(addr=addr("e"), reason="unreachable: x"),)
    tasks = _tasks_after_a_dies(
        st, cut
    )  # rank 0 step 5 has 2 of 3 copies; c, the one node left, cannot reach e
    assert tasks == [ReplicateTask(job="j", rank=0, step=5, sources=(addr("b"),))]


def test_no_replication_goes_to_a_node_that_reaches_no_holder() -> None:
    from snapshotd.proto import PathTrouble

    st = _two_holders_and_a_spare()
    cut = tuple(PathTrouble(addr=addr(n), reason="unreachable: x") for n in "be")
    tasks = _tasks_after_a_dies(st, cut)  # c, the one node left, reaches neither holder
    assert tasks == [], "its pull could not succeed: no task, rather than one retried every 10 s"
