"""The sidecar's Prometheus metrics (:mod:`snapshotd.metrics` serves them): :func:`sidecar_sampler`."""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily

from snapshotd import __version__
from snapshotd.metrics import Sampler, counter, gauge

from .node import NodeState
from .pacer import Pacer

__all__ = ["sidecar_sampler"]


def sidecar_sampler(state: NodeState, pacer: Pacer) -> Sampler:
    """The sampler of one sidecar's metrics (its counters, store, pacer and local ranks)."""

    async def sample() -> list[Metric]:
        c = state.counters
        pace = pacer.state()
        ranks = list(state.ranks.values())
        keys = [(lr.job, str(lr.rank)) for lr in ranks]
        rtt = SummaryMetricFamily(
            "snapshotd_heartbeat_rtt_seconds",
            "Heartbeat round trips to the coordinator",
            count_value=c.heartbeat_rtt.count,
            sum_value=c.heartbeat_rtt.total,
        )
        restore_s = SummaryMetricFamily(
            "snapshotd_restore_seconds",
            "Restores served to local ranks, by source, and their seconds",
            labels=["path"],
        )
        for path, tally in sorted(c.restores.items()):
            restore_s.add_metric([path], count_value=tally.count, sum_value=tally.total)
        snapshots = CounterMetricFamily(
            "snapshotd_snapshots",
            "Snapshots of each local rank, by outcome: started "
            "(announced), skipped (capture() calls the rank skipped), durable (every buddy "
            "took it), failed (some buddy did not)",
            labels=["job", "rank", "outcome"],
        )
        for (job, rank), lr in zip(keys, ranks, strict=True):
            for outcome, n in (
                ("started", lr.announced),
                ("skipped", lr.skipped),
                ("durable", lr.durable_count),
                ("failed", lr.failed_count),
            ):
                snapshots.add_metric([job, rank, outcome], n)
        newest = {k: max(lr.valid_steps(), default=-1) for k, lr in zip(keys, ranks, strict=True)}
        rpo = {
            k: (max(0, newest[k] - lr.durable_step), lr.step_seconds)
            for k, lr in zip(keys, ranks, strict=True)
            if lr.durable_step >= 0
        }
        rank_labels = ("job", "rank")
        now = time.monotonic()
        paths = sorted(state.paths.paths.values(), key=lambda p: p.addr)
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
                "snapshotd_stream_rate_bytes_per_second", "Throughput of the last stream", pacer.observed_rate
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
                "Median step with no stream (0: none yet)",
                pace.baseline_seconds,
            ),
            gauge(
                "snapshotd_pacer_loaded_step_seconds",
                "Median step with a stream (0: none yet)",
                pace.loaded_seconds,
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
            rtt,
            gauge(
                "snapshotd_heartbeat_rtt_last_seconds", "The last heartbeat round trip", c.heartbeat_rtt.last
            ),
            restore_s,
            counter(
                "snapshotd_restore_bytes",
                "Bytes restores brought over the network, by source",
                labels=("path",),
                rows=[((k,), n) for k, n in sorted(c.restore_bytes.items())],
            ),
            snapshots,
            gauge(
                "snapshotd_local_rank_alive",
                "1 while the local rank's process lives",
                labels=rank_labels,
                rows=[(k, float(lr.alive)) for k, lr in zip(keys, ranks, strict=True)],
            ),
            gauge(
                "snapshotd_local_rank_newest_step",
                "The newest step the rank snapshotted (-1: none)",
                labels=rank_labels,
                rows=list(newest.items()),
            ),
            gauge(
                "snapshotd_local_rank_durable_step",
                "The newest step of the rank every buddy took (-1: none)",
                labels=rank_labels,
                rows=[(k, lr.durable_step) for k, lr in zip(keys, ranks, strict=True)],
            ),
            gauge(
                "snapshotd_local_rank_rpo_steps",
                "Steps losing this node now would cost the rank: newest minus "
                "durable step (absent before the first durable one)",
                labels=rank_labels,
                rows=[(k, steps) for k, (steps, _) in rpo.items()],
            ),
            gauge(
                "snapshotd_local_rank_rpo_seconds",
                "The same in training seconds (steps times the latest step time)",
                labels=rank_labels,
                rows=[(k, steps * sec) for k, (steps, sec) in rpo.items()],
            ),
            gauge(
                "snapshotd_local_rank_step_seconds",
                "The rank's latest step time (0: not known)",
                labels=rank_labels,
                rows=[(k, lr.step_seconds) for k, lr in zip(keys, ranks, strict=True)],
            ),
        ]

    return sample
