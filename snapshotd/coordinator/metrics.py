"""The coordinator's Prometheus metrics (:mod:`snapshotd.metrics` serves them): :func:`coordinator_sampler`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import msgpack
from prometheus_client.core import Metric

from snapshotd.metrics import JOB_LABEL, Sampler, counter, gauge, histogram

from .state import CoordinatorState

__all__ = ["coordinator_sampler"]


def coordinator_sampler(state: CoordinatorState) -> Sampler:
    """The sampler of the coordinator's metrics, read from its status document.

    The document is packed in parts with the event loop yielded between them, as ``snapshotd status`` does, and
    read into metric families in a worker thread, so a scrape of a large fleet never holds up heartbeats or
    plans for longer than one part takes.
    """

    async def sample() -> list[Metric]:
        parts = []
        for part in state.status_parts(time.monotonic()):
            parts.append(part)
            await asyncio.sleep(0)
        packed = b"".join(parts)
        return await asyncio.to_thread(
            lambda: list(_coordinator_families(msgpack.unpackb(packed, raw=False)))
        )

    return sample


def _coordinator_families(doc: dict[str, Any]) -> Iterator[Metric]:
    co, nodes, jobs = doc["coordinator"], doc["nodes"], doc["jobs"]
    yield gauge(
        "snapshotd_coordinator_uptime_seconds", "Seconds since the coordinator started", co["uptime_s"]
    )
    yield gauge(
        "snapshotd_build_info",
        "This daemon's snapshotd version (always 1)",
        labels=("version",),
        rows=[((co.get("version", "unknown"),), 1)],
    )
    yield counter("snapshotd_heartbeats", "Heartbeats received", co["heartbeats"])
    yield counter(
        "snapshotd_node_deaths",
        "Nodes declared dead, by reason: silent (no heartbeat for the death timeout), probe (a probe found "
        "its sidecar gone); a node that left on purpose is not counted",
        labels=("reason",),
        rows=[((why,), n) for why, n in sorted(co["node_deaths"].items())],
    )
    yield counter(
        "snapshotd_refused_messages", "Messages refused (malformed, unknown, not allowed)", co["bad_messages"]
    )
    alive = sum(1 for n in nodes if n["alive"])
    yield gauge(
        "snapshotd_nodes",
        "Nodes known, by state",
        labels=("state",),
        rows=[(("alive",), alive), (("dead",), len(nodes) - alive)],
    )
    yield gauge(
        "snapshotd_broken_path",
        "1 for each pair of live nodes that cannot move snapshots to each other (their sidecars report it)",
        labels=("node_a", "node_b"),
        rows=[((b["nodes"][0], b["nodes"][1]), 1) for b in doc.get("broken_paths", [])],
    )
    yield gauge(
        "snapshotd_node_up",
        "1 while the node's sidecar heartbeats",
        labels=("node",),
        rows=[((n["node"],), float(n["alive"])) for n in nodes],
    )
    yield gauge(
        "snapshotd_node_heartbeat_age_seconds",
        "Seconds since the node's sidecar was last heard from (it grows on a dead node)",
        labels=("node",),
        rows=[((n["node"],), n["last_seen_s"]) for n in nodes],
    )
    yield gauge(
        "snapshotd_node_stored_bytes",
        "Bytes of buddy copies the node holds",
        labels=("node",),
        rows=[((n["node"],), n["stored_bytes"]) for n in nodes],
    )
    for key, what in (("out_Bps", "sent"), ("in_Bps", "received")):
        yield gauge(
            f"snapshotd_node_{what}_bytes_per_second",
            f"Snapshot bytes the node {what} per second",
            labels=("node",),
            rows=[((n["node"],), n[key]) for n in nodes],
        )
    yield gauge(
        "snapshotd_job_world_size",
        "The job's world size (absent: not known yet)",
        labels=(JOB_LABEL,),
        rows=[((j["job"],), j["world_size"]) for j in jobs if j["world_size"] > 0],
    )
    yield gauge(
        "snapshotd_job_recoverable_step",
        "G: the newest step every rank can restore (absent: none)",
        labels=(JOB_LABEL,),
        rows=[((j["job"],), j["recoverable"]) for j in jobs if j["recoverable"] >= 0],
    )
    yield gauge(
        "snapshotd_job_durable_step",
        "D: the newest step on its buddies for every rank (absent: none)",
        labels=(JOB_LABEL,),
        rows=[((j["job"],), j["durable"]) for j in jobs if j["durable"] >= 0],
    )
    yield gauge(
        "snapshotd_job_durable_age_seconds",
        "Seconds since D last moved: it grows while the job's snapshots stop becoming durable (absent: no D)",
        labels=(JOB_LABEL,),
        rows=[((j["job"],), j["durable_age_s"]) for j in jobs if j["durable_age_s"] is not None],
    )
    yield histogram(
        "snapshotd_plan_round_seconds",
        "Plan rounds every rank was answered in, and their seconds from the last rank's ask to the last answer",
        labels=(JOB_LABEL,),
        rows=[((j["job"],), j["plan_round_buckets"], j["plan_rounds"], j["plan_round_s"]) for j in jobs],
    )
    yield gauge(
        "snapshotd_job_rpo_steps_max",
        "The largest rank RPO of the job, in steps",
        labels=(JOB_LABEL,),
        rows=[
            ((j["job"],), max(lags))
            for j in jobs
            if (lags := [r["lag_steps"] for r in j["ranks"] if r["lag_steps"] is not None])
        ],
    )
    yield gauge(
        "snapshotd_job_rpo_seconds_max",
        "The largest rank RPO of the job, in training seconds",
        labels=(JOB_LABEL,),
        rows=[
            ((j["job"],), max(rpos))
            for j in jobs
            if (rpos := [r["rpo_s"] for r in j["ranks"] if r["rpo_s"] is not None])
        ],
    )
    yield gauge(
        "snapshotd_job_copies_min",
        "The fewest live holders of G of any rank of the job",
        labels=(JOB_LABEL,),
        rows=[
            ((j["job"],), min(r["copies"] for r in j["ranks"]))
            for j in jobs
            if j["ranks"] and j["recoverable"] >= 0
        ],
    )
    ranks = [(j["job"], r) for j in jobs for r in j["ranks"]]
    yield gauge(
        "snapshotd_rank_newest_step",
        "The rank's newest complete snapshot on any node (absent: none)",
        labels=(JOB_LABEL, "rank"),
        rows=[((job, str(r["rank"])), r["newest_step"]) for job, r in ranks if r["newest_step"] >= 0],
    )
    yield gauge(
        "snapshotd_rank_rpo_steps",
        "Steps a failure now would cost the rank: its newest step minus G",
        labels=(JOB_LABEL, "rank"),
        rows=[((job, str(r["rank"])), r["lag_steps"]) for job, r in ranks if r["lag_steps"] is not None],
    )
    yield gauge(
        "snapshotd_rank_rpo_seconds",
        "The same in training seconds (steps times the rank's latest step time)",
        labels=(JOB_LABEL, "rank"),
        rows=[((job, str(r["rank"])), r["rpo_s"]) for job, r in ranks if r["rpo_s"] is not None],
    )
    yield gauge(
        "snapshotd_rank_copies",
        "Live holders of the rank's copy of G",
        labels=(JOB_LABEL, "rank"),
        rows=[((job, str(r["rank"])), r["copies"]) for job, r in ranks],
    )
