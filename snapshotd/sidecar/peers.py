"""Connections from this sidecar to other sidecars' data planes.

One :class:`PeerLink` (a DEALER socket) per remote data address, shared by every stream to that peer and every
pull from it. Replies are routed by ``(job, rank, step)`` to whoever subscribed to that key, so several streams
and pulls share one connection without reading each other's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from snapshotd.proto import Message, ProtocolError, decode, encode
from snapshotd.security import HandshakeWatch, secure_client

if TYPE_CHECKING:
    from .tasks import TaskTree

__all__ = ["PeerError", "PeerLink", "PeerLinks", "PeerTimeout"]

log = logging.getLogger(__name__)

Key = tuple[str, int, int]


class PeerError(RuntimeError):
    """A peer refused or failed a transfer (its Error reply, or an unexpected message)."""


class PeerTimeout(PeerError, TimeoutError):
    """A peer did not answer within the request timeout."""


class PeerLink:
    """A DEALER connection to ``addr``; :meth:`run` is its reader task (start it in the owner's TaskGroup).

    With ``source`` (an IP address of this host) the connection leaves from that address, the one a ``members``
    mode peer admits this node by; with ``secret`` it is a CURVE client.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, addr: str, *, secret: str | None, timeout: float, source: str | None = None
    ) -> None:
        self.addr = addr
        self.timeout = timeout
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
        self.sock.setsockopt(zmq.SNDHWM, 256)
        self.sock.setsockopt(zmq.RCVHWM, 4096)
        secure_client(self.sock, secret)
        endpoint = addr if source is None else _from(source, addr)
        self.handshakes = HandshakeWatch(self.sock, endpoint, f"peer {addr}")
        self.sock.connect(endpoint)
        self._queues: dict[Key, asyncio.Queue[Message]] = {}
        self.dropped = 0

    async def run(self) -> None:
        """Read replies forever and hand each to its subscriber; unmatched ones are counted and dropped.

        Also follows the connection's handshakes (see :class:`~snapshotd.security.HandshakeWatch`).
        """
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.handshakes.run())
            tg.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self.dropped += 1
                log.warning("bad message from %s: %s", self.addr, exc)
                continue
            key = (msg.job, getattr(msg, "rank", -1), getattr(msg, "step", -1))
            queue = self._queues.get(key)
            if queue is None:
                self.dropped += 1
                continue
            queue.put_nowait(msg)

    @contextlib.contextmanager
    def subscribe(self, job: str, rank: int, step: int) -> Iterator[asyncio.Queue[Message]]:
        """Receive the replies about ``(job, rank, step)`` from this peer while the block runs."""
        key = (job, rank, step)
        if key in self._queues:
            raise RuntimeError(f"a transfer of {key} with {self.addr} is already running")
        queue: asyncio.Queue[Message] = asyncio.Queue()
        self._queues[key] = queue
        try:
            yield queue
        finally:
            del self._queues[key]

    async def send(self, msg: Message) -> None:
        """Send one message (payload frames zero-copy) within the timeout.

        Raises:
            PeerTimeout: the peer is not connected or not draining.
        """
        try:
            async with asyncio.timeout(self.timeout):
                await self.sock.send_multipart(encode(msg), copy=False)
        except TimeoutError as exc:
            raise PeerTimeout(f"peer {self.addr} did not take a message within {self.timeout:.1f} s"
                              + self._why()) from exc  # fmt: skip

    def send_nowait(self, msg: Message) -> bool:
        """Send only if the socket takes it at once (a best-effort notice); False if it did not."""
        try:
            fut: Any = self.sock.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        if not fut.done():  # cannot happen with NOBLOCK; never wait for it
            fut.cancel()
            return False
        return fut.exception() is None

    async def receive(self, queue: asyncio.Queue[Message], *expected: type[Message]) -> Message:
        """The next reply on ``queue``, which must be one of ``expected``.

        Raises:
            PeerTimeout: nothing within the timeout.
            PeerError: the peer answered with an Error or something unexpected.
        """
        try:
            async with asyncio.timeout(self.timeout):
                msg = await queue.get()
        except TimeoutError as exc:
            raise PeerTimeout(f"no answer from {self.addr} within {self.timeout:.1f} s" + self._why()) from exc
        if isinstance(msg, expected):
            return msg
        if msg.TYPE == "error":
            raise PeerError(f"{self.addr}: {getattr(msg, 'code', '')}: {getattr(msg, 'message', '')}")
        raise PeerError(f"{self.addr} answered {msg.TYPE}, expected {[t.TYPE for t in expected]}")

    def _why(self) -> str:
        failure = self.handshakes.failure
        return f" ({failure})" if failure else ""

    def close(self) -> None:
        self.handshakes.close()
        self.sock.close(linger=0)


class PeerLinks:
    """This sidecar's connections to the other sidecars' data planes: one :class:`PeerLink` per address, made on
    first use, its reader running in the sidecar's task tree.

    Args:
        ctx: the sidecar's ZeroMQ context.
        secret: the job's secret (CURVE), or None (plaintext: no secret, or ``members`` mode).
        timeout: seconds any one reply may take.
        source: the IP address outgoing connections leave from (``members`` mode), or None.
        tasks: the sidecar's task tree.
    """

    def __init__(self, ctx: zmq.asyncio.Context, *, secret: str | None, timeout: float, source: str | None,
                 tasks: TaskTree) -> None:  # fmt: skip
        self.ctx = ctx
        self.secret = secret
        self.timeout = timeout
        self.source = source
        self.tasks = tasks
        self._links: dict[str, PeerLink] = {}

    def get(self, addr: str) -> PeerLink:
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = PeerLink(self.ctx, addr, secret=self.secret, timeout=self.timeout,
                                                source=self.source)  # fmt: skip
            self.tasks.spawn(link.run(), f"peer link {addr}")
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


def _from(source: str, addr: str) -> str:
    """ZeroMQ's ``tcp://SOURCE:0;HOST:PORT``: connect to ``addr`` from the address ``source``."""
    host = f"[{source}]" if ":" in source else source
    return f"tcp://{host}:0;{addr.removeprefix('tcp://')}"
