"""The transport seam: what snapshotd's processes need of a message connection, and nothing more.

A :class:`Pipe` is one end of a connection that carries whole multipart messages (lists of frames: bytes,
memoryviews or ZeroMQ frames, as :func:`snapshotd.proto.decode` takes them), never split or merged:

- a *server* pipe (from :meth:`Network.serve`) talks to many peers: every message it receives is
  ``[identity, *frames]`` (``identity`` is bytes naming the peer), and a reply goes out as ``[identity, *frames]``;
- a *client* pipe (from :meth:`Network.connect`) talks to the one server it connected to: frames only.

A :class:`Network` makes the pipes of one process (a daemon) for each :class:`Role` and owns what they share (a
ZeroMQ context, its security handlers). Two implementations: ZeroMQ (:mod:`.zeromq`, every ``tcp://`` and
``ipc://`` address) and an in-memory one (:mod:`.memory`, ``mem://`` addresses, for tests that run daemons and
training ranks in one process). :func:`snapshotd.transport.open_network` picks by address.

:class:`ThreadPipe` is the blocking face of a client pipe, for the one thread of a training process that talks
to its sidecar (:class:`snapshotd.client.channel.Channel`).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
from typing import Any

__all__ = ["Frames", "Network", "Pipe", "Role", "Security", "ThreadPipe", "TransportError"]

Frames = list[Any]


class TransportError(RuntimeError):
    """A message could not be handed over: the peer it is addressed to is unknown or gone."""


class Role(enum.Enum):
    """What a pipe is for; a ZeroMQ network sets its socket's options and security from it."""

    IPC = "ipc"
    """Server: the sidecar's owner-only endpoint for the node's training ranks."""
    DATA = "data"
    """Server: the sidecar's data plane (streams in, pulls served)."""
    CONTROL = "control"
    """Server: the coordinator's endpoint."""
    PEER = "peer"
    """Client: a sidecar's connection to another sidecar's data plane."""
    COORDINATOR = "coordinator"
    """Client: a sidecar's (or ``snapshotd status``'s) connection to the coordinator."""
    RANK = "rank"
    """Client: a training process's connection to its node's sidecar (a :class:`ThreadPipe`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Security:
    """How a network secures its TCP connections (ipc and in-memory ones are the owner's alone)."""

    secret: str | None = None
    """The job's secret: CurveZMQ keys on every TCP socket (None: plaintext)."""
    data_security: str = "curve"
    """With a secret, for the data plane: ``curve``, or ``members`` (plaintext, admitting only the hosts of the
    job's live sidecars)."""


class Pipe(abc.ABC):
    """One end of a connection, used from one event loop (see the module docstring)."""

    address: str
    """The address it is bound to (a server: a port 0 resolved) or connected to (a client)."""

    @property
    def failure(self) -> str | None:
        """Why this connection's handshakes fail, when known (a wrong secret, a refused member): for the owner's
        timeout messages. None when nothing is known to be wrong."""
        return None

    @abc.abstractmethod
    async def recv(self, *, copy: bool = False) -> Frames:
        """The next message, waiting for it (the caller bounds the wait). ``copy=False`` may hand out views of
        the transport's buffers (no copy of a large payload); ``copy=True`` gives bytes."""

    @abc.abstractmethod
    def recv_nowait(self, *, copy: bool = True) -> Frames | None:
        """The next message if one is waiting, else None."""

    @abc.abstractmethod
    async def poll(self, timeout: float) -> bool:
        """Whether a message is waiting, or arrives within ``timeout`` seconds."""

    @abc.abstractmethod
    async def send(self, frames: Frames) -> None:
        """Send one message, waiting for room (the caller bounds the wait); frames may be views, not copied.

        Raises:
            TransportError: a server pipe's message to a peer that is unknown or gone.
        """

    @abc.abstractmethod
    def send_nowait(self, frames: Frames) -> bool:
        """Send one message if there is room now; False if not (nothing was sent).

        Raises:
            TransportError: a server pipe's message to a peer that is unknown or gone.
        """

    async def watch(self) -> None:
        """Follow the connection's handshakes until cancelled, keeping :attr:`failure` (a no-op wait where there
        are none to follow). Run it beside the pipe's users."""
        await asyncio.get_running_loop().create_future()

    @abc.abstractmethod
    def close(self) -> None:
        """Close the pipe: messages not yet delivered are dropped; a closed pipe is never used again."""


class ThreadPipe(abc.ABC):
    """A client pipe used from one plain thread (never from an event loop)."""

    address: str

    @abc.abstractmethod
    def send_nowait(self, frames: Frames) -> bool:
        """Send one message if there is room now; False if not (nothing was sent)."""

    @abc.abstractmethod
    def recv_nowait(self, *, copy: bool = False) -> Frames | None:
        """The next message if one is waiting, else None."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Block until a message is waiting (True), :meth:`wake` was called, or ``timeout`` seconds passed (then
        False unless a message is waiting)."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Make the :meth:`wait` in progress, or else the next one, return at once; from any thread, also after
        :meth:`close` (then it does nothing)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the pipe (and what it alone uses)."""


class Network(abc.ABC):
    """The pipes of one process, and what they share (see the module docstring)."""

    @abc.abstractmethod
    def serve(self, address: str, role: Role) -> Pipe:
        """A server pipe bound to ``address`` (port 0: a free one; see the pipe's :attr:`~Pipe.address`).

        Raises:
            OSError: the address cannot be bound (in use, not an address of this host).
        """

    @abc.abstractmethod
    def connect(self, address: str, role: Role, *, source: str | None = None) -> Pipe:
        """A client pipe to the server at ``address`` (it need not be up yet: messages wait for it); with
        ``source``, a data-plane connection that leaves from that address of this host (``members`` mode)."""

    async def run(self) -> None:
        """Serve what the network's pipes need in the background (ZeroMQ's security handlers) until cancelled."""
        await asyncio.get_running_loop().create_future()

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the network holds; every pipe it made must be closed first."""
