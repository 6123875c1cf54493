"""The sender's side of a push: a stream's chunks over the buddy's bulk port (:mod:`snapshotd.proto.bulk`).

A push moves a slot's bytes with one kernel copy at each end: each of a few connections ("lanes") is served by a
thread of its own that sends its share of the chunks (chunk ``i`` on lane ``i % lanes``) straight from shared
memory, with ``sendmsg`` of views of the slot; the buddy receives them straight into the copy's buffers. Several
lanes spread the kernel's copies over several cores at each end. The event loop only paces the chunks and hands
them to the lanes. A chunk's checksum is the slot's seal's, or, for a block the seal does not hold yet, taken by
the lane piece by piece as the bytes go out (:func:`~snapshotd.proto.bulk.send_checked`) and kept in the seal:
one pass over the bytes, from the CPU's caches, for the checksum and the kernel's copy.

A lane outlives its push: it ends each push with an ``END`` header and waits, connection open and thread parked,
in its :class:`LanePool` for the next push to the same port, which presents its own token on it. So a snapshot
after the first costs no connection set-up and no thread start at either end. A lane that failed or was stopped
is closed, never reused; an idle one closes itself after :data:`LANE_IDLE` seconds (the buddy closes its end
after twice that, :data:`~snapshotd.sidecar.bulk.PUSH_IDLE`), and one whose buddy closed its end is found so
before reuse and replaced. An idle lane holds no reference to the memory of the push it carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable

from snapshotd.proto.bulk import (
    HELLO,
    PUSH_CHUNK,
    PUSH_MAGIC,
    PUSH_SUM,
    VERSION,
    Status,
    block_sends,
    send_all,
    send_checked,
)

from .integrity import Seal

__all__ = ["LANE_IDLE", "LanePool", "Lanes", "PushFailed"]

log = logging.getLogger(__name__)

LANE_IDLE = 60.0
"""Seconds a lane waits in its pool for the next push before it is closed."""
KEEP_IDLE = 16
"""Idle lanes a pool keeps per bulk port; more are closed."""


class PushFailed(RuntimeError):
    """A lane could not deliver its chunks (the buddy closed the connection, refused it, or went silent)."""


class _Stopped(Exception):
    """The lane was stopped in the middle of a push."""


@dataclasses.dataclass(slots=True)
class _Begin:
    token: bytes
    seal: Seal
    data: memoryview
    done: Callable[[BaseException | None], None]


_END = -1
"""In a lane's queue: the push's chunks are all queued."""


class _Lane:
    """One connection to a buddy's bulk port and the thread that sends the chunks of one push after another."""

    def __init__(self, addr: tuple[str, int], timeout: float, idle_seconds: float) -> None:
        self.addr = addr
        self.timeout = timeout
        self.idle_seconds = idle_seconds
        self.todo: queue.SimpleQueue[_Begin | int | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.stopped = False
        self.idle_since = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="snapshotd-push", daemon=True)
        self.thread.start()

    def begin(self, push: _Begin) -> bool:
        """Queue ``push`` for the thread; False (nothing queued) when the lane is closed or closing, or its
        connection was closed or written to by the buddy (which only closes a push connection)."""
        with self.lock:  # against the thread closing the lane after its idle time
            if self.stopped or (self.sock is not None and _readable(self.sock)):
                return False
            self.todo.put(push)
            return True

    def stop(self) -> None:
        """Make the thread stop at once: a send in progress fails, no further chunk is sent, the lane closes."""
        with self.lock:
            self.stopped = True
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
        self.todo.put(None)

    def _next(self) -> _Begin | None:
        """The next push, or None once the lane is stopped or has waited :attr:`idle_seconds` for one."""
        while True:
            try:
                item = self.todo.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self.lock:
                    if self.todo.empty():  # no begin() came meanwhile: none comes after this
                        self.stopped = True
                        return None
                continue
            assert item is None or isinstance(item, _Begin)
            return item

    def _run(self) -> None:
        try:
            while (push := self._next()) is not None:
                error: BaseException | None = None
                try:
                    self._push(push)
                except BaseException as exc:  # reported to the stream, which says what failed
                    error = exc
                done, push = push.done, None  # waiting for the next, it holds no view of this one's memory
                done(None if error is None or self.stopped else error)
                if error is not None:
                    return
        finally:
            with self.lock:
                self.stopped = True
                sock, self.sock = self.sock, None
            if sock is not None:
                sock.close()

    def _push(self, push: _Begin) -> None:
        sock = self.sock if self.sock is not None else self._connect()
        try:
            sock.sendall(HELLO.pack(PUSH_MAGIC, VERSION, push.token))
            block = push.seal.block_bytes
            while (index := self.todo.get()) != _END:
                if not isinstance(index, int) or self.stopped:
                    raise _Stopped
                view = push.data[index * block : (index + 1) * block]
                header = PUSH_CHUNK.pack(index, view.nbytes, Status.OK)
                kept = push.seal.sums.get(index)
                if kept is None:
                    push.seal.keep(index, send_checked(sock, header, view))
                else:
                    send_all(sock, [header, view, PUSH_SUM.pack(kept)])
            sock.sendall(PUSH_CHUNK.pack(0, 0, Status.END))
        except BlockingIOError:  # the socket's send timeout
            host, port = self.addr
            raise TimeoutError(f"the bulk port {host}:{port} took no byte for {self.timeout:g} s") from None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=self.timeout)
        with self.lock:
            self.sock = sock
            stopped = self.stopped
        if stopped:
            raise _Stopped
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        block_sends(sock, self.timeout)
        return sock


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has anything to read (or its end closed) right now."""
    poll = select.poll()
    poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poll.poll(0))


class LanePool:
    """The lanes kept open between pushes (see the module docstring), per bulk port. Used on the event loop;
    :meth:`close` it when the sidecar stops.

    Args:
        idle_seconds: how long an idle lane is kept.
        keep: idle lanes kept per bulk port.
    """

    def __init__(self, *, idle_seconds: float = LANE_IDLE, keep: int = KEEP_IDLE) -> None:
        self.idle_seconds = idle_seconds
        self.keep = keep
        self._idle: dict[tuple[str, int], list[_Lane]] = {}
        self._closed = False

    def take(
        self, host: str, port: int, token: bytes, *, count: int, seal: Seal, data: memoryview, timeout: float
    ) -> Lanes:
        """The lanes of one push of ``data`` to ``host:port`` under the push's ``token``: idle ones first, new
        ones for the rest (each connects as its push starts). ``timeout``: seconds a new connection may take to
        open, or the buddy take no byte from a lane that is sending (one that keeps taking bytes is waited
        for)."""
        loop = asyncio.get_running_loop()
        self._close_idle(time.monotonic() - self.idle_seconds)
        idle = self._idle.get((host, port), [])
        lanes: list[_Lane] = []
        futures: list[asyncio.Future[None]] = []
        while len(lanes) < count:
            lane = idle.pop() if idle else _Lane((host, port), timeout, self.idle_seconds)
            fut: asyncio.Future[None] = loop.create_future()
            if lane.begin(_Begin(token, seal, data, _resolver(loop, fut))):
                lanes.append(lane)
                futures.append(fut)
            else:
                lane.stop()
        return Lanes(self, lanes, futures)

    @property
    def idle(self) -> int:
        """Lanes waiting for a push now."""
        return sum(len(lanes) for lanes in self._idle.values())

    def close(self) -> None:
        """Close every idle lane; the lanes of pushes in flight close as their pushes end."""
        self._closed = True
        self._close_idle(float("inf"))

    def _put(self, lanes: list[_Lane]) -> None:
        now = time.monotonic()
        for lane in lanes:
            if self._closed:
                lane.stop()
                continue
            lane.idle_since = now
            idle = self._idle.setdefault(lane.addr, [])
            idle.append(lane)
            if len(idle) > self.keep:
                idle.pop(0).stop()

    def _close_idle(self, before: float) -> None:
        for addr, idle in list(self._idle.items()):
            for lane in [lane for lane in idle if lane.idle_since < before]:
                idle.remove(lane)
                lane.stop()
            if not idle:
                del self._idle[addr]


class Lanes:
    """The lanes of one push (see the module docstring), from :meth:`LanePool.take`: fed with :meth:`send`, then
    :meth:`finish` waits until every lane sent its share and hands them back to the pool. :meth:`stop` closes
    those it still holds at once (the stream failed or was cancelled); the data is not read after
    :meth:`finish` or :meth:`stop` returns."""

    def __init__(self, pool: LanePool, lanes: list[_Lane], futures: list[asyncio.Future[None]]) -> None:
        self._pool = pool
        self._lanes = lanes
        self._futures = futures
        """Each lane's push, resolved when its thread is done with it (the data no longer read)."""

    @property
    def failed(self) -> bool:
        """Whether a lane failed already (the rest need not be fed)."""
        return any(f.done() and f.exception() is not None for f in self._futures)

    def send(self, index: int) -> None:
        """Queue chunk ``index`` on its lane."""
        self._lanes[index % len(self._lanes)].todo.put(index)

    async def finish(self) -> None:
        """Wait until every lane has sent its chunks, then hand the lanes back to the pool.

        Raises:
            PushFailed: a lane failed (the first failure, named).
        """
        for lane in self._lanes:
            lane.todo.put(_END)
        await asyncio.wait(self._futures)  # not gather: cancelling this leaves them for stop() to wait on
        errors = [e for f in self._futures if (e := f.exception()) is not None]
        if errors:
            raise PushFailed(f"{type(errors[0]).__name__}: {errors[0]}") from errors[0]
        lanes, self._lanes = self._lanes, []
        self._pool._put(lanes)

    async def stop(self, timeout: float = 5.0) -> None:
        """Close every lane still held and wait (up to ``timeout``) until none reads the data any more."""
        for lane in self._lanes:
            lane.stop()
        await asyncio.wait(self._futures, timeout=timeout)
        for lane, fut in zip(self._lanes, self._futures, strict=False):
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
