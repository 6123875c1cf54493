"""Probes: is a node suspected dead still there? One TCP (or ipc) connection to its data address says.

A node is declared dead when its heartbeats have been missing for the death timeout (:mod:`.membership`). Some
events point at a death sooner: a rank in live mode reports that a peer of its process group was lost (its
connection closed: :class:`~snapshotd.proto.PeerLostReport`), or a rank asks for its plan from another node while the
node holding its own copies still counts as live (:meth:`~.plans.Plans.plan`). The nodes they point at are
queued (:meth:`~.membership.Membership.suspect`, at most once per heartbeat interval each) and the coordinator's
loop opens a connection to each one's data address (:class:`Prober`):

- refused (nothing listens there, but the host answers: the sidecar's process is gone, as when a node's
  processes are killed, a container is deleted or preempted, or the sidecar crashed): the node is declared dead
  at once (:meth:`~.state.CoordinatorState.lose`);
- opened (the sidecar lives: the suspicion was wrong), timed out or unreachable (the host itself is gone or cut
  off, and cannot answer): nothing changes, and the death timeout decides, as without a probe.

The probe sends nothing: the connection is closed as soon as it opens, before any handshake, so a data plane with
a secret or a member check sees a peer that left. The coordinator must be able to reach the nodes' data addresses
(they are what buddies connect to); a firewall that rejects its connections with a reset, rather than dropping
them, would make a suspected node look dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from .membership import Node
from .state import CoordinatorState

__all__ = ["MAX_PROBES", "Prober", "probe"]

log = logging.getLogger(__name__)

MAX_PROBES = 64
"""Probes in flight at once; suspects beyond wait in the queue."""


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

    Args:
        state: the coordinator's state (its membership holds the queue).
        on_death: called after a node was declared dead (the server re-plans held requests).
    """

    def __init__(self, state: CoordinatorState, on_death: Callable[[], None]) -> None:
        self.state = state
        self.on_death = on_death
        self._running: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Start a probe for each queued suspect, up to :data:`MAX_PROBES` in flight."""
        membership = self.state.membership
        if not membership.suspects or len(self._running) >= MAX_PROBES:
            return
        timeout = min(1.0, self.state.cfg.heartbeat_timeout / 2)
        for node, why in membership.take_suspects(MAX_PROBES - len(self._running)):
            task = asyncio.get_running_loop().create_task(self._probe(node, node.incarnation, why, timeout))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _probe(self, node: Node, incarnation: str, why: str, timeout: float) -> None:
        try:
            found = await probe(node.data_addr, timeout)
            if found is False and self.state.lose(
                node, incarnation, f"refused a connection to its data address {node.data_addr} {why}"
            ):
                self.on_death()
        except Exception:  # a bug must not end the coordinator's loop: the death timeout still decides
            log.exception("probe of node %s failed", node.name)

    async def close(self) -> None:
        """Cancel the probes in flight and wait for them."""
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
