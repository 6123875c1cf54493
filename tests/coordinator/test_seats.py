"""Seats: a node keeps its block of ranks, a new node takes the lowest free one, a spare waits for a node's death."""

from __future__ import annotations

import pytest

from snapshotd.coordinator import CoordinatorState
from snapshotd.proto import HeldSeat, SeatReply, SeatRequest

from .scenario import LATER, T0, beat, keep_alive, make, ranks, register


def seat(
    st: CoordinatorState,
    node: str,
    now: float = LATER,
    world: int = 4,
    per_node: int = 2,
    job: str = "j",
    held: int = -1,
    held_granted: int = 0,
) -> SeatReply:
    return st.seats.ask(
        SeatRequest(
            job=job, world_size=world, per_node=per_node, node=node, held=held, held_granted=held_granted
        ),
        now,
    )


def test_nodes_take_seats_in_order_of_asking_and_keep_them() -> None:
    st = make()
    for n in "abc":
        register(st, n)
    assert (seat(st, "b").status, seat(st, "b").first) == ("given", 0)
    assert seat(st, "a").first == 2
    assert seat(st, "b").first == 0 and seat(st, "a").first == 2  # asking again: the same seat
    spare = seat(st, "c")
    assert spare.status == "wait" and "all 2 seats of job j are held by live nodes" in spare.reason


def test_a_spare_takes_the_seat_of_the_node_that_died_and_the_others_keep_theirs() -> None:
    st = make()
    for n in "abc":
        register(st, n)
    seat(st, "a")
    seat(st, "b")
    beat(st, "a", T0, ranks("j", 4, 0, 1))
    beat(st, "b", T0, ranks("j", 4, 2, 3))
    assert seat(st, "c", now=LATER).status == "wait"
    for n in "ac":
        beat(st, n, LATER - 1, changed=False)
    st.expire(LATER)  # b silent since T0: dead past the 3 s timeout
    assert not st.membership.nodes["b"].alive
    assert (seat(st, "c").status, seat(st, "c").first) == ("given", 2)
    assert seat(st, "a").first == 0
    register(st, "b", now=LATER + 1, inc="i2")  # b comes back: its seat is taken
    assert seat(st, "b", now=LATER + 1).status == "wait"
    beat(st, "c", LATER + 1, ranks("j", 4, 2, 3), inc="i1")
    beat(st, "b", LATER + 1, ranks("j", 4, 2, 3), inc="i2")  # its old processes still report ranks 2 and 3
    taken = seat(st, "b", now=LATER + 1, held=2)  # its sidecar remembers seat 1: its woken processes are told
    assert taken.status == "taken", "it does not take the seat back"
    assert "seat 1 (ranks 2-3) of job j, which node b had, was given to node c" in taken.reason, taken.reason
    assert seat(st, "c", now=LATER + 1).first == 2


def test_after_a_coordinator_restart_a_node_gets_the_seat_its_sidecar_holds() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    assert seat(st, "b", now=T0 + 1, held=2).status == "wait"  # the rebuild window
    assert seat(st, "b", held=2).first == 2  # its ranks have not registered yet: the sidecar remembers
    assert seat(st, "a").first == 0
    assert seat(st, "a", held=3).first == 0, "a hint that is no seat's first rank is ignored"


def test_seats_held_by_reported_ranks_count_after_a_coordinator_restart() -> None:
    st = make()
    for n in "abc":
        register(st, n)
    # a node placed by its own index, or seated by the last coordinator
    beat(st, "a", T0, ranks("j", 4, 2, 3))
    during = seat(st, "c", now=T0 + 1)
    # the rebuild window: reports still coming
    assert during.status == "wait" and "restarted" in during.reason
    keep_alive(st, T0 + 2, "a", "b", "c")
    assert seat(st, "a").first == 2  # the seat of the ranks it reports
    assert seat(st, "c").first == 0
    assert seat(st, "b").status == "wait"


@pytest.mark.parametrize("order", ["replacement first", "woken node first"])
def test_a_restarted_coordinator_learns_seats_from_heartbeats_and_the_later_grant_holds(order: str) -> None:
    """b held seat 1, was declared dead and replaced by c (a later grant); the coordinator restarts; b wakes up.
    Both sidecars report seat 1 with their ranks, in either order: c keeps it, and b's processes asking again
    are told it was taken (not given it back, and not made to wait as a spare)."""
    first = make()
    for n in "abc":
        register(first, n)
    a, b = seat(first, "a"), seat(first, "b")
    assert b.first == 2 and b.granted > 0 and a.granted > 0
    for n in "ac":
        beat(first, n, LATER - 1, changed=False)
    first.expire(LATER)  # b silent since T0: dead
    c = seat(first, "c")
    assert c.first == 2 and c.granted > b.granted

    # the coordinator restarts: every sidecar registers again and reports its seats with its ranks
    st = make()
    for n in "abc":
        register(st, n)
    held = {
        "a": HeldSeat("j", 0, 2, 4, a.granted),
        "b": HeldSeat("j", 2, 2, 4, b.granted),
        "c": HeldSeat("j", 2, 2, 4, c.granted),
    }
    rank_of = {"a": (0, 1), "b": (2, 3), "c": (2, 3)}  # b's woken processes still report ranks 2 and 3
    for n in ("a", "c", "b") if order == "replacement first" else ("a", "b", "c"):
        beat(st, n, T0 + 1, ranks("j", 4, *rank_of[n]), seats=(held[n],))
    keep_alive(st, T0 + 3.5, "a", "b", "c")
    taken = seat(st, "b", held=2, held_granted=b.granted)
    assert taken.status == "taken" and "was given to node c" in taken.reason, taken
    again = seat(st, "c", held=2, held_granted=c.granted)
    assert (again.status, again.first, again.granted) == ("given", 2, c.granted)
    assert seat(st, "a", held=0, held_granted=a.granted).granted == a.granted


