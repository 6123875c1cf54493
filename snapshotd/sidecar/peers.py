"""Connections from this sidecar to other sidecars' data planes.

One :class:`PeerLink` (a client pipe, and the pool of push connections to the peer's bulk port) per remote data
address, shared by every stream to that peer and every pull from it. Replies are routed by ``(job, rank, step)``
to whoever subscribed to that key, so several streams and pulls share one connection without reading each
other's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from snapshotd.proto import Error, ErrorCode, Message, ProtocolError, decode, encode
from snapshotd.transport import Network, Pipe, Role

from .push import LanePool

if TYPE_CHECKING:
    from .tasks import TaskTree

__all__ = ["PeerError", "PeerLink", "PeerLinks", "PeerTimeout"]

log = logging.getLogger(__name__)

Key = tuple[str, int, int]


class PeerError(RuntimeError):
    """A peer refused or failed a transfer (its Error reply, or an unexpected message)."""

    code: ErrorCode | None = None
    """The code of the peer's Error reply, where it sent one."""


class PeerTimeout(PeerError, TimeoutError):
    """A peer did not answer within the request timeout."""


class PeerLink:
    """A connection to the data plane at ``addr``; :meth:`run` is its reader task (start it in the owner's task
    tree). ``timeout`` bounds every send and every wait for a reply."""

    def __init__(self, pipe: Pipe, addr: str, *, timeout: float) -> None:
        self.pipe = pipe
        self.addr = addr
        self.timeout = timeout
        self._queues: dict[Key, list[asyncio.Queue[Message]]] = {}
        self.dropped = 0
        self.stale = False
        """A request on it went unanswered: once no transfer uses it, :class:`PeerLinks` connects afresh."""
        self.reader: asyncio.Task[None] | None = None
        self.lanes = LanePool()
        """Connections to the peer's bulk port kept open between the pushes of streams to it."""

    @property
    def busy(self) -> bool:
        """Whether some transfer is subscribed to its replies."""
        return bool(self._queues)

    async def run(self) -> None:
        """Read replies forever and hand each to its subscriber; unmatched ones are counted and dropped. Also
        follows the connection's handshakes, so that a peer refusing us is named in a timeout's message."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.pipe.watch())
            tg.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.pipe.recv()
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self.dropped += 1
                log.warning("bad message from %s: %s", self.addr, exc)
                continue
            key = (msg.job, getattr(msg, "rank", -1), getattr(msg, "step", -1))
            queues = self._queues.get(key)
            if not queues:
                self.dropped += 1
                continue
            for queue in queues:
                queue.put_nowait(msg)

    @contextlib.contextmanager
    def subscribe(self, job: str, rank: int, step: int) -> Iterator[asyncio.Queue[Message]]:
        """Receive the replies about ``(job, rank, step)`` from this peer while the block runs.

        Two transfers of one key with one peer at once (a restore's pull and a re-replication of the same copy)
        each get every reply about it: each takes the chunks it asked for (see :meth:`receive`).
        """
        key = (job, rank, step)
        queue: asyncio.Queue[Message] = asyncio.Queue()
        self._queues.setdefault(key, []).append(queue)
        try:
            yield queue
        finally:
            queues = self._queues[key]
            queues.remove(queue)
            if not queues:
                del self._queues[key]

    async def send(self, msg: Message) -> None:
        """Send one message (payload frames zero-copy) within the timeout.

        Raises:
            PeerTimeout: the peer is not connected or not draining.
        """
        try:
            async with asyncio.timeout(self.timeout):
                await self.pipe.send(encode(msg))
        except TimeoutError as exc:
            self.stale = True
            raise PeerTimeout(
                f"peer {self.addr} did not take a message within {self.timeout:.1f} s" + self._why()
            ) from exc

    def send_nowait(self, msg: Message) -> bool:
        """Send only if the connection takes it at once (a best-effort notice); False if it did not."""
        return self.pipe.send_nowait(encode(msg))

    async def receive(self, queue: asyncio.Queue[Message], *expected: type[Message]) -> Message:
        """The next reply on ``queue`` that is one of ``expected``, or an Error. Any other reply about the key
        answers an earlier request (sent twice, or another transfer's) and is skipped.

        Raises:
            PeerTimeout: no such reply within the timeout.
            PeerError: the peer answered with an Error.
        """
        try:
            async with asyncio.timeout(self.timeout):
                msg = await queue.get()
                while not isinstance(msg, (*expected, Error)):
                    self.dropped += 1
                    log.debug(
                        "%s: skipped a stale %s (waiting for %s)",
                        self.addr,
                        msg.TYPE,
                        [t.TYPE for t in expected],
                    )
                    msg = await queue.get()
        except TimeoutError as exc:
            self.stale = True
            raise PeerTimeout(
                f"no {'/'.join(t.TYPE for t in expected)} from {self.addr} within "
                f"{self.timeout:.1f} s" + self._why()
            ) from exc
        if isinstance(msg, Error):
            error = PeerError(f"{self.addr}: {msg.code}: {msg.message}")
            error.code = msg.code
            raise error
        return msg

    def _why(self) -> str:
        failure = self.pipe.failure
        return f" ({failure})" if failure else ""

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.pipe.close()
        self.lanes.close()


class PeerLinks:
    """This sidecar's connections to the other sidecars' data planes: one :class:`PeerLink` per address, made on
    first use, its reader running in the sidecar's task tree. A link on which a request went unanswered is
    replaced by a fresh connection at its next use once no transfer holds it, so that a connection left wedged
    (its peer stopped and resumed, a message lost) costs one timeout, not every transfer after it.

    Args:
        network: makes the connections.
        timeout: seconds any one reply may take.
        source: the IP address outgoing connections leave from (``members`` mode), or None.
        tasks: the sidecar's task tree.
    """

    def __init__(self, network: Network, *, timeout: float, source: str | None, tasks: TaskTree) -> None:
        self.network = network
        self.timeout = timeout
        self.source = source
        self.tasks = tasks
        self._links: dict[str, PeerLink] = {}

    def get(self, addr: str) -> PeerLink:
        link = self._links.get(addr)
        if link is not None and link.stale and not link.busy:
            log.info("connecting to %s afresh: a request there went unanswered", addr)
            link.close()
            link = None
        if link is None:
            pipe = self.network.connect(addr, Role.PEER, source=self.source)
            link = self._links[addr] = PeerLink(pipe, addr, timeout=self.timeout)
            link.reader = self.tasks.spawn(link.run(), f"peer link {addr}")
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
