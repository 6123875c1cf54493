"""Replies on a server pipe: queued by the handlers, sent in order by one writer task."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from snapshotd import proto
from snapshotd.proto import Error, Message
from snapshotd.proto.limits import MAX_TEXT_LEN
from snapshotd.transport import Pipe, TransportError

from .node import Counters

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """Messages for the peers of one server pipe.

    :meth:`reply` never waits: a handler answers and goes on (a full queue drops the reply, logged and counted).
    :meth:`put` waits for room, for bulk senders that must not drop (a served pull). :meth:`run` is the one place
    that sends on the pipe; a peer that left is logged, not fatal.

    Args:
        counters: the sidecar's (dropped replies count as errors).
        timeout: seconds one send may take before it is given up.
        maxsize: replies queued at most.
    """

    def __init__(self, counters: Counters, timeout: float, maxsize: int = 4096) -> None:
        self._counters = counters
        self._timeout = timeout
        self._queue: asyncio.Queue[tuple[bytes, Message]] = asyncio.Queue(maxsize=maxsize)

    def reply(self, ident: bytes, msg: Message) -> None:
        """Queue ``msg`` for ``ident``; an Error's message is cut to what the protocol carries."""
        if isinstance(msg, Error) and len(msg.message) > MAX_TEXT_LEN:
            msg = dataclasses.replace(msg, message=msg.message[: MAX_TEXT_LEN - 3] + "...")
        try:
            self._queue.put_nowait((ident, msg))
        except asyncio.QueueFull:
            self._counters.errors += 1
            log.warning("reply queue full; dropped %s", msg.TYPE)

    async def put(self, ident: bytes, msg: Message) -> None:
        await self._queue.put((ident, msg))

    async def run(self, pipe: Pipe) -> None:
        while True:
            ident, msg = await self._queue.get()
            try:
                frames = proto.encode(msg)
            except Exception:  # a reply the protocol cannot carry is this sidecar's bug: never the writer's end
                self._counters.errors += 1
                log.exception("could not encode a %s reply; dropped it", msg.TYPE)
                continue
            try:
                async with asyncio.timeout(self._timeout):
                    await pipe.send([ident, *frames])
            except (TransportError, TimeoutError) as exc:
                log.debug("could not send %s to a peer that left: %s", msg.TYPE, exc)
