"""The sender's side of a push: a stream's chunks over the buddy's bulk port (:mod:`snapshotd.proto.bulk`).

A push moves a slot's bytes with one kernel copy at each end: each of a few connections ("lanes") is served by a
thread of its own that sends its share of the chunks (chunk ``i`` on lane ``i % lanes``) straight from shared
memory, with ``sendmsg`` of the chunk header and a view of the slot; the buddy receives them straight into the
copy's buffers. Several lanes spread the kernel's copies over several cores at each end. The event loop only
paces the chunks and hands them to the lanes; the checksums come from the slot's seal (taken by the lane's thread
for a block the seal does not hold yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable

from snapshotd.proto.bulk import CHUNK, HELLO, PUSH_MAGIC, VERSION, Status

from .integrity import Seal

__all__ = ["Lanes", "PushFailed"]

log = logging.getLogger(__name__)


class PushFailed(RuntimeError):
    """A lane could not deliver its chunks (the buddy closed the connection, refused it, or went silent)."""


class _Lane:
    """One connection to the buddy's bulk port and the thread that sends its chunks."""

    def __init__(
        self,
        addr: tuple[str, int],
        token: bytes,
        seal: Seal,
        data: memoryview,
        timeout: float,
        done: Callable[[BaseException | None], None],
    ) -> None:
        self.addr = addr
        self.token = token
        self.seal = seal
        self.data = data
        self.timeout = timeout
        self.done = done
        self.todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="snapshotd-push", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Make the thread stop at once: a send in progress fails, no further chunk is sent."""
        with self.lock:
            self.stopped = True
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
        self.todo.put(None)

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            sock = socket.create_connection(self.addr, timeout=self.timeout)
            with self.lock:
                self.sock = sock
                stopped = self.stopped
            with sock:
                if stopped:
                    return
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(HELLO.pack(PUSH_MAGIC, VERSION, self.token))
                block = self.seal.block_bytes
                while (index := self.todo.get()) is not None and not self.stopped:
                    view = self.data[index * block : (index + 1) * block]
                    header = CHUNK.pack(index, view.nbytes, self.seal.block_sum(index, view), Status.OK)
                    _send(sock, header, view)
        except BaseException as exc:  # reported to the stream, which says what failed
            error = exc
        finally:
            self.done(None if error is None or self.stopped else error)


def _send(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    """``header`` then ``payload``, in one system call where the kernel takes it all."""
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < payload.nbytes:
        sock.sendall(payload[sent - len(header) :])


class Lanes:
    """The lanes of one push (see the module docstring): made on the event loop, fed with :meth:`send`, then
    :meth:`finish` waits until every lane sent its share and closed its connection. :meth:`stop` ends them at
    once (the stream failed or was cancelled); the data is not read after :meth:`finish` or :meth:`stop` returns.

    Args:
        host, port, token: the buddy's bulk port and the push's token (its StreamAccept).
        count: how many connections.
        seal: the slot's seal (block size and checksums).
        data: the slot's bytes.
        timeout: seconds a connection may take to open, or stay blocked on one send.
    """

    def __init__(
        self, host: str, port: int, token: bytes, *, count: int, seal: Seal, data: memoryview, timeout: float
    ) -> None:
        loop = asyncio.get_running_loop()
        self._futures: list[asyncio.Future[None]] = []
        self._lanes: list[_Lane] = []
        for _ in range(count):
            fut: asyncio.Future[None] = loop.create_future()
            self._futures.append(fut)
            self._lanes.append(_Lane((host, port), token, seal, data, timeout, _resolver(loop, fut)))

    @property
    def failed(self) -> bool:
        """Whether a lane failed already (the rest need not be fed)."""
        return any(f.done() and f.exception() is not None for f in self._futures)

    def send(self, index: int) -> None:
        """Queue chunk ``index`` on its lane."""
        self._lanes[index % len(self._lanes)].todo.put(index)

    async def finish(self) -> None:
        """Wait until every lane has sent its chunks.

        Raises:
            PushFailed: a lane failed (the first failure, named).
        """
        for lane in self._lanes:
            lane.todo.put(None)
        results = await asyncio.gather(*self._futures, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise PushFailed(f"{type(errors[0]).__name__}: {errors[0]}") from errors[0]

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop every lane and wait (up to ``timeout``) until none reads the data any more."""
        for lane in self._lanes:
            lane.stop()
        await asyncio.wait(self._futures, timeout=timeout)
        for lane, fut in zip(self._lanes, self._futures, strict=True):
            # resolved from the thread's last step: it reads no more data (it may not have exited quite yet)
            if not fut.done():
                log.warning("a push lane to %s:%d did not stop within %.0f s", *lane.addr, timeout)


def _resolver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]
) -> Callable[[BaseException | None], None]:
    """``done(error)`` from a lane's thread resolves ``fut`` on the loop (a loop already closed is left alone)."""

    def resolve(error: BaseException | None) -> None:
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    def done(error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(resolve, error)

    return done
