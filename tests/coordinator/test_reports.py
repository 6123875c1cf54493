"""Heartbeat ingest: a node's ranks and inventory, and the homes they move."""

from __future__ import annotations

import logging

import pytest

from snapshotd.proto import (
    RankInfo,
)

from .scenario import (
    T0,
    beat,
    inv,
    make,
    plan,
    ranks,
    register,
    two_node_job,
    watermark,
)


def test_unchanged_heartbeat_keeps_ranks_and_inventory() -> None:
    st = make()
    two_node_job(st)
    reply = beat(st, "a", T0 + 0.5, changed=False)
    assert [a.rank for a in reply.assignments] == [0] and watermark(reply) == (6, 5)


def test_dead_rank_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    st = make()
    two_node_job(st)
    with caplog.at_level(logging.WARNING):
        beat(st, "b", T0 + 1.0, ranks("j", 2, 1, alive=False), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5))
        beat(st, "b", T0 + 1.5, ranks("j", 2, 1, alive=False), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5))
    assert [r.message for r in caplog.records if "died" in r.message] == [
        "rank 1 of job j on node b died (pid 101)"
    ]


def test_live_report_keeps_the_home_against_a_dead_process_report() -> None:
    st = make()
    for n in "abc":
        register(st, n)
    beat(st, "a", T0, ranks("j", 1, 0))
    beat(st, "c", T0 + 1, ranks("j", 1, 0))  # the restarted rank on c: latest report wins
    beat(st, "a", T0 + 2, ranks("j", 1, 0, alive=False))  # a still lists the dead process
    assert st.status(T0 + 2)["jobs"][0]["ranks"][0]["node"] == "c"


def test_rank_outside_world_size_is_refused() -> None:
    st = make()
    register(st, "a")
    with pytest.raises(ValueError, match="outside its world size"):
        beat(st, "a", T0, (RankInfo(job="j", rank=4, world_size=4, pid=1, alive=True),))
    with pytest.raises(ValueError, match="outside its world size"):
        plan(st, 2, "a", world=2)
