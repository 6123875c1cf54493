"""Probes: is a node suspected dead still there? One TCP (or ipc) connection to its data address says.

A node is declared dead when its heartbeats have been missing for the death timeout (:mod:`.membership`). Some
events point at a death sooner: a rank in live mode reports that a peer of its process group was lost (its
connection closed: :class:`~snapshotd.proto.PeerLostReport`), or a rank asks for its plan from another node while the
node holding its own copies still counts as live (:meth:`~.plans.Plans.plan`). The nodes they point at are
queued (:meth:`~.membership.Membership.suspect`, at most once per heartbeat interval each) and the coordinator's
loop opens a connection to each one's data address (:class:`Prober`):

- refused (nothing listens there, but the host answers: the sidecar's process is gone, as when a node's
  processes are killed, a container is deleted or preempted, or the sidecar crashed), and the node has also
  missed a heartbeat (silent for :data:`SILENCE_INTERVALS` of the intervals it was given, waited for if need
  be): the node is declared dead at once
  (:meth:`~.state.CoordinatorState.lose`). A sidecar whose heartbeats keep coming (no gap of
  :data:`SILENCE_INTERVALS` intervals) is not declared dead by a probe, whatever its data address answers (a
  firewall's reset, a listener not open yet);
- opened twice, a heartbeat interval apart (the sidecar lives: the suspicion was wrong), timed out or
  unreachable (the host itself is gone or cut off, and cannot answer): nothing changes, and the death timeout
  decides, as without a probe.

The probe sends nothing: the connection is closed as soon as it opens, before any handshake, so a data plane with
a secret or a member check sees a peer that left. The coordinator must be able to reach the nodes' data addresses
(they are what buddies connect to). A data address only its own host can reach (loopback, ``ipc://``) is probed
only by a coordinator bound to one itself (every sidecar that reaches it then shares its host); else it is not
probed and the death timeout decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .membership import Node
from .state import CoordinatorState

__all__ = ["MAX_PROBES", "Prober", "SILENCE_INTERVALS", "host_local", "probe"]

log = logging.getLogger(__name__)

MAX_PROBES = 64
"""Connection attempts in flight at once; the others wait their turn (a check waiting between its probes holds
none)."""

SILENCE_INTERVALS = 1.5
"""How many of its heartbeat intervals a node whose data address refused must also have been silent for before
it is declared dead (it missed a heartbeat)."""


def host_local(addr: str) -> bool:
    """Whether ``addr`` (an endpoint) can be reached from its own host only: ``ipc://``, ``mem://``, or TCP on a
    loopback address or ``localhost``."""
    if not addr.startswith("tcp://"):
        return addr.startswith(("ipc://", "mem://"))
    host = (urlsplit(addr).hostname or "").strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def probe(data_addr: str, timeout: float) -> bool | None:
    """Whether a connection to ``data_addr`` (``tcp://HOST:PORT`` or ``ipc://PATH``) opens: True; False if it
    is refused (for ipc, also when the socket file is gone); None when it cannot tell (timed out, unreachable, an
    address of another kind)."""
    try:
        async with asyncio.timeout(timeout):
            if data_addr.startswith("tcp://"):
                host, _, port = data_addr[len("tcp://") :].rpartition(":")
                _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            elif data_addr.startswith("ipc://"):
                _, writer = await asyncio.open_unix_connection(data_addr[len("ipc://") :])
            else:
                return None
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except (TimeoutError, OSError, ValueError):
        return None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class Prober:
    """Runs the probes of the suspects the state queues, and declares dead the nodes found gone.

    The probes are tasks of the prober's own task group: enter it (``async with prober:``) around the loop that
    calls :meth:`start`; leaving it cancels the probes still running and waits for them.

    Args:
        state: the coordinator's state (its membership holds the queue; its configuration's ``bind`` tells
            whether host-local data addresses can be probed, see :func:`host_local`).
        on_death: called after a node was declared dead (the server re-plans held requests).
        clock: the coordinator's clock, the one its state's ``now`` is read from (node silences are measured
            on it).
    """

    def __init__(
        self,
        state: CoordinatorState,
        on_death: Callable[[], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.on_death = on_death
        self.clock = clock
        self.shares_host = host_local(state.cfg.bind)
        self._group: asyncio.TaskGroup | None = None
        self._running: set[asyncio.Task[bool]] = set()
        self._connecting = asyncio.Semaphore(MAX_PROBES)

    async def __aenter__(self) -> Prober:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in self._running:
            task.cancel()
        group, self._group = self._group, None
        assert group is not None
        await group.__aexit__(*exc)

    def start(self) -> None:
        """Start a check (:meth:`check`) of each queued suspect (at most one per live node: the queue holds each
        once per heartbeat interval).

        Raises:
            RuntimeError: outside ``async with`` the prober (no task group to run the probes in).
        """
        membership = self.state.membership
        if not membership.suspects:
            return
        if self._group is None:
            raise RuntimeError("the prober starts probes only inside `async with prober`")
        timeout = min(1.0, self.state.cfg.heartbeat_timeout / 2)
        for node, why in membership.take_suspects(len(membership.suspects)):
            if host_local(node.data_addr) and not self.shares_host:
                continue  # another host's loopback: this one's would answer
            task = self._group.create_task(self.check(node, node.incarnation, why, timeout))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def check(self, node: Node, incarnation: str, why: str, timeout: float) -> bool:
        """Probe ``node`` (as ``incarnation``) and declare it dead if its data address refuses and it missed a
        heartbeat (see the module docstring); True if it was declared dead here.

        A probe that opens is repeated once, a heartbeat interval later: the sidecar of a node whose processes
        are all being killed may close its listener a little after the ranks whose loss was reported. Returns
        within twice ``timeout`` plus 2.5 heartbeat intervals, and the wait for a connection slot
        (:data:`MAX_PROBES`).
        """
        try:
            for attempt in range(2):
                async with self._connecting:
                    found = await probe(node.data_addr, timeout)
                if found is None or (found and attempt):
                    return False
                silent_at = node.last_seen + SILENCE_INTERVALS * node.told
                await asyncio.sleep(node.told if found else max(0.0, silent_at - self.clock()))
                if not node.alive or node.incarnation != incarnation:
                    return False
                if found:
                    continue
                now = self.clock()
                if now < node.last_seen + SILENCE_INTERVALS * node.told - 0.01:
                    return False  # it heartbeated while its data address refused
                if not self.state.lose(
                    node,
                    incarnation,
                    f"refused a connection to its data address "
                    f"{node.data_addr} and was silent for {now - node.last_seen:.1f} s {why}",
                ):
                    return False
                self.on_death()
                return True
            return False
        except Exception:  # a bug must not end the coordinator's loop: the death timeout still decides
            log.exception("probe of node %s failed", node.name)
            return False
