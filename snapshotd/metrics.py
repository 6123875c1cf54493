"""Prometheus metrics of the daemons: ``--metrics-bind HOST:PORT`` serves ``/metrics`` (prometheus-client).

The daemons keep plain counters and state on their event loop (:class:`~snapshotd.sidecar.node.Counters`, the
coordinator's jobs and membership) and know nothing of Prometheus. A scrape arrives on prometheus-client's HTTP
thread; :class:`LoopCollector` runs the daemon's sampler on the event loop (the one thread that may read that
state) and turns what it returns into metric families there. Nothing is kept between scrapes: a rank or node that
went away is simply absent from the next one (byte counters per peer stay, for every peer seen, as counters
must).

Every name starts with ``snapshotd_``; the tables of names and meanings are in the README ("Operations").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from snapshotd.units import parse_host_port

if TYPE_CHECKING:
    from snapshotd.coordinator.state import CoordinatorState
    from snapshotd.sidecar.node import NodeState
    from snapshotd.sidecar.pacer import Pacer

__all__ = ["LoopCollector", "MetricsEndpoint", "coordinator_sampler", "sidecar_sampler"]

log = logging.getLogger(__name__)

Sampler = Callable[[], Coroutine[Any, Any, list[Metric]]]
"""Samples a daemon's metrics on its event loop."""

SCRAPE_TIMEOUT_S = 5.0
"""A scrape waits at most this long for the event loop to sample the daemon."""


class LoopCollector:
    """A prometheus-client collector whose ``collect()`` (called on the HTTP thread) awaits ``sample()`` on
    ``loop`` and yields its metric families.

    Scrapes sample one at a time: a second waits for the first (a coordinator's sample packs the whole status
    document).

    Raises (from ``collect``, which prometheus-client answers with HTTP 500):
        TimeoutError: the loop did not finish sampling within :data:`SCRAPE_TIMEOUT_S`, or another scrape held
            the sampler that long.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sample: Sampler) -> None:
        self._loop = loop
        self._sample = sample
        self._one_at_a_time = threading.Lock()  # concurrent scrapes wait: the loop samples once at a time

    def collect(self) -> Iterator[Metric]:
        if not self._one_at_a_time.acquire(timeout=SCRAPE_TIMEOUT_S):
            raise TimeoutError(f"another scrape held the sampler for {SCRAPE_TIMEOUT_S:g} s")
        try:
            families = self._sample_on_loop()
        finally:
            self._one_at_a_time.release()
        yield from families

    def _sample_on_loop(self) -> list[Metric]:
        future: concurrent.futures.Future[list[Metric]] = asyncio.run_coroutine_threadsafe(
            self._sample(), self._loop
        )
        try:
            families = future.result(SCRAPE_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"the daemon's event loop did not answer a scrape within {SCRAPE_TIMEOUT_S:g} s"
            ) from None
        return families


class MetricsEndpoint:
    """An HTTP server on ``bind`` (``HOST:PORT``) answering ``/metrics`` from ``sample``, in a daemon thread.

    Start it from the daemon's event loop; :meth:`close` stops the server and joins its thread.

    Raises:
        ValueError: a malformed ``bind``.
        OSError: the address cannot be bound, naming it.
    """

    def __init__(self, bind: str, sample: Sampler) -> None:
        host, port = parse_host_port(bind, "--metrics-bind")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(LoopCollector(asyncio.get_running_loop(), sample))  # type: ignore[arg-type]
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {bind}: {exc}") from exc
        bound_port = self._server.server_port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound_port}/metrics"
        """Where the metrics are served (a port 0 resolved to the real one)."""

    def close(self) -> None:
        """Stop accepting scrapes and join the server's thread (a scrape being answered finishes on its own
        thread, its sample bounded by :data:`SCRAPE_TIMEOUT_S`)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily],
    name: str,
    doc: str,
    labels: Iterable[str] = (),
    rows: Iterable[tuple[Iterable[str], float]] = (),
) -> Metric:
    fam = kind(name, doc, labels=list(labels))
    for values, value in rows:
        fam.add_metric(list(values), value)
    return fam


def _gauge(
    name: str,
    doc: str,
    value: float | None = None,
    labels: Iterable[str] = (),
    rows: Iterable[tuple[Iterable[str], float]] = (),
) -> Metric:
    return _family(GaugeMetricFamily, name, doc, labels, [((), value)] if value is not None else rows)