def test_a_seat_report_that_disagrees_with_the_job_or_reports_no_rank_of_it_is_ignored() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    assert seat(st, "a").first == 0
    beat(
        st,
        "b",
        T0 + 1,
        ranks("j", 4, 2),
        seats=(
            HeldSeat("j", 2, 4, 8, 5),
            HeldSeat("j", 1, 2, 4, 5),
            HeldSeat("j", 0, 2, 4, 9),
            HeldSeat("other", 0, 2, 4, 5),
        ),
    )
    assert st.seats._seats["j"].node_of == {0: "a"} and "other" not in st.seats._seats
    # nothing the reports said broke the job's seats
    assert seat(st, "a").first == 0 and seat(st, "b").first == 2


def test_a_node_given_back_a_seat_a_later_node_had_gets_a_fresh_grant_that_outranks_the_later_node() -> None:
    """a holds seat 0, dies, c takes it, dies too; a comes back and takes seat 0 again, then c comes back and
    reports seat 0 by its grant, which is later than a's first: a keeps the seat (its new grant is later still)
    and c is told it was taken."""
    st = make()
    for n in "abc":
        register(st, n)
    first = seat(st, "a")
    assert seat(st, "b").first == 2
    beat(st, "a", T0, ranks("j", 4, 0, 1))
    for n in "bc":
        beat(st, n, LATER - 1, changed=False)
    st.expire(LATER)  # a dead
    taken_over = seat(st, "c")
    assert taken_over.first == 0 and taken_over.granted > first.granted
    register(st, "a", now=LATER + 1, inc="i2")
    beat(st, "b", LATER + 4, changed=False)
    beat(st, "a", LATER + 4, changed=False, inc="i2")
    st.expire(LATER + 4.5)  # c dead (silent since its registration at T0)
    assert not st.membership.nodes["c"].alive and st.membership.nodes["a"].alive
    back = seat(st, "a", now=LATER + 4.5, held=0, held_granted=first.granted)
    assert back.first == 0 and back.granted > taken_over.granted, "a fresh grant, not a's old one"
    register(st, "c", now=LATER + 5, inc="i2")
    beat(st, "a", LATER + 5, ranks("j", 4, 0, 1), inc="i2", seats=(HeldSeat("j", 0, 2, 4, back.granted),))
    beat(
        st, "c", LATER + 5, ranks("j", 4, 0, 1), inc="i2", seats=(HeldSeat("j", 0, 2, 4, taken_over.granted),)
    )
    assert st.seats._seats["j"].node_of[0] == "a"
    told = seat(st, "c", now=LATER + 5, held=0, held_granted=taken_over.granted)
    assert told.status == "taken" and "was given to node a" in told.reason, told


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"world": 5, "per_node": 2}, "world size 5 is not a multiple of the 2 ranks per node"),
        ({"world": 6}, "job j's nodes asked for seats of 2 of 4 ranks, this one for 2 of 6"),
        ({"per_node": 4}, "this one for 4 of 4"),
    ],
)
def test_inconsistent_requests_are_refused_by_name_and_seats_kept(kw: dict[str, int], problem: str) -> None:
    st = make()
    for n in "ab":
        register(st, n)
    assert seat(st, "a").first == 0
    with pytest.raises(ValueError, match=problem):
        seat(st, "b", **kw)
    assert seat(st, "a").first == 0 and seat(st, "b").first == 2


def test_an_unknown_node_waits_and_a_world_size_other_than_the_jobs_is_refused() -> None:
    st = make()
    register(st, "a")
    ghost = seat(st, "ghost")  # a sidecar whose registration has not reached this coordinator yet
    assert ghost.status == "wait" and "node 'ghost' is not registered with the coordinator" in ghost.reason
    beat(st, "a", T0, ranks("j", 8, 0))
    with pytest.raises(ValueError, match="job j has 8 ranks, not 4"):
        seat(st, "a")


def test_a_forgotten_jobs_seats_are_dropped() -> None:
    st = make()
    for n in "ab":
        register(st, n)
    seat(st, "a")
    seat(st, "b")
    st.seats.forget("j")
    assert seat(st, "b").first == 0
