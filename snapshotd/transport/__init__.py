"""Message connections between snapshotd's processes (the transport seam; see :mod:`.base`).

:func:`open_network` gives a daemon its :class:`Network`: ZeroMQ for ``tcp://`` and ``ipc://`` addresses, the
process's in-memory network for ``mem://`` ones. :func:`connect_rank` gives a training process its
:class:`ThreadPipe` to the node's sidecar, :func:`connect_blocking` any code without an event loop its pipe to a
server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .base import Frames, Network, Pipe, Role, Security, ThreadPipe, TransportError
from .memory import MemoryNetwork

__all__ = [
    "MEMORY",
    "Frames",
    "Network",
    "Pipe",
    "Role",
    "Security",
    "ThreadPipe",
    "TransportError",
    "connect_blocking",
    "connect_rank",
    "is_memory",
    "open_network",
]

MEMORY = MemoryNetwork()
"""This process's in-memory network (``mem://`` addresses)."""


def is_memory(address: str) -> bool:
    return address.startswith("mem://")


def open_network(
    address: str, security: Security, is_member: Callable[[str], Awaitable[bool]] | None = None
) -> Network:
    """The network for a daemon whose addresses are like ``address`` (call from its running event loop).

    Args:
        address: one of the daemon's addresses (its bind address): its scheme picks the transport.
        security: the job's secret and data-plane mode (ZeroMQ only).
        is_member: ``members`` mode: the coordinator's member check for the data plane (ZeroMQ only).
    """
    if is_memory(address):
        return MEMORY
    from .zeromq import ZmqNetwork

    return ZmqNetwork(security, is_member)


def connect_blocking(address: str, *, secret: str | None = None) -> ThreadPipe:
    """A blocking client pipe to the server at ``address`` (a CURVE client of the job's servers with ``secret``),
    for code with no event loop: a training process's channel, ``snapshotd status``.

    Raises:
        ValueError: ``address`` is not an endpoint.
    """
    if is_memory(address):
        return MEMORY.connect(address, Role.RANK)
    from .zeromq import ZmqThreadPipe

    return ZmqThreadPipe(address, secret=secret)


def connect_rank(sidecar: str) -> ThreadPipe:
    """A training process's pipe to its node's sidecar: ``sidecar`` is the sidecar's ipc path (its ``--ipc``), or
    a ``mem://`` name for one in this process."""
    return connect_blocking(sidecar if is_memory(sidecar) else f"ipc://{sidecar}")
