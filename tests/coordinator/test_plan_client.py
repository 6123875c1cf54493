"""The sidecar's CoordinatorClient against a real coordinator: held plan requests, one socket, replies routed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import zmq.asyncio

from snapshotd.coordinator import CoordinatorConfig
from snapshotd.proto import (
    Heartbeat,
    InventoryItem,
    PlanReply,
    PlanRequest,
    ProtocolError,
    RankInfo,
    RegisterSidecar,
)
from snapshotd.sidecar.control import CoordinatorClient, CoordinatorUnavailable

from .test_server import TIMEOUT, Coordinator

WORLD = 4


@pytest.fixture
def coordinator(request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    kw = getattr(request, "param", {})
    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.1, heartbeat_timeout=0.5, **kw))
    yield coord
    coord.close()


async def _keep_beating(client: CoordinatorClient, stop: asyncio.Event) -> None:
    """Node ``a`` hosts every rank of job ``j`` and holds step 5 of each, in shared memory."""
    await client.register(RegisterSidecar(node="a", data_addr="tcp://a:1", incarnation="i1"), TIMEOUT)
    hb = Heartbeat(
        node="a", incarnation="i1",
        ranks=tuple(RankInfo(job="j", rank=r, world_size=WORLD, pid=10 + r, alive=True) for r in range(WORLD)),
        inventory=tuple(InventoryItem(job="j", rank=r, step=5, local=True) for r in range(WORLD)),
    )  # fmt: skip
    while not stop.is_set():
        assert (await client.heartbeat(hb, TIMEOUT)).known
        await asyncio.sleep(0.05)


async def _with_node(endpoint: str, body: Callable[[CoordinatorClient], Awaitable[None]]) -> None:
    ctx = zmq.asyncio.Context()
    client = CoordinatorClient(ctx, endpoint, secret=None)
    stop = asyncio.Event()
    try:
        async with asyncio.timeout(3 * TIMEOUT), asyncio.TaskGroup() as tg:
            tg.create_task(_keep_beating(client, stop))
            await asyncio.sleep(0.7)  # past the rebuild window
            try:
                await body(client)
            finally:
                stop.set()
    finally:
        client.close()
        ctx.destroy(linger=0)


def _ask(rank: int, world: int = WORLD) -> PlanRequest:
    return PlanRequest(job="j", rank=rank, world_size=world, node="a")


def test_concurrent_ranks_share_one_socket_and_get_the_plan_when_the_last_asks(coordinator: Coordinator) -> None:
    times: dict[int, float] = {}

    async def restore(client: CoordinatorClient, rank: int, delay: float) -> PlanReply:
        await asyncio.sleep(delay)
        reply = await client.plan(_ask(rank), time.monotonic() + TIMEOUT)
        times[rank] = time.monotonic()
        return reply

    async def body(client: CoordinatorClient) -> None:
        t0 = time.monotonic()
        bad = asyncio.ensure_future(client.plan(_ask(WORLD + 1), time.monotonic() + TIMEOUT))
        calls = asyncio.gather(*(restore(client, r, 0.4 if r == 2 else 0.0) for r in range(WORLD)))
        await asyncio.sleep(0.2)
        assert client._plan is not None and len(client._waiters) == WORLD - 1  # ranks 0, 1, 3 held on one socket
        replies = await calls
        with pytest.raises(ProtocolError, match="outside its world size"):
            await bad  # refused, and only that call: the error names its rank
        assert [(p.rank, p.status, p.step, p.local) for p in replies] == [(r, "ready", 5, True) for r in range(WORLD)]
        assert max(times.values()) - t0 < 1.2  # decided when rank 2 asked (0.4 s), not after a hold of 1.5 s
        assert client._plan is None and not client._waiters  # closed with the last call, nobody left waiting

    asyncio.run(_with_node(coordinator.endpoint, body))


@pytest.mark.parametrize("coordinator", [{"plan_hold": 0.0}], indirect=True)
def test_against_a_coordinator_that_holds_nothing_plan_polls_until_its_deadline(coordinator: Coordinator) -> None:
    async def body(client: CoordinatorClient) -> None:
        t0 = time.monotonic()
        with pytest.raises(CoordinatorUnavailable, match=r"rank 0: 1 of 4 ranks accounted for; waiting for rank"):
            await client.plan(_ask(0), t0 + 0.6)
        assert 0.55 <= time.monotonic() - t0 < 1.5

    asyncio.run(_with_node(coordinator.endpoint, body))
