"""The coordinator process: binds the control socket, serves :class:`~.loop.Server` over it until stopped, and
shuts down (signals, metrics endpoint, sockets, ZeroMQ context)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from snapshotd import security
from snapshotd.logs import fields
from snapshotd.transport import Pipe, Role, Security, open_network

from .config import CoordinatorConfig
from .held import HeldPlans
from .loop import Server
from .state import CoordinatorState

__all__ = ["run_coordinator"]

log = logging.getLogger(__name__)


async def run_coordinator(
    cfg: CoordinatorConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve the control plane until ``stop`` is set, or SIGTERM / SIGINT arrives.

    Signal handlers are installed only when running in the main thread (and removed on exit). On stop, the
    requests already received are answered (held plan requests with their answer now, usually ``wait``, so that
    their sidecars ask again at once), then every socket is closed (linger 0), the ZAP handler stopped and the
    ZeroMQ context terminated.

    Args:
        cfg: the configuration; with ``cfg.secret`` the socket is a CURVE server that admits only job members.
        ready: called once with the bound endpoint (a port 0 in ``cfg.bind`` resolved to the real port).
        stop: set it to shut down; a private one is used when None.

    Raises:
        ValueError: a routable bind without a secret and without ``insecure``.
        OSError: the endpoint cannot be bound (in use, bad address).
    """
    security.check_bind(cfg.bind, cfg.secret, cfg.insecure)
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    network = open_network(cfg.bind, Security(cfg.secret))
    pipe: Pipe | None = None
    handled: list[signal.Signals] = []
    metrics: Any = None  # a snapshotd.metrics.MetricsEndpoint
    try:
        try:
            pipe = network.serve(cfg.bind, Role.CONTROL)
        except OSError as exc:
            raise OSError(f"cannot bind the coordinator to {cfg.bind}: {exc}") from exc
        endpoint = pipe.address
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        server = Server(pipe, CoordinatorState(cfg, time.monotonic()), HeldPlans(cfg.plan_hold))
        if cfg.metrics_bind is not None:
            from snapshotd.metrics import MetricsEndpoint  # prometheus-client only when asked

            from .metrics import coordinator_sampler

            metrics = MetricsEndpoint(cfg.metrics_bind, coordinator_sampler(server.state))
            log.info("coordinator metrics on %s", metrics.url, extra=fields(event="metrics"))
        log.info(
            "coordinator on %s: replicas %d, heartbeat timeout %g s, %s",
            endpoint,
            cfg.replicas,
            cfg.heartbeat_timeout,
            "CURVE" if cfg.secret else "no secret",
        )
        if ready is not None:
            ready(endpoint)
        await server.serve(stop, min(0.1, cfg.heartbeat_timeout / 4))
        log.info("coordinator on %s stopped", endpoint)
    finally:
        if metrics is not None:
            metrics.close()
        for sig in handled:
            loop.remove_signal_handler(sig)
        if pipe is not None:
            pipe.close()
        network.close()
