"""``snapshotd serve``: the node's sidecar, wired from its services.

Three kinds of connection (pipes of :mod:`snapshotd.transport`: ZeroMQ sockets, or in-memory ones for
``mem://`` addresses), one event loop (uvloop), one task tree (:mod:`.tasks`):

- **ipc** (ROUTER, owner-only): local training ranks register, announce staged slots, ask to restore
  (:mod:`.ingest`, :mod:`.stream`, :mod:`.restore`).
- **data** (ROUTER, TCP): buddies stream snapshots in; peers pull complete snapshots out (:mod:`.serve`).
- **control** (DEALERs to the coordinator): registration, heartbeats with inventory, recovery plans, and
  re-replication tasks (:mod:`.heartbeat`, :mod:`.control`, :mod:`.replicate`).

The services share one :class:`~.node.NodeState`. Every request handler is an error boundary: a request that
fails, for any reason, gets an ``Error`` reply and a log line, and the sidecar keeps serving. Nothing here raises
into a training process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from snapshotd import proto
from snapshotd.logs import fields
from snapshotd.proto import Drain, DrainReply, Error, ErrorCode, Message, ProtocolError
from snapshotd.security import check_bind, members_source
from snapshotd.shm import sweep_stale_arenas
from snapshotd.transport import Pipe, Role, Security, is_memory, open_network

from .bulk import BulkServer
from .config import SidecarConfig
from .control import CoordinatorClient, CoordinatorUnavailable
from .heartbeat import ControlService
from .ingest import ArenaRefused, IngestService, RankNotices
from .node import NodeState
from .outbox import Outbox
from .pacer import Pacer
from .paths import PathService
from .peers import PeerLinks
from .replicate import ReplicateService
from .restore import RestoreService
from .serve import ServeService
from .store import MemoryLimitReached, UnknownSnapshot
from .stream import StreamService
from .tasks import ServiceDied, TaskTree

__all__ = ["Sidecar", "run_sidecar"]

log = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.25
"""The least time between two drain requests of a draining sidecar (see :meth:`Sidecar._drain`; the coordinator
holds a drain while copies remain to place, :mod:`snapshotd.coordinator.asks`)."""
DRAIN_REQUEST_TIMEOUT = 5.0
"""How long a drain request may go unanswered (the coordinator holds one for ``plan_hold``, 3 s by default) before
the sidecar stops without draining."""

_DATA_ERRORS = {
    MemoryLimitReached: ErrorCode.MEMORY_LIMIT,
    UnknownSnapshot: ErrorCode.NOT_FOUND,
    ArenaRefused: ErrorCode.MEMORY_LIMIT,
}
"""Wire error codes of the expected refusals; any other ProtocolError is a bad chunk (data plane) or a bad
message (ipc)."""


class Sidecar:
    """One node's sidecar. Create, then ``await run(ready, stop)``; everything is closed when it returns.

    It runs in any event loop, in-process too (tests build several in one process on loopback).
    """

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.state = NodeState(cfg)
        self.tasks = TaskTree(self.state.counters)
        self.pacer = Pacer(cfg.max_rate, budget=cfg.step_budget)

    async def run(
        self, ready: Callable[[str, str], None] | None = None, stop: asyncio.Event | None = None
    ) -> None:
        """Bind, register, serve until ``stop`` is set or SIGTERM/SIGINT comes (in the main thread), then clean up.
        After a signal the sidecar first drains (see :meth:`_drain`), until a second signal at most.

        Raises:
            ServiceDied: a service of the sidecar ended or failed (see :mod:`.tasks`); the sidecar stopped.
        """
        cfg = self.cfg
        stop = stop or asyncio.Event()
        signalled = asyncio.Event()

        def on_signal() -> None:  # the first signal drains, the next stops
            (stop if signalled.is_set() else signalled).set()

        check_bind(cfg.data_bind, cfg.secret, cfg.insecure)
        sweep_stale_arenas(cfg.node)
        _keep_malloc_arenas()
        if cfg.nice:
            os.nice(cfg.nice)
        members = cfg.secret is not None and cfg.data_security == "members"
        control: CoordinatorClient | None = None

        async def is_member(host: str) -> bool:
            assert control is not None
            return await control.is_member(host, min(5.0, cfg.request_timeout))

        network = open_network(
            cfg.data_bind, Security(cfg.secret, cfg.data_security), is_member if members else None
        )
        control = CoordinatorClient(network, cfg.coordinator, tasks=self.tasks)
        pipes: list[Pipe] = []
        links: PeerLinks | None = None
        bulk: BulkServer | None = None
        installed: list[signal.Signals] = []
        metrics: Any = None  # a snapshotd.metrics.MetricsEndpoint
        try:
            ipc = network.serve(cfg.ipc if is_memory(cfg.ipc) else f"ipc://{cfg.ipc}", Role.IPC)
            pipes.append(ipc)
            data = network.serve(cfg.data_bind, Role.DATA)
            pipes.append(data)
            self.state.data_addr = data.address if is_memory(data.address) else self._advertised(data.address)
            log.info(
                "sidecar %s: ipc %s, data %s (bound %s), coordinator %s",
                cfg.node,
                ipc.address,
                self.state.data_addr,
                data.address,
                cfg.coordinator,
            )
            source = members_source(self.state.data_addr) if members else None
            links = PeerLinks(network, timeout=cfg.request_timeout, source=source, tasks=self.tasks)
            self.state.paths.source = source
            ipc_out = Outbox(self.state.counters, cfg.request_timeout)
            data_out = Outbox(self.state.counters, cfg.request_timeout)
            notices = RankNotices(ipc_out)
            streams = StreamService(self.state, cfg, links, self.pacer, self.tasks, notices.slots)
            restores = RestoreService(self.state, cfg, control, links, ipc_out, notices.slots)
            ingest = IngestService(
                self.state, notices, streams, restores, self.tasks, self.pacer, cfg.chunk_bytes, control
            )
            if cfg.serves_bulk and not is_memory(data.address):
                assert cfg.bulk_port is not None
                bulk = BulkServer(
                    _bind_host(data.address),
                    cfg.bulk_port,
                    served=self.state.counters.served,
                    timeout=cfg.request_timeout,
                )
                log.info("sidecar %s: bulk port %d", cfg.node, bulk.port)
            serve = ServeService(self.state, data_out, self.tasks, bulk)
            heartbeat = ControlService(
                self.state,
                cfg,
                control,
                streams,
                serve,
                ReplicateService(self.state, links),
                self.tasks,
                notices.slots,
            )
            if cfg.metrics_bind is not None:
                from snapshotd.metrics import MetricsEndpoint  # prometheus-client only when asked

                from .metrics import sidecar_sampler

                metrics = MetricsEndpoint(cfg.metrics_bind, sidecar_sampler(self.state, self.pacer))
                log.info("sidecar %s: metrics on %s", cfg.node, metrics.url, extra=fields(event="metrics"))
            loop = asyncio.get_running_loop()
            if threading.current_thread() is threading.main_thread():  # before it says it is ready
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, on_signal)
                    installed.append(sig)
            if ready is not None:
                ready(self.state.data_addr, cfg.ipc)
            try:
                async with asyncio.TaskGroup() as group:
                    self.tasks.attach(group)
                    self.tasks.service(network.run(), "the network's security handlers")
                    self.tasks.service(self._serve(ipc, ipc_out, ingest.handle, "ipc"), "the ipc endpoint")
                    self.tasks.service(ipc_out.run(ipc), "ipc replies")
                    self.tasks.service(
                        self._serve(data, data_out, serve.handle, "data plane"), "the data endpoint"
                    )
                    self.tasks.service(data_out.run(data), "data-plane replies")
                    self.tasks.service(heartbeat.run(), "the control loop")
                    every = min(cfg.heartbeat_interval, cfg.request_timeout / 4)
                    paths = PathService(self.state.paths, every, self.tasks.spawn)
                    self.tasks.service(paths.run(), "the path checks")
                    self.tasks.service(control.watch(), "the coordinator connection's handshakes")
                    await _first(stop, signalled)
                    if signalled.is_set() and not stop.is_set() and cfg.drain_timeout > 0:
                        await self._drain(control, stop)
                    log.info("sidecar %s: stopping", cfg.node)
                    self.tasks.cancel_all()
            except BaseExceptionGroup as group:  # a service's end stops the sidecar with its own error
                died = ServiceDied.first_in(group)
                if died is None:
                    raise
                raise died from None
        finally:
            if metrics is not None:
                metrics.close()
            for sig in installed:
                asyncio.get_running_loop().remove_signal_handler(sig)
            if links is not None:
                links.close()
            if bulk is not None:
                bulk.close()
            control.close()
            for pipe in pipes:
                pipe.close()
            network.close()
            for lr in list(self.state.ranks.values()):
                lr.arena.close(unlink=True)
            if not is_memory(cfg.ipc):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(cfg.ipc)

    async def _drain(self, control: CoordinatorClient, stop: asyncio.Event) -> None:
        """Serve on while the coordinator places elsewhere every snapshot at a job's G that this node holds and no
        node that stays holds (see :class:`~snapshotd.proto.Drain`); until it counts none, ``drain_timeout``
        passes, ``stop`` is set (a second signal), or the coordinator cannot drain (it does not answer, or
        predates draining). Each end but the first is logged as a warning."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        deadline = loop.time() + cfg.drain_timeout
        msg = Drain(node=cfg.node, incarnation=self.state.incarnation)
        log.info(
            "sidecar %s: draining for at most %.0f s (a second SIGTERM stops at once)",
            cfg.node,
            cfg.drain_timeout,
            extra=fields(event="draining"),
        )
        reply: DrainReply | None = None
        while True:
            sent = loop.time()
            asked = asyncio.ensure_future(
                control.drain(msg, max(0.1, min(DRAIN_REQUEST_TIMEOUT, deadline - sent)))
            )
            try:
                await _first(stop, asked)
            finally:
                unanswered = not asked.done()
                if unanswered:  # a second signal, or this task cancelled
                    asked.cancel()
                elif not asked.cancelled():
                    asked.exception()  # read here too, should this task be cancelled now: no "never retrieved" log
            if unanswered:
                log.warning("sidecar %s: stopped before it drained", cfg.node)
                return
            try:
                answer = asked.result()
            except (CoordinatorUnavailable, ProtocolError) as exc:
                log.warning("sidecar %s: stopping without draining: %s", cfg.node, exc)
                return
            # None: the coordinator restarted; the heartbeat loop registers this node again
            reply = answer or reply
            if answer is not None and answer.remaining == 0:
                if answer.unplaceable:
                    log.warning(
                        "sidecar %s: drained, but %d snapshot(s) held only here have no other node to go "
                        "to: they are lost",
                        cfg.node,
                        answer.unplaceable,
                    )
                log.info("sidecar %s: drained", cfg.node, extra=fields(event="drained"))
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(sent + DRAIN_POLL_SECONDS, deadline) - loop.time())):
                    await stop.wait()
            short = "an unknown number of" if reply is None else str(reply.remaining + reply.unplaceable)
            if stop.is_set() or loop.time() >= deadline:
                log.warning(
                    "sidecar %s: %s: %s snapshot(s) it holds have fewer copies elsewhere than wanted",
                    cfg.node,
                    "stopped before it drained"
                    if stop.is_set()
                    else f"not drained after {cfg.drain_timeout:.0f} s",
                    short,
                )
                return

    def _advertised(self, bound: str) -> str:
        parts = urlsplit(bound)
        host = self.cfg.advertise or parts.hostname or socket.gethostname()
        if host in ("0.0.0.0", "::", "*"):
            host = socket.gethostname()
        return f"tcp://[{host}]:{parts.port}" if ":" in host else f"tcp://{host}:{parts.port}"

    async def _serve(
        self, pipe: Pipe, outbox: Outbox, handle: Callable[[bytes, Message], None], what: str
    ) -> None:
        """Receive requests on ``pipe`` and hand each to ``handle``: the error boundary of every request.

        A request that cannot be decoded, or that ``handle`` refuses (ProtocolError, and the data plane's
        expected refusals), is answered with an Error naming why; any other failure is this sidecar's bug, logged
        with its traceback and answered ``internal``. Either way the loop goes on. Every
        :data:`_FAIR_SHARE` requests it lets the other tasks run (a receive of a queued message does not), so
        that a flood on one socket never starves the heartbeats, the replies or the other socket.
        """
        handled = 0
        while True:
            handled += 1
            if handled % _FAIR_SHARE == 0:
                await asyncio.sleep(0)
            frames = await pipe.recv()
            ident = frames[0]
            outbox.heard(ident)
            msg: Message | None = None
            try:
                msg = proto.decode(frames[1:])
                handle(ident, msg)
            except (ProtocolError, MemoryLimitReached, UnknownSnapshot) as exc:
                self.state.counters.errors += 1
                log.warning("%s: %s", what, exc)
                code = _DATA_ERRORS.get(
                    type(exc),
                    ErrorCode.BAD_CHUNK
                    if msg is not None and what == "data plane"
                    else ErrorCode.BAD_MESSAGE,
                )
                outbox.reply(ident, _error(msg, code, str(exc)))
            except Exception as exc:
                self.state.counters.errors += 1
                log.exception("%s: a %s request failed", what, msg.TYPE if msg is not None else "malformed")
                outbox.reply(ident, _error(msg, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))


