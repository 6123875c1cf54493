"""Replies on a server pipe: queued by the handlers, sent in order to each peer by a writer of that peer's own."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

from snapshotd import proto
from snapshotd.proto import Error, Message
from snapshotd.proto.limits import MAX_TEXT_LEN, clip_text
from snapshotd.transport import Pipe, TransportError

from .node import Counters

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """Messages for the peers of one server pipe.

    :meth:`reply` never waits: a handler answers and goes on (a full queue drops the reply, logged and counted).
    :meth:`put` waits for room in its peer's queue, for bulk senders that must not drop (a served pull). Each
    peer's messages go out in order from a writer task of its own, started by :meth:`run` while the peer has
    some queued, so a peer that stops reading (stopped, or its connection stuck) holds up no other peer. A send
    that a peer does not take within ``timeout`` gives the peer up: what is queued for it is dropped (stale by
    then; counted as errors), and so are its replies until it is :meth:`heard` from again (a peer that resumes
    asks anew). A peer that left is logged, not fatal.

    Args:
        counters: the sidecar's (dropped replies count as errors).
        timeout: seconds one send may take before its peer is given up.
        maxsize: messages queued at most, all peers together.
        per_peer: messages :meth:`put` queues at most for one peer.
    """

    def __init__(self, counters: Counters, timeout: float, maxsize: int = 4096, per_peer: int = 64) -> None:
        self._counters = counters
        self._timeout = timeout
        self._maxsize = maxsize
        self._per_peer = per_peer
        self._queues: dict[bytes, collections.deque[Message]] = {}
        self._queued = 0
        # peers whose queue was empty: each needs a writer
        self._started: asyncio.Queue[bytes] = asyncio.Queue()
        # peer -> times its queue was dropped (a waiting put then gives up)
        self._dropped: dict[bytes, int] = {}
        self._gone: set[bytes] = set()  # peers given up until heard from again
        self._room = asyncio.Condition()

    def reply(self, ident: bytes, msg: Message) -> None:
        """Queue ``msg`` for ``ident``; an Error's message is cut to what the protocol carries."""
        if isinstance(msg, Error) and len(msg.message) > MAX_TEXT_LEN:
            msg = dataclasses.replace(msg, message=clip_text(msg.message))
        if self._queued >= self._maxsize or ident in self._gone:
            self._counters.errors += 1
            log.warning("reply queue full or its peer not reading; dropped %s", msg.TYPE)
            return
        self._append(ident, msg)

    def heard(self, ident: bytes) -> None:
        """``ident`` sent a message: it reads again, if it had been given up."""
        if self._gone:
            self._gone.discard(ident)

    async def put(self, ident: bytes, msg: Message) -> None:
        """Queue ``msg`` for ``ident``, waiting for room in its queue (no longer than a send may take).

        Raises:
            TransportError: the peer stopped taking messages (what was queued for it was dropped), or no room
                came in time.
        """
        dropped = self._dropped.get(ident, 0)
        try:
            async with asyncio.timeout(self._timeout), self._room:
                await self._room.wait_for(
                    lambda: (
                        self._dropped.get(ident, 0) != dropped
                        or (
                            self._queued < self._maxsize and len(self._queues.get(ident, ())) < self._per_peer
                        )
                    )
                )
        except TimeoutError:
            raise TransportError(f"no room for a peer's messages within {self._timeout:.1f} s") from None
        if self._dropped.get(ident, 0) != dropped or ident in self._gone:
            raise TransportError("the peer stopped taking messages")
        self._append(ident, msg)

    def _append(self, ident: bytes, msg: Message) -> None:
        queue = self._queues.get(ident)
        if queue is None:
            queue = self._queues[ident] = collections.deque()
            self._started.put_nowait(ident)
        queue.append(msg)
        self._queued += 1

    async def run(self, pipe: Pipe) -> None:
        """Start a writer for each peer that has messages queued, until cancelled."""
        async with asyncio.TaskGroup() as writers:
            while True:
                writers.create_task(self._write(pipe, await self._started.get()))

    async def _write(self, pipe: Pipe, ident: bytes) -> None:
        """Send ``ident``'s queue in order until it is empty (then the queue goes; the next message starts a new
        writer), or give the peer up."""
        queue = self._queues[ident]
        try:
            while queue:
                msg = queue.popleft()
                self._queued -= 1
                try:
                    frames = proto.encode(msg)
                # a reply the protocol cannot carry is this sidecar's bug: never the writer's end
                except Exception:
                    self._counters.errors += 1
                    log.exception("could not encode a %s reply; dropped it", msg.TYPE)
                    continue
                try:
                    async with asyncio.timeout(self._timeout):
                        await pipe.send([ident, *frames])
                except (TransportError, TimeoutError) as exc:
                    log.debug(
                        "could not send %s to a peer: %s; dropped its %d queued", msg.TYPE, exc, len(queue)
                    )
                    self._counters.errors += len(queue)
                    self._queued -= len(queue)
                    queue.clear()
                    # peers' counts only need to outlive the puts waiting on them
                    if len(self._dropped) >= 4096:
                        self._dropped.clear()
                    self._dropped[ident] = self._dropped.get(ident, 0) + 1
                    if len(self._gone) >= 4096:  # peers that never came back
                        self._gone.clear()
                    self._gone.add(ident)
                finally:
                    async with self._room:
                        self._room.notify_all()
        finally:
            del self._queues[ident]
