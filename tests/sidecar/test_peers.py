"""Peer links: one connection per peer address, replaced when a request on it went unanswered."""

from __future__ import annotations

import asyncio
import uuid

from snapshotd.proto import StreamAccept
from snapshotd.sidecar.node import Counters
from snapshotd.sidecar.peers import PeerLinks, PeerTimeout
from snapshotd.sidecar.tasks import TaskTree
from snapshotd.transport import MEMORY, Role


def test_a_link_whose_request_went_unanswered_is_replaced_once_no_transfer_holds_it() -> None:
    """A connection left wedged (its peer stopped and resumed with the connection's state stuck) failed every
    transfer to that peer afterwards; now it costs the one request that timed out."""

    async def story() -> None:
        addr = f"mem://peer-{uuid.uuid4().hex[:6]}"
        server = MEMORY.serve(addr, Role.DATA)  # a peer that never answers
        tasks = TaskTree(Counters())
        try:
            async with asyncio.TaskGroup() as group:
                tasks.attach(group)
                links = PeerLinks(MEMORY, timeout=0.2, source=None, tasks=tasks)
                first = links.get(addr)
                assert links.get(addr) is first  # one link per address
                with first.subscribe("j", 0, 1) as replies:
                    try:
                        await first.receive(replies, StreamAccept)
                        raise AssertionError("the peer never answers")
                    except PeerTimeout:
                        pass
                    assert links.get(addr) is first  # a transfer still holds it: kept
                fresh = links.get(addr)
                assert fresh is not first and not fresh.stale  # connected afresh
                assert links.get(addr) is fresh
                links.close()
        finally:
            server.close()

    asyncio.run(story())
