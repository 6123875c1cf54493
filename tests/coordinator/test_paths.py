"""Broken paths: a pair of live nodes that cannot move snapshots to each other gets no buddy placed across it
while another node can take the copy, restore plans name holders across it last, and the status shows it."""

from __future__ import annotations

import logging

import msgpack
import pytest

from snapshotd.proto import PathTrouble
from snapshotd.status import render_status

from .scenario import LATER, T0, addr, beat, inv, keep_alive, make, plan, ranks, register


def _three():
    """Nodes a, b, c, each home to one rank of job j (world 3): a's buddy is b, b's c, c's a."""
    st = make()
    for n in "abc":
        register(st, n)
    for r, n in enumerate("abc"):
        beat(st, n, T0, ranks("j", 3, r))
    return st


def _assigned(st, node: str, unreachable: tuple[PathTrouble, ...] = ()) -> tuple[str, ...]:
    """The buddies of ``node``'s rank, from the reply to a heartbeat (which says what ``node`` cannot reach)."""
    (assignment,) = beat(st, node, T0 + 1, changed=False, unreachable=unreachable).assignments
    return assignment.buddies


def test_a_broken_pair_gets_no_buddy_across_it_and_gets_it_back_when_healed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="snapshotd.coordinator.paths")
    st = _three()
    assert _assigned(st, "a") == (addr("b"),)
    epoch = st.membership.epoch
    cut = (PathTrouble(addr=addr("b"), reason="unreachable: connecting to b:9000 timed out"),)
    beat(st, "a", T0 + 1, changed=False, unreachable=cut)
    assert st.membership.epoch == epoch + 1
    assert st.membership.paths.broken("b", "a")  # one side's report breaks the pair both ways
    assert _assigned(st, "a", cut) == (addr("c"),), "a's copies go to c, not across the broken pair"
    assert _assigned(st, "b") == (addr("c"),)
    assert "the snapshot path between nodes a and b is broken (a reports: unreachable" in caplog.text
    beat(st, "a", T0 + 2, changed=False, unreachable=cut)  # the same report again changes nothing
    assert st.membership.epoch == epoch + 1
    doc = msgpack.unpackb(b"".join(st.status_parts(T0 + 2)), raw=False)
    assert doc["broken_paths"] == [
        {"nodes": ["a", "b"], "reported_by": {"a": "unreachable: connecting to b:9000 timed out"}}
    ]
    text = render_status(doc)
    assert "1 broken snapshot path(s)" in text
    assert "a <-> b  (a: unreachable: connecting to b:9000 timed out)" in text
    beat(st, "a", T0 + 3, changed=False)  # healed
    assert not st.membership.paths.broken("a", "b")
    assert _assigned(st, "a") == (addr("b"),)
    assert "the snapshot path between nodes a and b healed" in caplog.text


def test_where_every_candidate_is_across_a_broken_pair_the_usual_buddy_stays() -> None:
    st = _three()
    slow = tuple(PathTrouble(addr=addr(n), reason="slow: no transfer completed for 2.0 s") for n in "bc")
    assert _assigned(st, "a", slow) == (addr("b"),), "a slow path still moves bytes: better than no buddy"
    assert st.membership.paths.broken("a", "b") and st.membership.paths.broken("a", "c")


def test_a_dead_nodes_reports_go_with_it_and_unknown_addresses_pair_nothing() -> None:
    st = _three()
    beat(
        st,
        "a",
        T0 + 1,
        changed=False,
        unreachable=(
            PathTrouble(addr=addr("b"), reason="unreachable: refused"),
            PathTrouble(addr="tcp://elsewhere:1", reason="unreachable: refused"),
        ),
    )
    assert st.membership.paths.pairs() == [
        {"nodes": ["a", "b"], "reported_by": {"a": "unreachable: refused"}}
    ]
    for n in "bc":
        beat(st, n, LATER - 1, changed=False)
    st.expire(LATER)  # a silent since T0 + 1: dead
    assert not st.membership.nodes["a"].alive
    assert not st.membership.paths


def test_a_restore_plan_names_no_holder_across_a_broken_pair_while_another_holds_the_step() -> None:
    st = make(replicas=2)
    for n in "abcd":
        register(st, n)
    beat(st, "a", T0, ranks("j", 1, 0), inv("j", 0, 4, local=True))
    beat(st, "b", T0, (), inv("j", 0, 4))
    beat(st, "c", T0, (), inv("j", 0, 4))
    cut_b = (PathTrouble(addr=addr("b"), reason="unreachable: x"),)
    for t in range(2, 11, 2):  # a (the rank's node) dies; d, its replacement, cannot reach b
        keep_alive(st, T0 + t, "b", "c")
        beat(st, "d", T0 + t, changed=False, unreachable=cut_b)
    reply = plan(st, 0, "d", now=LATER, world=1)
    assert (reply.status, reply.step, reply.sources) == ("ready", 4, (addr("c"),)), (
        "b holds the step too, but d cannot reach it"
    )
    beat(st, "d", LATER, changed=False, unreachable=cut_b + (PathTrouble(addr=addr("c"), reason="slow: y"),))
    reply = plan(st, 0, "d", now=LATER + 0.1, world=1)
    assert reply.sources == (addr("b"), addr("c")), (
        "where every holder is across a broken pair, all are named"
    )


def test_pairs_follow_the_live_set_a_report_naming_a_later_node_pairs_once_it_registers() -> None:
    st = make()
    register(st, "a")
    cut = (PathTrouble(addr=addr("b"), reason="unreachable: x"),)
    beat(st, "a", T0, changed=False, unreachable=cut)
    assert not st.membership.paths  # no live node at b's address yet
    register(st, "b")  # after a coordinator restart, nodes register in any order
    assert st.membership.paths.broken("a", "b")
    epoch = st.membership.epoch
    beat(st, "a", T0 + 0.5, changed=False, unreachable=(PathTrouble(addr=addr("b"), reason="slow: y"),))
    assert st.membership.epoch == epoch, "a new reason alone makes no placement anew"
    assert st.membership.paths.pairs() == [{"nodes": ["a", "b"], "reported_by": {"a": "slow: y"}}]
    beat(st, "a", LATER - 1, changed=False, unreachable=cut)
    st.expire(LATER)  # b silent since it registered: dead; the pair naming it goes
    assert not st.membership.nodes["b"].alive and not st.membership.paths