def _counter(
    name: str,
    doc: str,
    value: float | None = None,
    labels: Iterable[str] = (),
    rows: Iterable[tuple[Iterable[str], float]] = (),
) -> Metric:
    return _family(CounterMetricFamily, name, doc, labels, [((), value)] if value is not None else rows)


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
        return [
            _gauge(
                "snapshotd_sidecar_info",
                "This sidecar (always 1)",
                labels=("node", "incarnation", "data_addr"),
                rows=[((state.node, state.incarnation, state.data_addr), 1)],
            ),
            _counter(
                "snapshotd_sent_bytes",
                "Snapshot bytes sent to other sidecars (streams and pulls served)",
                c.bytes_out,
            ),
            _counter("snapshotd_received_bytes", "Snapshot bytes received from other sidecars", c.bytes_in),
            _counter(
                "snapshotd_stream_sent_bytes",
                "Stream bytes each buddy took, as sent on the wire",
                labels=("peer",),
                rows=[((p,), n) for p, n in sorted(c.sent_to.items())],
            ),
            _counter(
                "snapshotd_stream_received_bytes",
                "Stream bytes received, by the sending node",
                labels=("peer",),
                rows=[((p,), n) for p, n in sorted(c.received_from.items())],
            ),
            _counter(
                "snapshotd_pull_received_bytes",
                "Bytes pulled from holders (restores, re-replication)",
                c.pull_bytes_in,
            ),
            _counter(
                "snapshotd_pull_served_bytes", "Bytes served to other sidecars' pulls", c.pull_bytes_out
            ),
            _counter(
                "snapshotd_chunks_sent",
                "Stream chunks sent, by codec",
                labels=("codec",),
                rows=[((k,), n) for k, n in sorted(c.chunks_sent.items())],
            ),
            _counter(
                "snapshotd_pushed_copies", "Buddy copies that arrived pushed over the bulk port", c.pushes_in
            ),
            _gauge(
                "snapshotd_stream_rate_bytes_per_second", "Throughput of the last stream", pacer.observed_rate
            ),
            _gauge(
                "snapshotd_pacer_limit_bytes_per_second",
                "The pacer's outgoing rate limit (+Inf: unpaced)",
                pace.rate,
            ),
            _gauge(
                "snapshotd_pacer_keep_up_bytes_per_second",
                "The rate the local ranks' snapshots need",
                pace.keep_up_rate,
            ),
            _gauge(
                "snapshotd_pacer_step_budget_ratio",
                "--step-budget: the step slowdown streams may cost",
                pace.budget,
            ),
            _gauge(
                "snapshotd_pacer_step_slowdown_ratio",
                "Loaded over clean median step time, minus 1",
                pace.slowdown,
            ),
            _gauge(
                "snapshotd_pacer_clean_step_seconds",
                "Median step with no stream (0: none yet)",
                pace.baseline_seconds,
            ),
            _gauge(
                "snapshotd_pacer_loaded_step_seconds",
                "Median step with a stream (0: none yet)",
                pace.loaded_seconds,
            ),
            _counter("snapshotd_pacer_cuts", "Rate cuts for the step budget", pace.cuts),
            _gauge(
                "snapshotd_stored_bytes",
                "Bytes of buddy copies held (complete or arriving)",
                state.store.used_bytes,
            ),
            _gauge("snapshotd_memory_limit_bytes", "--memory-limit", state.store.memory_limit),
            _counter(
                "snapshotd_checksum_failures",
                "Copies held here that failed their end-to-end check",
                c.corrupt,
            ),
            _counter(
                "snapshotd_handler_errors", "Requests refused or failed, and handler failures", c.errors
            ),
            rtt,
            _gauge(
                "snapshotd_heartbeat_rtt_last_seconds", "The last heartbeat round trip", c.heartbeat_rtt.last
            ),
            restore_s,
            _counter(
                "snapshotd_restore_bytes",
                "Bytes restores brought over the network, by source",
                labels=("path",),
                rows=[((k,), n) for k, n in sorted(c.restore_bytes.items())],
            ),
            snapshots,
            _gauge(
                "snapshotd_local_rank_alive",
                "1 while the local rank's process lives",
                labels=rank_labels,
                rows=[(k, float(lr.alive)) for k, lr in zip(keys, ranks, strict=True)],
            ),
            _gauge(
                "snapshotd_local_rank_newest_step",
                "The newest step the rank snapshotted (-1: none)",
                labels=rank_labels,
                rows=list(newest.items()),
            ),
            _gauge(
                "snapshotd_local_rank_durable_step",
                "The newest step of the rank every buddy took (-1: none)",
                labels=rank_labels,
                rows=[(k, lr.durable_step) for k, lr in zip(keys, ranks, strict=True)],
            ),
            _gauge(
                "snapshotd_local_rank_rpo_steps",
                "Steps losing this node now would cost the rank: newest minus "
                "durable step (absent before the first durable one)",
                labels=rank_labels,
                rows=[(k, steps) for k, (steps, _) in rpo.items()],
            ),
            _gauge(
                "snapshotd_local_rank_rpo_seconds",
                "The same in training seconds (steps times the latest step time)",
                labels=rank_labels,
                rows=[(k, steps * sec) for k, (steps, sec) in rpo.items()],
            ),
            _gauge(
                "snapshotd_local_rank_step_seconds",
                "The rank's latest step time (0: not known)",
                labels=rank_labels,
                rows=[(k, lr.step_seconds) for k, lr in zip(keys, ranks, strict=True)],
            ),
        ]

    return sample


