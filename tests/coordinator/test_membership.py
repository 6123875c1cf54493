"""Membership: expiry, incarnations, members, and the heartbeat interval and death timeout as the fleet grows."""

from __future__ import annotations

import pytest

from snapshotd.coordinator import CoordinatorConfig, CoordinatorState
from snapshotd.proto import (
    MemberQuery,
    RegisterSidecar,
)

from .scenario import (
    T0,
    addr,
    beat,
    keep_alive,
    make,
    plan,
    register,
    register_any,
    two_node_job,
    watermark,
)


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
    assert (
        not st.membership.member(MemberQuery(host="trainer-7")).member
        and not st.membership.member(MemberQuery(host="")).member
    )
    # moved
    st.register(RegisterSidecar(node="a", data_addr="tcp://10.0.0.8:7071", incarnation="i2"), T0 + 1.0)
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


def test_interval_and_death_timeout_stretch_with_the_fleet_and_shrink_back_later() -> None:
    st = CoordinatorState(
        CoordinatorConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0, target_heartbeats_per_s=4.0), now=T0
    )
    told = [
        st.register(RegisterSidecar(node=n, data_addr=addr(n), incarnation="i1"), T0).heartbeat_interval
        for n in "abc"
    ]
    assert told == [0.5, 0.5, 0.75]  # two nodes at 0.5 s make 4/s; three at 0.5 s would make 6/s
    assert beat(st, "a", T0).heartbeat_interval == 0.75  # told at once, in every reply while stretched
    register_any(st, "d")
    assert st.membership.heartbeat_interval() == 1.0 and st.membership.death_timeout(T0) == 6.0
    keep_alive(st, T0 + 5.5, "a", "b", "c", "d")  # silent for 5.5 s: alive under the stretched timeout
    assert st.status(T0 + 5.5)["coordinator"]["live_nodes"] == 4
    keep_alive(st, T0 + 9.0, "a", "b")
    replies = keep_alive(st, T0 + 12.0, "a", "b")  # c and d silent for 6.5 s: dead
    # told the base once ...
    assert st.membership.heartbeat_interval() == 0.5 and replies["a"].heartbeat_interval == 0.5
    assert beat(st, "a", T0 + 12.1, changed=False).heartbeat_interval == 0.0  # ... then "keep yours"
    assert st.membership.death_timeout(T0 + 12.0) == 6.0  # kept while nodes may still heartbeat every second
    assert st.membership.death_timeout(T0 + 18.5) == 3.0
    assert st.status(T0 + 18.6)["coordinator"]["heartbeat_timeout"] == 3.0


def test_rebuild_window_stretches_with_the_fleet_and_never_reopens() -> None:
    st = CoordinatorState(
        CoordinatorConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0, target_heartbeats_per_s=2.0), now=T0
    )
    for n in "ab":
        register_any(st, n)
    # window 6 s with 2 nodes
    assert st.membership.heartbeat_interval() == 1.0 and st.plans.rebuilding(T0 + 5.0)
    assert plan(st, 0, "a", now=T0 + 5.0).status == "wait"
    assert not st.plans.rebuilding(T0 + 6.1)
    for n in "cdefgh":
        register_any(st, n, T0 + 6.2)
    # 8 nodes: 4 s, 24 s
    assert st.membership.death_timeout(T0 + 6.2) == 24.0 and not st.plans.rebuilding(T0 + 6.2)


@pytest.mark.parametrize(
    "node, data_addr, incarnation",
    [
        ("", "tcp://a:1", "i1"),
        ("a", "tcp://a:1", ""),
        ("a", "fuzz-1", "i1"),
        ("a", "tcp://a", "i1"),
        ("a", "tcp://a:99999", "i1"),
        ("a", "", "i1"),
        ("a", "udp://a:1", "i1"),
        ("a", "tcp://::1:7071", "i1"),
    ],
)
def test_a_registration_the_coordinator_could_not_use_is_refused(
    node: str, data_addr: str, incarnation: str
) -> None:
    """A node registered with an address no sidecar can connect to was placed as a buddy all the same, and
    every snapshot streamed to it failed."""
    st = make()
    with pytest.raises(ValueError):
        st.register(RegisterSidecar(node=node, data_addr=data_addr, incarnation=incarnation), T0)
    assert not st.membership.nodes
    for good in (
        "tcp://10.0.0.2:41000",
        "tcp://node-7.cluster.local:7071",
        "tcp://[::1]:7071",
        "tcp://[fd00::2]:41000",
        "ipc:///tmp/x.data",
        "mem://b-data",
    ):
        st.register(RegisterSidecar(node="b", data_addr=good, incarnation="i1"), T0)


def test_time_the_coordinator_did_not_run_counts_against_no_node() -> None:
    """Stopped (SIGSTOP, a starved host) for longer than the death timeout, the coordinator hears nobody; when it
    runs again, that silence is pardoned: no node is declared dead for it, and a node silent before still is."""
    st = make()
    two_node_job(st)
    keep_alive(st, T0 + 2.0, "a")  # b was already silent for 2 s when the coordinator stopped
    st.membership.pardon(10.0, T0 + 12.0)  # stopped from T0 + 2 to T0 + 12
    st.expire(T0 + 12.1)
    assert [n["node"] for n in st.status(T0 + 12.1)["nodes"] if n["alive"]] == ["a", "b"]
    st.expire(T0 + 13.1)  # b's 2 s of silence before the stop and 1.1 s after: past the 3 s timeout
    assert [n["node"] for n in st.status(T0 + 13.1)["nodes"] if n["alive"]] == ["a"]
