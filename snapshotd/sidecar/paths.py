"""The paths from this sidecar to its peers: which ones work, which are broken, and probes that see them heal.

A node's heartbeats reach the coordinator over one path; its snapshots reach its buddies over others. A cut or
gray link between two live nodes (a flapping port, a firewall rule, an MTU mismatch, a NIC dropping under load)
leaves both nodes heartbeating while every stream between them stalls. :class:`PeerPaths` makes the data path
its own failure signal:

- **Broken.** A peer's path breaks when a transfer to it fails for want of an answer or a connection
  (:class:`~.peers.PeerTimeout` after the peer timeout, a push connection that fails), or when it cannot keep
  up: transfers to it were under way for a whole peer timeout (the time they were in flight, from the first
  since the last one that completed; a pause longer than a peer timeout starts the count again), at least one
  of them ended unfinished (a newer step superseded it), and none completed. A newer step supersedes a stream
  in flight, so on a dead or crawling link streams end cancelled rather than timed out; one long stream that
  is merely paced is never superseded and never counts. A peer that answers, even with a refusal (a full
  store), has a working path.
- **Why.** A probe (one TCP connection to the peer's data address, closed at once, as the coordinator's) tells
  the two kinds apart: no connection is ``unreachable``, a connection is ``slow`` (the link carries packets but
  not the snapshots, in time).
- **Told.** Every heartbeat carries the broken peers (:attr:`~snapshotd.proto.Heartbeat.unreachable`); a change
  sends one at once. The coordinator places no buddy across a broken pair while another node can take the copy
  (:mod:`snapshotd.coordinator.paths`). A warning names the pair when it breaks and when it heals.
- **Healed.** An ``unreachable`` path heals at the first probe that connects, once it was broken for
  :data:`PROBE_AFTER_TIMEOUTS` peer timeouts; a ``slow`` one after :data:`SLOW_QUARANTINE_S` seconds and a probe
  that connects (a probe cannot tell a slow link from a fast one, and placing a stream on a slow link again holds
  the job's durable step back again). Any transfer that completes heals a path at once. A path with no
  transfer for :data:`FORGET_AFTER_S` seconds is forgotten (a peer gone for good is not probed for ever).

It belongs to the sidecar's event loop: not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any
from urllib.parse import urlsplit

from snapshotd.logs import fields
from snapshotd.proto import PathTrouble

__all__ = ["PROBE_AFTER_TIMEOUTS", "SLOW_QUARANTINE_S", "PeerPath", "PeerPaths"]

log = logging.getLogger(__name__)

PROBE_AFTER_TIMEOUTS = 3
"""An unreachable path is probed once it was broken for this many peer timeouts, then at every check."""
SLOW_QUARANTINE_S = 300.0
"""A slow path stays broken at least this long."""
FORGET_AFTER_S = 1200.0
"""A path with no transfer for this long is forgotten, broken or not (its peer is gone, or no longer a buddy or a
holder); were it still broken, its next transfer finds out again."""
REASONS = ("timeout", "stalled")
"""What failures are counted by (:attr:`PeerPath.failures`)."""


@dataclasses.dataclass(slots=True)
class PeerPath:
    """What this sidecar knows of its path to one peer."""

    addr: str
    in_flight: int = 0
    """Transfers to it under way."""
    trying_since: float | None = None
    """When the transfers under way since the last one that completed began (None: none, or one completed)."""
    last_end: float = 0.0
    """When the last transfer to it ended (monotonic)."""
    unfinished: int = 0
    """Transfers to it that ended without completing since ``trying_since``."""
    last_success: float | None = None
    """When a transfer to it last completed (monotonic; None: never)."""
    failures: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    """Failures by reason: ``timeout`` (a transfer got no answer or no connection), ``stalled`` (transfers under
    way for a peer timeout, superseded unfinished, none completed)."""
    broken_since: float | None = None
    """When it broke (None: it works)."""
    reason: str = ""
    """Why it is broken, for people (``unreachable: ...`` or ``slow: ...``; the failure seen until a probe)."""
    kind: str = ""
    """``unreachable``, ``slow``, or ``""`` until the first probe."""
    probing: bool = False


class PeerPaths:
    """The paths from this sidecar (node ``node``) to its peers (see the module docstring).

    Args:
        node: this node's name, for the warnings.
        timeout: the peer timeout, seconds.
        on_change: called whenever the set of broken paths, or why one is broken, changes.
        source: the IP address probes leave from (``members`` mode), or None.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        node: str,
        timeout: float,
        on_change: Callable[[], None],
        *,
        source: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.timeout = timeout
        self.on_change = on_change
        self.source = source
        self.clock = clock
        self.paths: dict[str, PeerPath] = {}

    def _path(self, addr: str) -> PeerPath:
        path = self.paths.get(addr)
        if path is None:
            path = self.paths[addr] = PeerPath(addr, last_end=self.clock())
        return path

    @contextlib.contextmanager
    def transfer(self, addr: str) -> Iterator[None]:
        """Count a transfer to ``addr`` while the block runs: one that returns completed, one that raises did
        not (see :meth:`failed` for a timeout)."""
        path = self._path(addr)
        now = self.clock()
        if path.trying_since is None or (path.in_flight == 0 and now - path.last_end > self.timeout):
            path.trying_since, path.unfinished = now, 0  # transfers a peer timeout apart are not one stall
        path.in_flight += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            path.in_flight -= 1
            path.last_end = self.clock()
            if ok:
                self.succeeded(addr)
            elif path.trying_since is not None:
                path.unfinished += 1

    def succeeded(self, addr: str) -> None:
        """A transfer to ``addr`` completed: its path works."""
        path = self._path(addr)
        path.last_success = path.last_end = self.clock()
        path.trying_since, path.unfinished = None, 0
        if path.broken_since is not None:
            self._heal(path, "a transfer completed")

    def failed(self, addr: str, why: str) -> None:
        """A transfer to ``addr`` got no answer in time or no connection (``why`` says how): its path is broken."""
        path = self._path(addr)
        path.failures["timeout"] += 1
        path.last_end = self.clock()
        self._break(path, why)

    def check(self) -> list[str]:
        """Break the paths whose transfers stalled for a peer timeout; the broken paths to probe now."""
        now = self.clock()
        for addr, path in list(self.paths.items()):
            busy = (now if path.in_flight else path.last_end) - (path.trying_since or now)
            if path.broken_since is None and path.unfinished and busy >= self.timeout:
                path.failures["stalled"] += 1
                self._break(path, f"no transfer completed for {busy:.1f} s")
            elif not path.in_flight and not path.probing and now - path.last_end > FORGET_AFTER_S:
                del self.paths[addr]  # no transfer for a long time: a peer gone for good, or idle
                if path.broken_since is not None:
                    self.on_change()
        return [
            p.addr
            for p in self.paths.values()
            if p.broken_since is not None
            and not p.probing
            and (
                not p.kind
                or (p.kind == "unreachable" and now - p.broken_since >= PROBE_AFTER_TIMEOUTS * self.timeout)
                or (p.kind == "slow" and now - p.broken_since >= SLOW_QUARANTINE_S)
            )
        ]

    async def probe(self, addr: str) -> None:
        """Connect to ``addr``'s data port once (closed at once): classify a new break, or heal an old one."""
        path = self._path(addr)
        if path.probing or path.broken_since is None:
            return
        path.probing = True
        try:
            error = await self._connect(addr)
        finally:
            path.probing = False
        if path.broken_since is None:  # healed meanwhile by a transfer
            return
        if not path.kind:
            path.kind = "unreachable" if error else "slow"
            path.reason = (
                f"unreachable: {error}"
                if error
                else f"slow: it connects, but {path.reason or 'transfers stall'} (the peer timeout is "
                f"{self.timeout:g} s)"
            )
            log.warning(
                "node %s: the snapshot path to peer %s is %s",
                self.node,
                addr,
                path.reason,
                extra=fields(event="path_classified"),
            )
            self.on_change()
        elif not error:
            self._heal(path, "a probe connected")

    async def _connect(self, addr: str) -> str:
        """An error connecting to ``addr``'s data port within the peer timeout ("" when it connected)."""
        url = urlsplit(addr)
        if url.scheme != "tcp" or url.hostname is None or url.port is None:
            return ""  # ipc: a path on this host, never cut
        local = (self.source, 0) if self.source else None
        try:
            async with asyncio.timeout(min(self.timeout, 5.0)):
                _, writer = await asyncio.open_connection(url.hostname, url.port, local_addr=local)
        except TimeoutError:
            return f"connecting to {url.hostname}:{url.port} timed out"
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            return f"connecting to {url.hostname}:{url.port} failed: {why}"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return ""

    def troubles(self) -> tuple[PathTrouble, ...]:
        """The broken paths, for the heartbeat."""
        return tuple(
            PathTrouble(addr=p.addr, reason=p.reason[:1000])
            for p in sorted(self.paths.values(), key=lambda p: p.addr)
            if p.broken_since is not None
        )

    def _break(self, path: PeerPath, why: str) -> None:
        if path.broken_since is not None:
            return
        path.broken_since = self.clock()
        path.reason, path.kind = why, ""
        log.warning(
            "node %s: the snapshot path to peer %s is broken: %s; told to the coordinator, which places copies "
            "elsewhere",
            self.node,
            path.addr,
            why,
            extra=fields(event="path_broken"),
        )
        self.on_change()

    def _heal(self, path: PeerPath, how: str) -> None:
        broken_for = self.clock() - (path.broken_since or 0.0)
        path.broken_since, path.reason, path.kind = None, "", ""
        path.trying_since = None
        log.warning(
            "node %s: the snapshot path to peer %s healed after %.1f s (%s)",
            self.node,
            path.addr,
            broken_for,
            how,
            extra=fields(event="path_healed"),
        )
        self.on_change()


class PathService:
    """Checks the paths every ``interval`` seconds (the daemon: a heartbeat interval, or a quarter of the peer
    timeout if shorter) and probes the broken ones (see :class:`PeerPaths`)."""

    def __init__(
        self, paths: PeerPaths, interval: float, spawn: Callable[[Coroutine[Any, Any, None], str], object]
    ) -> None:
        self.paths = paths
        self.interval = interval
        self.spawn = spawn

    async def run(self) -> None:
        while True:
            for addr in self.paths.check():
                self.spawn(self.paths.probe(addr), f"probe of the path to {addr}")
            await asyncio.sleep(self.interval)