_FAIR_SHARE = 16
"""Requests a socket's loop handles before it lets the sidecar's other tasks run."""


def _error(about: Message | None, code: ErrorCode, text: str) -> Error:
    """An Error reply about ``about`` (naming its job, rank, step and request id where it has them)."""
    if about is None:
        return Error(code=code, message=text)
    return Error(
        job=about.job,
        code=code,
        message=text,
        rank=getattr(about, "rank", -1),
        step=getattr(about, "step", -1),
        request_id=getattr(about, "request_id", 0),
    )


def _keep_malloc_arenas() -> None:
    """Stop glibc from returning chunk-sized buffers to the OS after each message.

    ZeroMQ allocates every received 1-4 MiB message; above glibc's default mmap threshold each one would be a
    fresh mapping whose pages fault in on first touch.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        log.debug("mallopt is not available; leaving the allocator alone")


async def _first(*waits: asyncio.Event | asyncio.Future[Any]) -> None:
    """Return once any of ``waits`` is set (an event) or done (a future); the futures are left as they are."""
    events = [asyncio.ensure_future(w.wait()) for w in waits if isinstance(w, asyncio.Event)]
    try:
        await asyncio.wait(
            [*events, *(w for w in waits if isinstance(w, asyncio.Future))],
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        for e in events:
            e.cancel()


async def run_sidecar(
    cfg: SidecarConfig, *, ready: Callable[[str, str], None] | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run one sidecar until stopped (the ``snapshotd serve`` entry point, under ``uvloop.run``).

    Raises:
        ServiceDied: a service of the sidecar ended or failed (see :mod:`.tasks`); the sidecar stopped.
    """
    await Sidecar(cfg).run(ready, stop)


def _bind_host(bound: str) -> str:
    """The host a bulk port listens on beside the data plane bound at ``bound`` (all interfaces for a wildcard)."""
    host = urlsplit(bound).hostname or ""
    return "" if host in ("*", "0.0.0.0") else host
