"""The in-memory transport: ``mem://NAME`` addresses, one network per process.

It stands in for ZeroMQ where a test runs a coordinator, sidecars and training ranks in one process (each daemon
on an event loop of its own thread, or several on one): the same messages, encoded and decoded by the same
protocol code, go through thread-safe mailboxes instead of sockets. Every frame is copied when sent, as a
network would (a receiver never sees the sender's buffer change). Semantics follow the ZeroMQ sockets the real
transport uses: a client pipe's messages wait for a server bound later at its address (up to its mailbox's
room); a reply to a client that closed, or that never existed, is refused (:class:`TransportError`); a mailbox
holds at most :data:`ROOM` messages, and a sender finding it full waits (``send``) or is told (``send_nowait``).
No security: every pipe is the process's own. A test may set :attr:`MemoryNetwork.tamper` to change or drop
messages in flight (a :data:`Tamper`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Callable

from .base import Frames, Network, Pipe, Role, ThreadPipe, TransportError

__all__ = ["ROOM", "MemoryNetwork", "MemoryPipe", "Tamper"]

Tamper = Callable[[str, bool, Frames], "Frames | None"]
"""``tamper(address, to_server, frames)``: what a message in flight to or from the server at ``address`` becomes
(its frames, without the routing identity): the same frames, others, or None to drop it."""

ROOM = 4096
"""Messages a mailbox holds (a ZeroMQ high-water mark's part)."""

_SCHEME = "mem://"


class _Mailbox:
    """A bounded FIFO of messages, waited on from event loops (any thread) and from plain threads."""

    def __init__(self) -> None:
        self._items: collections.deque[Frames] = collections.deque()
        self._cond = threading.Condition()
        self._loop_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.closed = False
        self._woken = False  # wake() was called since the last wait() returned

    def put(self, frames: Frames) -> bool:
        with self._cond:
            if self.closed or len(self._items) >= ROOM:
                return False
            self._items.append(frames)
            self._cond.notify_all()
            waiters, self._loop_waiters = self._loop_waiters, []
        for loop, fut in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, fut)
        return True

    def get(self) -> Frames | None:
        with self._cond:
            items = self._items
            if not items:
                return None
            frames = items.popleft()
            self._cond.notify_all()  # a sender waiting for room
            return frames

    def wait(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items) or self.closed or self._woken, timeout)
            self._woken = False
            return bool(self._items)

    def wake(self) -> None:
        """Make a plain thread's :meth:`wait` in progress, or else its next one, return at once."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    async def wait_async(self, timeout: float | None = None) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._items:
                return True
            self._loop_waiters.append((loop, fut))
        try:
            if timeout is None:
                await fut
            else:
                await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        with self._cond:
            return bool(self._items)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._items.clear()
            self._cond.notify_all()


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _copy(frames: Frames) -> Frames:
    return [bytes(f) if not isinstance(f, bytes) else f for f in frames]


class MemoryNetwork(Network):
    """The process's ``mem://`` addresses: bound servers, and connected clients by identity."""

    def __init__(self) -> None:
        self.tamper: Tamper | None = None
        """Set by tests only: every message delivered goes through it (see :data:`Tamper`)."""
        self._lock = threading.Lock()
        self._servers: dict[str, MemoryPipe] = {}
        self._clients: dict[bytes, MemoryPipe] = {}
        self._ids = itertools.count(1)

    def serve(self, address: str, role: Role) -> MemoryPipe:
        if not address.startswith(_SCHEME):
            raise OSError(f"cannot bind {address}: the in-memory network serves mem:// addresses only")
        with self._lock:
            if address.endswith(":0"):  # any free name, as a port 0
                address = f"{address[:-2]}:{next(self._ids)}"
            if address in self._servers:
                raise OSError(f"cannot bind {address}: address already in use")
            pipe = self._servers[address] = MemoryPipe(self, address, identity=None)
            waiting = [c for c in self._clients.values() if c.address == address]
        for client in waiting:  # messages sent before the server was bound go to it now
            client._flush_held()
        return pipe

    def connect(self, address: str, role: Role, *, source: str | None = None) -> MemoryPipe:
        with self._lock:
            identity = b"\0mem" + next(self._ids).to_bytes(8, "big")
            pipe = self._clients[identity] = MemoryPipe(self, address, identity=identity)
        return pipe

    def _server(self, address: str) -> MemoryPipe | None:
        with self._lock:
            return self._servers.get(address)

    def _client(self, identity: bytes) -> MemoryPipe | None:
        with self._lock:
            return self._clients.get(identity)

    def _forget(self, pipe: MemoryPipe) -> None:
        with self._lock:
            if pipe.identity is None:
                if self._servers.get(pipe.address) is pipe:
                    del self._servers[pipe.address]
            else:
                self._clients.pop(pipe.identity, None)

    def close(self) -> None:
        """Nothing to release: pipes are closed by their owners (the network is shared by the process)."""


