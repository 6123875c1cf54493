"""Prometheus metrics of the daemons: ``--metrics-bind HOST:PORT`` serves ``/metrics`` (prometheus-client).

The daemons keep plain counters and state on their event loop (:class:`~snapshotd.sidecar.node.Counters`, the
coordinator's jobs and membership) and know nothing of Prometheus. A scrape arrives on prometheus-client's HTTP
thread; :class:`LoopCollector` runs the daemon's sampler on the event loop (the one thread that may read that
state) and turns what it returns into metric families there. Nothing is kept between scrapes: a rank or node that
went away is simply absent from the next one (byte counters per peer stay, for every peer seen, as counters
must).

Every name of the daemons' own starts with ``snapshotd_``; prometheus-client's process, platform and garbage
collector collectors add ``process_*`` and ``python_*``. The training job a series is about is its
:data:`JOB_LABEL` label, never ``job``: that one is Prometheus's own (the scrape job). A value that is not known
is no sample, never a stand-in such as -1. Durations are histograms on :data:`~snapshotd.tally.LATENCY_BUCKETS`.
The tables of names and meanings are in docs/reference.md ("Operations"); deploy/monitoring holds a dashboard and
alert rules over them. The samplers are the daemons' own: :mod:`snapshotd.sidecar.metrics`,
:mod:`snapshotd.coordinator.metrics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from snapshotd.units import parse_host_port

__all__ = [
    "JOB_LABEL",
    "LoopCollector",
    "MetricsEndpoint",
    "Sampler",
    "counter",
    "family",
    "gauge",
    "histogram",
]

log = logging.getLogger(__name__)

Sampler = Callable[[], Coroutine[Any, Any, list[Metric]]]
"""Samples a daemon's metrics on its event loop."""

JOB_LABEL = "snapshotd_job"
"""The label naming the training job (``job`` is the scrape job's, which Prometheus sets on every series)."""

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
    """An HTTP server on ``bind`` (``HOST:PORT``) answering ``/metrics`` from ``sample``, in a daemon thread,
    with the process's own figures (CPU, memory, file descriptors, the Python build, the garbage collector).

    Start it from the daemon's event loop; :meth:`close` stops the server and joins its thread.

    Raises:
        ValueError: a malformed ``bind``.
        OSError: the address cannot be bound, naming it.
    """

    def __init__(self, bind: str, sample: Sampler) -> None:
        host, port = parse_host_port(bind, "--metrics-bind")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(LoopCollector(asyncio.get_running_loop(), sample))  # type: ignore[arg-type]
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
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


def histogram(
    name: str,
    doc: str,
    labels: Iterable[str] = (),
    rows: Iterable[tuple[Iterable[str], Sequence[tuple[float, int]], int, float]] = (),
) -> Metric:
    """A histogram family: each row is ``(label values, buckets, count, sum)``, the buckets ``(bound,
    observations at or under it)`` for the finite bounds in order (``count`` is the ``+Inf`` bucket's)."""
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    for values, buckets, count, total in rows:
        le = [(floatToGoString(bound), float(n)) for bound, n in buckets]
        fam.add_metric(list(values), [*le, ("+Inf", float(count))], total)
    return fam


def family(
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


def _maker(kind: type[GaugeMetricFamily | CounterMetricFamily]) -> Callable[..., Metric]:
    """A maker of ``kind`` families: ``make(name, doc, value)`` for one unlabelled value, or ``make(name, doc,
    labels=..., rows=[(label values, value), ...])``."""

    def make(
        name: str,
        doc: str,
        value: float | None = None,
        labels: Iterable[str] = (),
        rows: Iterable[tuple[Iterable[str], float]] = (),
    ) -> Metric:
        return family(kind, name, doc, labels, [((), value)] if value is not None else rows)

    return make


gauge = _maker(GaugeMetricFamily)
counter = _maker(CounterMetricFamily)
