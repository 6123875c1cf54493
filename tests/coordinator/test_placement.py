"""Buddy placement: never in the node's own failure domain, recomputed when membership changes."""

from __future__ import annotations

import logging

import pytest

from .scenario import (
    T0,
    addr,
    beat,
    keep_alive,
    make,
    ranks,
    register,
)


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
