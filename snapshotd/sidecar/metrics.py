"""The sidecar's Prometheus metrics (:mod:`snapshotd.metrics` serves them): :func:`sidecar_sampler`."""

from __future__ import annotations

import os
import time

from prometheus_client.core import CounterMetricFamily, Metric

from snapshotd import __version__
from snapshotd.metrics import JOB_LABEL, Sampler, counter, gauge, histogram
from snapshotd.shm import SHM_DIR

from .node import NodeState
from .pacer import Pacer

__all__ = ["sidecar_sampler"]

RANK_LABELS = (JOB_LABEL, "rank")
"""A local rank's labels: its training job and rank."""


def sidecar_sampler(state: NodeState, pacer: Pacer) -> Sampler:
    """The sampler of one sidecar's metrics (its counters, store, pacer, local ranks, streams in flight and the
    shared memory its ranks' arenas live in)."""

    async def sample() -> list[Metric]:
        c = state.counters
        pace = pacer.state()
        ranks = list(state.ranks.values())
        keys = [(lr.job, str(lr.rank)) for lr in ranks]
        snapshots = CounterMetricFamily(
            "snapshotd_snapshots",
            "Snapshots of each local rank, by outcome: started "
            "(announced), skipped (capture() calls the rank skipped), durable (every buddy "
            "took it), failed (some buddy did not)",
            labels=[*RANK_LABELS, "outcome"],
        )
        for (job, rank), lr in zip(keys, ranks, strict=True):
            for outcome, n in (
                ("started", lr.announced),
                ("skipped", lr.skipped),
                ("durable", lr.durable_count),
                ("failed", sum(lr.failures.values())),
            ):
                snapshots.add_metric([job, rank, outcome], n)
        newest = {k: max(steps) for k, lr in zip(keys, ranks, strict=True) if (steps := lr.valid_steps())}
        durable = {k: lr for k, lr in zip(keys, ranks, strict=True) if lr.durable_step >= 0}
        rpo = {k: (max(0, newest.get(k, -1) - lr.durable_step), lr.step_seconds) for k, lr in durable.items()}
        now = time.monotonic()
        paths = sorted(state.paths.paths.values(), key=lambda p: p.addr)
        flights = state.in_flight.by_peer()
        shm = os.statvfs(SHM_DIR)
        return [
            counter(
                "snapshotd_peer_failures",
                "Transfers to each peer that failed its path, by reason: timeout (no answer within the peer "
                "timeout), stalled (none completed for a peer timeout)",
                labels=("peer", "reason"),
                rows=[((p.addr, why), n) for p in paths for why, n in sorted(p.failures.items())],
            ),
            gauge(
                "snapshotd_peer_last_success_age_seconds",
                "Seconds since a transfer to each peer last completed (peers with none completed are left out)",
                labels=("peer",),
                rows=[((p.addr,), now - p.last_success) for p in paths if p.last_success is not None],
            ),
            gauge(
                "snapshotd_peer_path_broken",
                "1 for each peer this sidecar reports to the coordinator as unreachable or slow",
                labels=("peer", "kind"),
                rows=[((p.addr, p.kind or "unknown"), 1) for p in paths if p.broken_since is not None],
            ),
            gauge(
                "snapshotd_peer_unacked_bytes",
                "Stream bytes sent to each buddy and not yet acknowledged (every buddy streamed to is listed)",
                labels=("peer",),
                rows=[((addr,), n) for addr, n, _ in flights],
            ),
            gauge(
                "snapshotd_peer_ack_wait_seconds",
                "Seconds the oldest chunk sent to each buddy has waited for its acknowledgement (0: none waits)",
                labels=("peer",),
                rows=[((addr,), wait) for addr, _, wait in flights],
            ),
            gauge(
                "snapshotd_shm_used_bytes",
                f"Bytes used on the file system of {SHM_DIR}, where the local ranks' arenas live",
                (shm.f_blocks - shm.f_bfree) * shm.f_frsize,
            ),
            gauge(
                "snapshotd_shm_free_bytes",
                f"Bytes free for this sidecar's user on the file system of {SHM_DIR}",
                shm.f_bavail * shm.f_frsize,
            ),
            gauge(
                "snapshotd_build_info",
                "This daemon's snapshotd version (always 1)",
                labels=("version",),
                rows=[((__version__,), 1)],
            ),
            gauge(
                "snapshotd_sidecar_info",
                "This sidecar (always 1)",
                labels=("node", "incarnation", "data_addr"),
                rows=[((state.node, state.incarnation, state.data_addr), 1)],
            ),
            counter(
                "snapshotd_sent_bytes",
                "Snapshot bytes sent to other sidecars (streams and pulls served)",
                c.bytes_out,
            ),
            counter("snapshotd_received_bytes", "Snapshot bytes received from other sidecars", c.bytes_in),
            counter(
                "snapshotd_stream_sent_bytes",
                "Stream bytes each buddy took, as sent on the wire",
                labels=("peer",),
                rows=[((p,), n) for p, n in sorted(c.sent_to.items())],
            ),
            counter(
                "snapshotd_stream_received_bytes",
                "Stream bytes received, by the sending node",
                labels=("peer",),
                rows=[((p,), n) for p, n in sorted(c.received_from.items())],
            ),
            counter(
                "snapshotd_pull_received_bytes",
                "Bytes pulled from holders (restores, re-replication)",
                c.pull_bytes_in,
            ),
            counter("snapshotd_pull_served_bytes", "Bytes served to other sidecars' pulls", c.pull_bytes_out),
            counter(
                "snapshotd_chunks_sent",
                "Stream chunks sent, by codec",
                labels=("codec",),
                rows=[((k,), n) for k, n in sorted(c.chunks_sent.items())],
            ),
            counter(
                "snapshotd_pushed_copies", "Buddy copies that arrived pushed over the bulk port", c.pushes_in
            ),
            gauge(
                "snapshotd_stream_rate_bytes_per_second",
                "Throughput of the last stream (absent before the first)",
                pacer.observed_rate or None,
            ),
            gauge(
                "snapshotd_pacer_limit_bytes_per_second",
                "The pacer's outgoing rate limit (+Inf: unpaced)",
                pace.rate,
            ),
            gauge(
                "snapshotd_pacer_keep_up_bytes_per_second",
                "The rate the local ranks' snapshots need",
                pace.keep_up_rate,
            ),
            gauge(
                "snapshotd_pacer_step_budget_ratio",
                "--step-budget: the step slowdown streams may cost",
                pace.budget,
            ),
            gauge(
                "snapshotd_pacer_step_slowdown_ratio",
                "Loaded over clean median step time, minus 1",
                pace.slowdown,
            ),
            gauge(
                "snapshotd_pacer_clean_step_seconds",
                "Median step with no stream (absent before the first)",
                pace.baseline_seconds or None,
            ),
            gauge(
                "snapshotd_pacer_loaded_step_seconds",
                "Median step with a stream (absent before the first since the last cut)",
                pace.loaded_seconds or None,
            ),
            counter("snapshotd_pacer_cuts", "Rate cuts for the step budget", pace.cuts),
            gauge(
                "snapshotd_stored_bytes",
                "Bytes of buddy copies held (complete or arriving)",
                state.store.used_bytes,
            ),
            gauge("snapshotd_memory_limit_bytes", "--memory-limit", state.store.memory_limit),
            counter(
                "snapshotd_checksum_failures",
                "Copies held here that failed their end-to-end check",
                c.corrupt,
            ),
            counter("snapshotd_handler_errors", "Requests refused or failed, and handler failures", c.errors),
            histogram(
                "snapshotd_heartbeat_rtt_seconds",
                "Heartbeat round trips to the coordinator",
                rows=[((), c.heartbeat_rtt.buckets(), c.heartbeat_rtt.count, c.heartbeat_rtt.total)],
            ),
            gauge(
                "snapshotd_heartbeat_rtt_last_seconds",
                "The last heartbeat round trip (absent before the first)",
                c.heartbeat_rtt.last if c.heartbeat_rtt.count else None,
            ),
            histogram(
                "snapshotd_restore_seconds",
                "Restores served to local ranks, by source, and their seconds",
                labels=("path",),
                rows=[((k,), t.buckets(), t.count, t.total) for k, t in sorted(c.restores.items())],
            ),
            counter(
                "snapshotd_restore_bytes",
                "Bytes restores brought over the network, by source",
                labels=("path",),
                rows=[((k,), n) for k, n in sorted(c.restore_bytes.items())],
            ),
            snapshots,
            counter(
                "snapshotd_snapshot_failures",
                "Snapshots of each local rank some buddy did not take, by reason: no_buddy (none assigned yet), "
                "buddy_failed (one refused it or did not answer), buddy_reassigned (replaced while it streamed)",
                labels=(*RANK_LABELS, "reason"),
                rows=[
                    ((*k, why), n)
                    for k, lr in zip(keys, ranks, strict=True)
                    for why, n in lr.failures.items()
                ],
            ),
            gauge(
                "snapshotd_local_rank_alive",
                "1 while the local rank's process lives",
                labels=RANK_LABELS,
                rows=[(k, float(lr.alive)) for k, lr in zip(keys, ranks, strict=True)],
            ),
            gauge(
                "snapshotd_local_rank_newest_step",
                "The newest step the rank snapshotted (absent: none)",
                labels=RANK_LABELS,
                rows=list(newest.items()),
            ),
            gauge(
                "snapshotd_local_rank_durable_step",
                "The newest step of the rank every buddy took (absent: none)",
                labels=RANK_LABELS,
                rows=[(k, lr.durable_step) for k, lr in durable.items()],
            ),
            gauge(
                "snapshotd_local_rank_durable_age_seconds",
                "Seconds since the rank announced its newest snapshot every buddy took: the training a loss of "
                "this node now would cost, in wall-clock time (absent: none, or not known after a restore)",
                labels=RANK_LABELS,
                rows=[(k, now - lr.durable_at) for k, lr in durable.items() if lr.durable_at is not None],
            ),
            gauge(
                "snapshotd_local_rank_rpo_steps",
                "Steps losing this node now would cost the rank: newest minus "
                "durable step (absent before the first durable one)",
                labels=RANK_LABELS,
                rows=[(k, steps) for k, (steps, _) in rpo.items()],
            ),
            gauge(
                "snapshotd_local_rank_rpo_seconds",
                "The same in training seconds (steps times the latest step time; absent while that is not "
                "known and the RPO is not 0)",
                labels=RANK_LABELS,
                rows=[(k, steps * sec) for k, (steps, sec) in rpo.items() if sec > 0 or steps == 0],
            ),
            gauge(
                "snapshotd_local_rank_step_seconds",
                "The rank's latest step time (absent: not known)",
                labels=RANK_LABELS,
                rows=[(k, lr.step_seconds) for k, lr in zip(keys, ranks, strict=True) if lr.step_seconds > 0],
            ),
        ]

    return sample