def coordinator_sampler(state: CoordinatorState) -> Sampler:
    """The sampler of the coordinator's metrics, read from its status document.

    The document is packed in parts with the event loop yielded between them, as ``snapshotd status`` does, and
    read into metric families in a worker thread, so a scrape of a large fleet never holds up heartbeats or
    plans for longer than one part takes.
    """
    import msgpack

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
    yield _gauge(
        "snapshotd_coordinator_uptime_seconds", "Seconds since the coordinator started", co["uptime_s"]
    )
    yield _counter("snapshotd_heartbeats", "Heartbeats received", co["heartbeats"])
    yield _counter(
        "snapshotd_refused_messages", "Messages refused (malformed, unknown, not allowed)", co["bad_messages"]
    )
    alive = sum(1 for n in nodes if n["alive"])
    yield _gauge(
        "snapshotd_nodes",
        "Nodes known, by state",
        labels=("state",),
        rows=[(("alive",), alive), (("dead",), len(nodes) - alive)],
    )
    yield _gauge(
        "snapshotd_node_up",
        "1 while the node's sidecar heartbeats",
        labels=("node",),
        rows=[((n["node"],), float(n["alive"])) for n in nodes],
    )
    yield _gauge(
        "snapshotd_node_stored_bytes",
        "Bytes of buddy copies the node holds",
        labels=("node",),
        rows=[((n["node"],), n["stored_bytes"]) for n in nodes],
    )
    for key, what in (("out_Bps", "sent"), ("in_Bps", "received")):
        yield _gauge(
            f"snapshotd_node_{what}_bytes_per_second",
            f"Snapshot bytes the node {what} per second",
            labels=("node",),
            rows=[((n["node"],), n[key]) for n in nodes],
        )
    yield _gauge(
        "snapshotd_job_world_size",
        "The job's world size (0: not known yet)",
        labels=("job",),
        rows=[((j["job"],), j["world_size"]) for j in jobs],
    )
    yield _gauge(
        "snapshotd_job_recoverable_step",
        "G: the newest step every rank can restore (-1: none)",
        labels=("job",),
        rows=[((j["job"],), j["recoverable"]) for j in jobs],
    )
    yield _gauge(
        "snapshotd_job_durable_step",
        "D: the newest step on its buddies for every rank (-1: none)",
        labels=("job",),
        rows=[((j["job"],), j["durable"]) for j in jobs],
    )
    rounds = SummaryMetricFamily(
        "snapshotd_plan_round_seconds",
        "Plan rounds every rank was answered in, and "
        "their seconds from the last rank's ask to the last answer",
        labels=["job"],
    )
    for j in jobs:
        rounds.add_metric([j["job"]], count_value=j["plan_rounds"], sum_value=j["plan_round_s"])
    yield rounds
    yield _gauge(
        "snapshotd_job_rpo_steps_max",
        "The largest rank RPO of the job, in steps",
        labels=("job",),
        rows=[
            ((j["job"],), max(lags))
            for j in jobs
            if (lags := [r["lag_steps"] for r in j["ranks"] if r["lag_steps"] is not None])
        ],
    )
    yield _gauge(
        "snapshotd_job_rpo_seconds_max",
        "The largest rank RPO of the job, in training seconds",
        labels=("job",),
        rows=[
            ((j["job"],), max(rpos))
            for j in jobs
            if (rpos := [r["rpo_s"] for r in j["ranks"] if r["rpo_s"] is not None])
        ],
    )
    yield _gauge(
        "snapshotd_job_copies_min",
        "The fewest live holders of G of any rank of the job",
        labels=("job",),
        rows=[
            ((j["job"],), min(r["copies"] for r in j["ranks"]))
            for j in jobs
            if j["ranks"] and j["recoverable"] >= 0
        ],
    )
    ranks = [(j["job"], r) for j in jobs for r in j["ranks"]]
    yield _gauge(
        "snapshotd_rank_newest_step",
        "The rank's newest complete snapshot on any node (-1: none)",
        labels=("job", "rank"),
        rows=[((job, str(r["rank"])), r["newest_step"]) for job, r in ranks],
    )
    yield _gauge(
        "snapshotd_rank_rpo_steps",
        "Steps a failure now would cost the rank: its newest step minus G",
        labels=("job", "rank"),
        rows=[((job, str(r["rank"])), r["lag_steps"]) for job, r in ranks if r["lag_steps"] is not None],
    )
    yield _gauge(
        "snapshotd_rank_rpo_seconds",
        "The same in training seconds (steps times the rank's latest step time)",
        labels=("job", "rank"),
        rows=[((job, str(r["rank"])), r["rpo_s"]) for job, r in ranks if r["rpo_s"] is not None],
    )
    yield _gauge(
        "snapshotd_rank_copies",
        "Live holders of the rank's copy of G",
        labels=("job", "rank"),
        rows=[((job, str(r["rank"])), r["copies"]) for job, r in ranks],
    )
