"""``--metrics-bind``: both daemons' ``/metrics`` endpoints scraped during a real run, and the values move.

A coordinator and two ``snapshotd serve`` processes, each with a metrics endpoint; two ranks (Snapshotters in
this process, one per node) snapshot steps, then two new processes' worth of Snapshotters restore. Every scrape
is parsed with prometheus-client's own parser.
"""

from __future__ import annotations

import contextlib
import os
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from snapshotd.client import Snapshotter
from snapshotd.harness.ports import free_port
from tests.waits import wait_until

from .conftest import Cluster

pytestmark = pytest.mark.integration

WAIT = 30.0


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``http://127.0.0.1:port/metrics``, by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def buddy_addr(samples: dict) -> str:
    """The data address of the one buddy a sidecar streamed to."""
    (peer,) = {dict(k[1])["peer"] for k in samples if k[0] == "snapshotd_stream_sent_bytes_total"}
    return str(peer)


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not scraped; have {sorted(k for k in samples if k[0] == name)}"
    return float(samples[key])


@contextlib.contextmanager
def metered_cluster(workdir: str, tag: str) -> Iterator[tuple[Cluster, dict[str, int]]]:
    """A coordinator and sidecars A and B, each serving metrics; the cluster and each one's metrics port (by
    ``"coordinator"``, ``"A"``, ``"B"``). Every daemon is stopped on exit, and must have exited cleanly."""
    ports = {"coordinator": free_port(), "A": free_port(), "B": free_port()}
    c = Cluster(workdir, tag, replicas=1, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    try:
        c.start_coordinator("tcp://127.0.0.1:0", "--metrics-bind", f"127.0.0.1:{ports['coordinator']}")
        for node in ("A", "B"):
            c.start(node, "--metrics-bind", f"127.0.0.1:{ports[node]}")
        yield c, ports
    finally:
        c.close()
    for p in [c.coordinator, *c.started]:
        assert p is not None and p.proc.returncode == 0, (
            f"{p and p.name} exited with {p and p.proc.returncode}"
        )


@pytest.fixture
def metered(
    tmp_path: os.PathLike[str], tag: str, no_shm_leak: None
) -> Iterator[tuple[Cluster, dict[str, int]]]:
    with metered_cluster(str(tmp_path), tag) as (c, ports):
        yield c, ports


def test_both_endpoints_are_scraped_during_a_run_and_their_values_move(
    metered: tuple[Cluster, dict[str, int]],
) -> None:
    cluster, ports = metered
    job = cluster.job("metrics")
    nodes = ("A", "B")
    states = [{"w": torch.zeros(64, 1024), "loop": {"step": 0}} for _ in nodes]

    def open_snaps() -> list[Snapshotter]:
        # "block": six steps back to back on three slots; a capture waits for D to free a slot instead of skipping
        return [
            Snapshotter(
                states[r],
                job=job,
                rank=r,
                world_size=2,
                sidecar=cluster.ipc(n),
                timeout=WAIT,
                when_busy="block",
            )
            for r, n in enumerate(nodes)
        ]

    def restore_all(snaps: list[Snapshotter]) -> list[int]:
        with ThreadPoolExecutor(2) as pool:  # restore() answers once every rank of the job asked
            return list(pool.map(lambda s: s.restore(timeout=WAIT), snaps, timeout=WAIT + 10))

    def train(snaps: list[Snapshotter], first: int, last: int) -> None:
        for step in range(first, last + 1):
            for s, st in zip(snaps, states, strict=True):
                st["w"] += 1
                st["loop"]["step"] = step
                assert s.capture(step), s.stats
            for s in snaps:
                assert s.wait(WAIT)

    def coordinator_g_d() -> tuple[float | None, float | None]:
        co = scrape(ports["coordinator"])  # G and D are absent until the job has them
        labels = (("snapshotd_job", job),)
        return co.get(("snapshotd_job_recoverable_step", labels)), co.get(
            ("snapshotd_job_durable_step", labels)
        )

    def wait_for_g_d(step: int) -> None:
        try:
            wait_until(
                lambda: coordinator_g_d() == (step, step),
                f"the coordinator's G and D to reach step {step}",
                WAIT,
            )
        except TimeoutError as exc:  # say what the coordinator saw of the job and the nodes
            seen = {
                k: v
                for k, v in scrape(ports["coordinator"]).items()
                if dict(k[1]).get("snapshotd_job") == job or k[0].startswith("snapshotd_node")
            }
            raise AssertionError(f"{exc}; the coordinator's view: {seen}") from None

    snaps = open_snaps()
    assert restore_all(snaps) == [0, 0]
    train(snaps, 1, 3)
    wait_for_g_d(3)
    side1, co1 = scrape(ports["A"]), scrape(ports["coordinator"])
    train(snaps, 4, 6)
    wait_for_g_d(6)
    side2, co2 = scrape(ports["A"]), scrape(ports["coordinator"])

    rank0 = {"snapshotd_job": job, "rank": "0"}
    for outcome in ("started", "durable"):
        assert value(side1, "snapshotd_snapshots_total", outcome=outcome, **rank0) == 3
        assert value(side2, "snapshotd_snapshots_total", outcome=outcome, **rank0) == 6
    assert value(side2, "snapshotd_snapshots_total", outcome="failed", **rank0) == 0
    assert value(side2, "snapshotd_local_rank_newest_step", **rank0) == 6
    assert value(side2, "snapshotd_local_rank_durable_step", **rank0) == 6
    assert value(side2, "snapshotd_local_rank_rpo_steps", **rank0) == 0
    assert 0 <= value(side2, "snapshotd_local_rank_durable_age_seconds", **rank0) < WAIT
    assert (
        value(side2, "snapshotd_peer_unacked_bytes", peer=buddy_addr(side2)) == 0
    )  # every stream acknowledged
    assert value(side2, "snapshotd_peer_ack_wait_seconds", peer=buddy_addr(side2)) == 0
    assert value(side2, "snapshotd_sent_bytes_total") > value(side1, "snapshotd_sent_bytes_total") > 0
    assert value(side2, "snapshotd_received_bytes_total") > value(side1, "snapshotd_received_bytes_total") > 0
    buddy = [k for k in side2 if k[0] == "snapshotd_stream_sent_bytes_total"]
    assert len(buddy) == 1 and side2[buddy[0]] > side1[buddy[0]] > 0  # one buddy (delta-coded: fewer bytes)
    assert value(side2, "snapshotd_stream_received_bytes_total", peer=cluster.node("B")) > 0
    chunks = sum(v for k, v in side2.items() if k[0] == "snapshotd_chunks_sent_total")
    assert chunks > sum(v for k, v in side1.items() if k[0] == "snapshotd_chunks_sent_total") > 0
    assert value(side2, "snapshotd_memory_limit_bytes") > value(side2, "snapshotd_stored_bytes") > 0
    assert value(side2, "snapshotd_heartbeat_rtt_seconds_count") > value(
        side1, "snapshotd_heartbeat_rtt_seconds_count"
    )
    assert value(side2, "snapshotd_checksum_failures_total") == 0
    assert value(side2, "snapshotd_restore_seconds_count", path="fresh") == 1
    assert value(side2, "snapshotd_restore_seconds_bucket", path="fresh", le="+Inf") == 1
    assert value(side2, "snapshotd_shm_free_bytes") > 0 and value(side2, "snapshotd_shm_used_bytes") > 0
    assert (
        value(
            side2,
            "snapshotd_sidecar_info",
            node=cluster.node("A"),
            incarnation=next(dict(k[1])["incarnation"] for k in side2 if k[0] == "snapshotd_sidecar_info"),
            data_addr=next(dict(k[1])["data_addr"] for k in side2 if k[0] == "snapshotd_sidecar_info"),
        )
        == 1
    )

    assert value(co2, "snapshotd_heartbeats_total") > value(co1, "snapshotd_heartbeats_total")
    assert value(co2, "snapshotd_nodes", state="alive") == 2
    assert value(co2, "snapshotd_nodes", state="dead") == 0
    assert value(co2, "snapshotd_node_up", node=cluster.node("B")) == 1
    assert 0 <= value(co2, "snapshotd_node_heartbeat_age_seconds", node=cluster.node("B")) < WAIT
    assert value(co2, "snapshotd_node_deaths_total", reason="silent") == 0
    assert 0 <= value(co2, "snapshotd_job_durable_age_seconds", snapshotd_job=job) < WAIT
    assert value(co1, "snapshotd_job_durable_step", snapshotd_job=job) >= 3
    assert value(co2, "snapshotd_job_world_size", snapshotd_job=job) == 2
    for r in ("0", "1"):
        assert value(co2, "snapshotd_rank_newest_step", snapshotd_job=job, rank=r) == 6
        assert value(co2, "snapshotd_rank_rpo_steps", snapshotd_job=job, rank=r) == 0
        assert value(co2, "snapshotd_rank_rpo_seconds", snapshotd_job=job, rank=r) == 0
        assert value(co2, "snapshotd_rank_copies", snapshotd_job=job, rank=r) >= 1
    assert value(co2, "snapshotd_job_rpo_steps_max", snapshotd_job=job) == 0
    assert value(co2, "snapshotd_job_copies_min", snapshotd_job=job) >= 1
    rounds_before = value(co2, "snapshotd_plan_round_seconds_count", snapshotd_job=job)

    # the training side counts the same: and a restart restores from each node's own shared memory
    assert (
        snaps[0].stats.started == 6 and snaps[0].stats.durable >= 1 and snaps[0].stats.last_durable_step == 6
    )
    assert snaps[0].stats.last_step == 6 and snaps[0].stats.rpo_steps == 0
    for s in snaps:
        s.close(unregister=False)  # as a crashed process would leave them
    snaps = open_snaps()
    try:
        assert restore_all(snaps) == [6, 6]
        side3, co3 = scrape(ports["A"]), scrape(ports["coordinator"])
        assert value(side3, "snapshotd_restore_seconds_count", path="local") == 1
        assert value(co3, "snapshotd_plan_round_seconds_count", snapshotd_job=job) == rounds_before + 1
        train(snaps, 7, 7)
        assert snaps[0].stats.last_step == 7 and snaps[0].stats.rpo_steps == 0
    finally:
        for s in snaps:
            s.close()


def test_a_bad_metrics_bind_is_one_clear_line(tmp_path: os.PathLike[str]) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "snapshotd.cli", "coordinator", "--metrics-bind", "9400"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--metrics-bind must be HOST:PORT" in out.stderr