class MemoryPipe(Pipe, ThreadPipe):
    """A server pipe (``identity`` None) or a client pipe of a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, address: str, *, identity: bytes | None) -> None:
        self.network = network
        self.address = address
        self.identity = identity
        self._inbox = _Mailbox()
        # a client's messages waiting for its server
        self._held: collections.deque[Frames] = collections.deque()

    # -- delivery

    def _route(self, frames: Frames) -> tuple[_Mailbox | None, Frames]:
        """Where ``frames`` go, and as what."""
        tamper = self.network.tamper
        if self.identity is None:  # a server: [identity, *frames] to that client
            client = self.network._client(bytes(frames[0])) if frames else None
            if client is None:
                raise TransportError(
                    f"{self.address}: no peer {bytes(frames[0])!r}" if frames else "empty message"
                )
            reply = _copy(frames[1:]) if tamper is None else tamper(self.address, False, _copy(frames[1:]))
            return (client._inbox, reply) if reply is not None else (None, [])
        server = self.network._server(self.address)
        request = _copy(frames) if tamper is None else tamper(self.address, True, _copy(frames))
        if request is None:
            return None, []
        return (server._inbox if server is not None else None), [self.identity, *request]

    def send_nowait(self, frames: Frames) -> bool:
        if self._inbox.closed:
            raise TransportError(f"{self.address}: the pipe is closed")
        box, message = self._route(frames)
        if not message:  # dropped in flight (a test's tamper)
            return True
        if box is None:  # the server is not bound yet: hold the message for it
            if len(self._held) >= ROOM:
                return False
            self._held.append(message)
            return True
        self._flush_held()
        return not self._held and box.put(message)

    async def send(self, frames: Frames) -> None:
        delay = 0.0005
        while not self.send_nowait(frames):  # full: wait for room (the caller bounds the wait)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    # -- reception

    def recv_nowait(self, *, copy: bool = True) -> Frames | None:
        return self._inbox.get()

    async def recv(self, *, copy: bool = False) -> Frames:
        while True:
            frames = self._inbox.get()
            if frames is not None:
                return frames
            if self._inbox.closed:
                raise TransportError(f"{self.address}: the pipe is closed")
            await self._inbox.wait_async()

    async def poll(self, timeout: float) -> bool:
        return await self._inbox.wait_async(timeout)

    def wait(self, timeout: float) -> bool:
        return self._inbox.wait(timeout)

    def wake(self) -> None:
        self._inbox.wake()

    def _flush_held(self) -> None:
        """Deliver a client's messages held for its server, as far as the server's mailbox has room."""
        server = self.network._server(self.address)
        while server is not None and self._held and server._inbox.put(self._held[0]):
            self._held.popleft()

    def close(self) -> None:
        self._inbox.close()
        self._held.clear()
        self.network._forget(self)
