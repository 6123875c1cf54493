"""The status document, and its parts while the state changes between them."""

from __future__ import annotations

import msgpack

from snapshotd.coordinator.status import missing_ranges

from .scenario import (
    T0,
    beat,
    inv,
    make,
    plan,
    ranks,
    register,
    two_node_job,
)


def test_status_parts_join_to_the_document_while_the_state_changes_between_them(monkeypatch) -> None:
    monkeypatch.setattr("snapshotd.coordinator.status.STATUS_PART_ENTRIES", 1)
    st = make()
    two_node_job(st)
    parts = st.status_parts(T0 + 1.0)
    made = [next(parts), next(parts)]  # the head and node a
    register(st, "c", now=T0 + 1.0)  # neither listed nor breaking the rest
    beat(st, "b", T0 + 1.0, ranks("j", 2, 1), inv("j", 1, 5, 6, 7, local=True) + inv("j", 0, 5))
    made += list(parts)
    assert len(made) == 8  # head, a, b, jobs, job j's head, rank 0, rank 1, its round
    doc = msgpack.unpackb(b"".join(made))
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]
    assert [r["newest_step"] for r in doc["jobs"][0]["ranks"]] == [6, 7]  # each entry read as it is packed
    assert doc["jobs"][0]["recoverable"] == 6 and doc["jobs"][0]["round"] is None
    assert st.status(T0 + 1.0)["nodes"][2]["node"] == "c"


def test_status_document() -> None:
    st = make()
    two_node_job(st)
    beat(st, "a", T0 + 1.0, changed=False, bytes_out=1000, bytes_in=10, stored_bytes=77)
    beat(st, "a", T0 + 3.0, changed=False, bytes_out=5000, bytes_in=20, stored_bytes=88)
    doc = st.status(T0 + 3.0)
    assert doc["coordinator"]["heartbeats"] == 4 and doc["coordinator"]["replicas"] == 1
    a = doc["nodes"][0]
    assert (a["node"], a["alive"], a["ranks"], a["stored_bytes"]) == ("a", True, [["j", 0, True]], 88)
    assert (a["out_Bps"], a["in_Bps"]) == (2000.0, 5.0)
    (job,) = doc["jobs"]
    assert (job["job"], job["world_size"], job["recoverable"], job["durable"]) == ("j", 2, 6, 5)
    assert job["ranks"][0] == {
        "rank": 0,
        "node": "a",
        "newest_step": 6,
        "lag_steps": 0,
        "copies": 1,
        "rpo_s": job["ranks"][0]["rpo_s"],
    }  # (checked below)
    assert job["round"] is None and job["plan_rounds"] == 0  # no rank asked for a plan yet
    # G grew from 4 to 6 in 0.5 s (0.25 s a step); rank 0 trains on to step 8: a failure now costs it 2 steps, 0.5 s
    st.jobs["j"].g_seen.clear()
    st.jobs["j"].g_seen.extend([(100.0, 4), (100.5, 6)])
    beat(st, "a", T0 + 3.0, ranks("j", 2, 0), inv("j", 0, 6, 7, 8, local=True) + inv("j", 1, 5))
    job = st.status(T0 + 3.0)["jobs"][0]
    assert job["recoverable"] == 6
    assert (job["ranks"][0]["lag_steps"], job["ranks"][0]["rpo_s"]) == (2, 0.5)
    assert (job["ranks"][1]["lag_steps"], job["ranks"][1]["rpo_s"]) == (0, 0.0)
    plan(st, 0, "a")
    assert st.status(T0 + 3.0)["jobs"][0]["round"] == {
        "outcome": "asking",
        "step": -1,
        "asked": 1,
        "answered": 0,
        "age_s": None,
        "answer_s": None,
    }


def test_a_world_size_alone_never_lengthens_the_document() -> None:
    """A plan request claiming a world size of a million for a new job listed a million ranks, and two of them
    made the document too large to send at all: ranks no node reported are ranges now."""
    st = make()
    two_node_job(st)
    plan(st, 0, "a", job="huge", world=1 << 20)
    doc = st.status(T0 + 1.0)
    huge = next(j for j in doc["jobs"] if j["job"] == "huge")
    assert huge["world_size"] == 1 << 20 and huge["ranks"] == [] and huge["missing"] == [[0, (1 << 20) - 1]]
    j = next(j for j in doc["jobs"] if j["job"] == "j")
    assert [r["rank"] for r in j["ranks"]] == [0, 1] and j["missing"] == []
    assert len(msgpack.packb(doc)) < 4096


def test_missing_ranges() -> None:
    assert missing_ranges([], 3) == [[0, 2]]
    assert missing_ranges([0, 1, 2], 3) == []
    assert missing_ranges([1, 4, 5], 8) == [[0, 0], [2, 3], [6, 7]]


def test_status_renders_as_plain_text_tables() -> None:
    from snapshotd.status import render_status

    st = make()
    two_node_job(st)
    text = render_status(st.status(T0 + 1.0))
    lines = text.splitlines()
    assert lines[0].startswith("coordinator: up ") and "replicas 1" in lines[0]
    assert lines[2].split() == [
        "NODE",
        "RACK",
        "STATE",
        "SEEN",
        "RANKS",
        "STORED",
        "OUT",
        "IN",
        "PACE",
        "DATA",
    ]
    assert lines[3].split()[:3] == ["a", "-", "live"] and "unpaced" in lines[3]
    assert "job j: world size 2, recoverable step G = 6" in text
    header = next(
        i for i, ln in enumerate(lines) if ln.split() == ["RANK", "NODE", "NEWEST", "RPO", "COPIES"]
    )
    assert lines[header + 1].split()[:5] == ["0", "a", "6", "0", "steps"]
    assert "\x1b" not in text and all(ln == ln.rstrip() for ln in lines)  # no colour, no trailing blanks
    assert render_status(st.status(T0 + 1.0)) == text  # deterministic
    # a node's pacer, as its heartbeats tell it: the limit, and the step slowdown against the budget
    beat(
        st,
        "b",
        T0 + 1.0,
        changed=False,
        pace_Bps=300_000_000,
        step_budget_ppm=10_000,
        step_slowdown_ppm=4_000,
    )
    (row,) = [ln for ln in render_status(st.status(T0 + 1.0)).splitlines() if ln.startswith("b ")]
    assert "300.0 MB/s, steps +0.4% of 1.0%" in row
    st.jobs["j"].g_seen.clear()
    st.jobs["j"].g_seen.extend([(100.0, 4), (100.5, 6)])
    beat(st, "a", T0 + 1.0, ranks("j", 2, 0), inv("j", 0, 6, 7, 8, local=True) + inv("j", 1, 5))
    lines = render_status(st.status(T0 + 1.0)).splitlines()
    assert lines[header + 1].split() == [
        "0",
        "a",
        "8",
        "2",
        "steps",
        "(500.0",
        "ms)",
        "1",
    ]  # RPO in steps and time
