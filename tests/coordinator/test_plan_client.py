"""The sidecar's CoordinatorClient: its ranks asked for together, held by a real coordinator, replies shared out."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import zmq.asyncio

from snapshotd.coordinator import CoordinatorConfig
from snapshotd.proto import (
    Error,
    ErrorCode,
    Heartbeat,
    InventoryItem,
    PlanReply,
    PlanRequest,
    ProtocolError,
    RankInfo,
    RankPlan,
    RegisterSidecar,
    decode,
    encode,
)
from snapshotd.sidecar import plan_asking
from snapshotd.sidecar.control import CoordinatorClient, CoordinatorUnavailable
from snapshotd.sidecar.node import Counters
from snapshotd.sidecar.tasks import TaskTree
from snapshotd.transport import Security
from snapshotd.transport.zeromq import ZmqNetwork

from .test_server import TIMEOUT, Coordinator

WORLD = 4


@pytest.fixture
def coordinator(request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    kw = getattr(request, "param", {})
    coord = Coordinator(
        CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.1, heartbeat_timeout=0.5, **kw)
    )
    yield coord
    coord.close()


async def _keep_beating(client: CoordinatorClient, stop: asyncio.Event) -> None:
    """Node ``a`` hosts every rank of job ``j`` and holds step 5 of each, in shared memory."""
    await client.register(RegisterSidecar(node="a", data_addr="tcp://a:1", incarnation="i1"), TIMEOUT)
    hb = Heartbeat(
        node="a",
        incarnation="i1",
        ranks=tuple(
            RankInfo(job="j", rank=r, world_size=WORLD, pid=10 + r, alive=True) for r in range(WORLD)
        ),
        inventory=tuple(InventoryItem(job="j", rank=r, step=5, local=True) for r in range(WORLD)),
    )
    while not stop.is_set():
        assert (await client.heartbeat(hb, TIMEOUT)).known
        await asyncio.sleep(0.05)


async def _with_node(endpoint: str, body: Callable[[CoordinatorClient], Awaitable[None]]) -> None:
    network = ZmqNetwork(Security())
    tasks = TaskTree(Counters())
    client = CoordinatorClient(network, endpoint, tasks=tasks)
    stop = asyncio.Event()
    try:
        async with asyncio.timeout(3 * TIMEOUT), asyncio.TaskGroup() as tg:
            tasks.attach(tg)
            tg.create_task(_keep_beating(client, stop))
            await asyncio.sleep(0.7)  # past the rebuild window
            try:
                await body(client)
            finally:
                stop.set()
    finally:
        client.close()
        network.close()


def _ask(rank: int, world: int = WORLD) -> PlanRequest:
    return PlanRequest(job="j", rank=rank, world_size=world, node="a")


@dataclasses.dataclass(slots=True)
class _Scripted:
    """A scripted coordinator (a real ROUTER the test drives) and a CoordinatorClient connected to it."""

    router: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    client: CoordinatorClient
    tasks: TaskTree

    async def receive(self) -> tuple[list[bytes], PlanRequest]:
        """The next plan request the ROUTER gets: its envelope, and the request."""
        async with asyncio.timeout(TIMEOUT):
            frames = await self.router.recv_multipart()
        msg = decode(frames[1:])
        assert isinstance(msg, PlanRequest)
        return frames[:1], msg

    def run(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` with the client's plan pump in a task tree, as in the sidecar."""

        async def main() -> None:
            async with asyncio.TaskGroup() as group:
                self.tasks.attach(group)
                await body()
                self.tasks.cancel_all()

        asyncio.run(main())


@pytest.fixture
def scripted() -> Iterator[_Scripted]:
    """A :class:`_Scripted`, with a monitor of the ROUTER's handshakes; everything is closed after the test."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    network = ZmqNetwork(Security())
    tasks = TaskTree(Counters())
    client = CoordinatorClient(network, f"tcp://127.0.0.1:{port}", tasks=tasks)
    try:
        yield _Scripted(router, monitor, client, tasks)
    finally:
        client.close()
        network.close()
        monitor.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)


def test_concurrent_ranks_share_one_request_and_get_the_plan_when_the_last_asks(
    coordinator: Coordinator,
) -> None:
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
        (group,) = client._groups.values()
        assert client._plan is not None and sorted(group.waiters) == [0, 1, 3]  # held on one socket
        with pytest.raises(ProtocolError, match="outside its world size"):
            await bad  # refused, and only that rank: the error names it, the others were asked for again
        replies = await calls
        assert [(p.rank, p.status, p.step, p.local) for p in replies] == [
            (r, "ready", 5, True) for r in range(WORLD)
        ]
        assert max(times.values()) - t0 < 1.2  # decided when rank 2 asked (0.4 s), not after a hold of 3 s
        assert client._pump is None and not client._groups  # stopped with the last call

    asyncio.run(_with_node(coordinator.endpoint, body))


def test_ranks_asking_together_send_one_request_and_share_its_reply(scripted: _Scripted) -> None:
    """A scripted coordinator (a real ROUTER) sees the requests: one for the ranks asking at once, then one
    for every rank still waiting when another joins; one reply answers each rank's own call. The plan socket is
    connected before the first call and replaced after the last: a reply to the replaced request, sent late,
    never reaches the next call."""
    router, monitor, client = scripted.router, scripted.monitor, scripted.client

    async def handshakes(count: int) -> None:
        async with asyncio.timeout(TIMEOUT):
            for _ in range(count):
                await monitor.recv_multipart()
        assert not await monitor.poll(100)

    async def calls_and_replies() -> None:
        await handshakes(2)  # the heartbeat and plan sockets, before any plan is asked for
        deadline = time.monotonic() + TIMEOUT
        calls = [asyncio.ensure_future(client.plan(_ask(r, 8), deadline)) for r in (5, 1, 3)]
        envelope, first = await scripted.receive()
        assert (first.rank, first.ranks, first.world_size, first.node) == (1, (3, 5), 8, "a")
        late = asyncio.ensure_future(client.plan(_ask(0, 8), deadline))
        envelope, second = await scripted.receive()
        assert second.all_ranks == (0, 1, 3, 5)  # replaces the first one, which the coordinator holds
        assert 0 != first.attempt != second.attempt != 0  # another set of calls
        plans = tuple(RankPlan(r, "ready", 7, r == 3, ("tcp://b:1",), "") for r in second.all_ranks)
        reply = PlanReply(
            job="j", rank=0, status="ready", step=7, local=False, sources=("tcp://b:1",), plans=plans[1:]
        )
        await router.send_multipart([*envelope, *encode(reply)])
        async with asyncio.timeout(TIMEOUT):
            got = await asyncio.gather(*calls, late)
        assert [(p.rank, p.step, p.local, p.sources) for p in got] == [
            (5, 7, False, ("tcp://b:1",)),
            (1, 7, False, ("tcp://b:1",)),
            (3, 7, True, ("tcp://b:1",)),
            (0, 7, False, ("tcp://b:1",)),
        ]
        assert not await router.poll(100)  # nothing more was sent
        assert not client._groups
        await handshakes(1)  # the fresh plan socket, connected with no plan asked for

        stale = PlanReply(job="j", rank=1, status="ready", step=3, local=False, sources=("tcp://old:1",))
        # an answer to the replaced request, sent late
        await router.send_multipart([*envelope, *encode(stale)])
        call = asyncio.ensure_future(client.plan(_ask(1, 8), time.monotonic() + TIMEOUT))
        fresh, third = await scripted.receive()
        assert fresh != envelope and third.all_ranks == (1,)  # a new peer to the coordinator
        await asyncio.sleep(0.2)
        assert not call.done()  # the late answer went to the closed socket
        await router.send_multipart([*fresh, *encode(PlanReply(job="j", rank=1, status="ready", step=9))])
        async with asyncio.timeout(TIMEOUT):
            assert (await call).step == 9

    scripted.run(calls_and_replies)


def test_a_request_asked_again_keeps_its_attempt_until_a_call_joins(scripted: _Scripted) -> None:
    """After a ``wait`` the same calls are asked for under the same ``attempt`` (so that a coordinator that
    answered them already answers them again); a call that joins makes a new one."""
    router, client = scripted.router, scripted.client

    async def wait_then_join() -> None:
        deadline = time.monotonic() + TIMEOUT
        call = asyncio.ensure_future(client.plan(_ask(2), deadline))
        envelope, first = await scripted.receive()
        await router.send_multipart(
            [*envelope, *encode(PlanReply(job="j", rank=2, status="wait", reason="1 of 4"))]
        )
        envelope, again = await scripted.receive()
        assert again.all_ranks == (2,) and again.attempt == first.attempt != 0
        late = asyncio.ensure_future(client.plan(_ask(0), deadline))
        envelope, joined = await scripted.receive()
        assert joined.all_ranks == (0, 2) and joined.attempt not in (0, first.attempt)
        plans = (RankPlan(2, "ready", 7, True, (), ""),)
        reply = PlanReply(job="j", rank=0, status="ready", step=7, local=True, plans=plans)
        await router.send_multipart([*envelope, *encode(reply)])
        async with asyncio.timeout(TIMEOUT):
            assert [p.step for p in await asyncio.gather(call, late)] == [7, 7]

    scripted.run(wait_then_join)


def test_a_second_answer_to_a_request_asked_again_never_reaches_a_later_call(
    scripted: _Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request asked again after a timeout can be answered twice. When the first answer ends a call while
    other calls (here another job's) still wait, the plan socket is replaced all the same, and the waiting calls
    ask again on the fresh one under their attempts: the second answer, sent late, cannot settle the call of the
    rank that restarted and asks anew (it would restore the step of a round that is over)."""
    monkeypatch.setattr(plan_asking, "PLAN_REQUEST_TIMEOUT", 0.3)
    router, client = scripted.router, scripted.client

    attempts: dict[str, int] = {}

    async def next_of(job: str, *, not_on: tuple[list[bytes], ...] = ()) -> tuple[list[bytes], PlanRequest]:
        """The next request of ``job`` not sent on a socket of ``not_on``; repeats of other requests (asked again
        every 0.3 s) are passed over."""
        while True:
            envelope, req = await scripted.receive()
            if req.job == job and envelope not in not_on:
                return envelope, req
            assert req.attempt == attempts[req.job]

    async def answered_twice() -> None:
        deadline = time.monotonic() + TIMEOUT
        first_j = asyncio.ensure_future(client.plan(_ask(1), deadline))
        waiting_k = asyncio.ensure_future(client.plan(dataclasses.replace(_ask(0), job="k"), deadline))
        for job in ("j", "k"):
            attempts[job] = (await next_of(job))[1].attempt
        old, j_again = await next_of("j")  # no answer within the request timeout: asked again, same attempt
        assert j_again.attempt == attempts["j"]
        await router.send_multipart([*old, *encode(PlanReply(job="j", rank=1, status="ready", step=7))])
        async with asyncio.timeout(TIMEOUT):
            assert (await first_j).step == 7
        fresh, k_again = await next_of("k", not_on=(old,))  # k, on the fresh socket, under its attempt
        assert k_again.attempt == attempts["k"]
        restarted = asyncio.ensure_future(client.plan(_ask(1), time.monotonic() + TIMEOUT))
        _, anew = await next_of("j", not_on=(old,))
        assert anew.attempt not in (0, attempts["j"])
        attempts["j"] = anew.attempt
        await router.send_multipart([*old, *encode(PlanReply(job="j", rank=1, status="ready", step=7))])
        await next_of("k", not_on=(old,))  # k asked again on the fresh socket: it timed out there too
        assert not restarted.done()  # the second answer went to the closed socket
        await router.send_multipart([*fresh, *encode(PlanReply(job="j", rank=1, status="ready", step=9))])
        async with asyncio.timeout(TIMEOUT):
            assert (await restarted).step == 9
        # a call ended after a timeout: another socket
        newest, k_last = await next_of("k", not_on=(old, fresh))
        assert k_last.attempt == attempts["k"]
        await router.send_multipart([*newest, *encode(PlanReply(job="k", rank=0, status="ready", step=4))])
        async with asyncio.timeout(TIMEOUT):
            assert (await waiting_k).step == 4

    scripted.run(answered_twice)


def test_an_answer_to_a_call_that_gave_up_never_reaches_the_next_call_of_its_rank(
    scripted: _Scripted,
) -> None:
    """A call that gives up (its deadline passed) leaves its request with the coordinator, which may still
    answer it. The plan socket is then replaced although another job's call waits (it asks again on the fresh
    one, under its attempt), so that the late answer cannot settle the rank's next call."""
    router, client = scripted.router, scripted.client

    async def gives_up() -> None:
        waiting_k = asyncio.ensure_future(
            client.plan(dataclasses.replace(_ask(0), job="k"), time.monotonic() + TIMEOUT)
        )
        old, first_k = await scripted.receive()
        gave_up = asyncio.ensure_future(client.plan(_ask(1), time.monotonic() + 0.3))
        _, first_j = await scripted.receive()
        assert (first_k.job, first_j.job) == ("k", "j")
        with pytest.raises(CoordinatorUnavailable):
            await gave_up
        fresh, k_again = await scripted.receive()  # k, on a fresh socket, under its attempt
        assert fresh != old and (k_again.job, k_again.attempt) == ("k", first_k.attempt)
        again = asyncio.ensure_future(client.plan(_ask(1), time.monotonic() + TIMEOUT))
        _, j_again = await scripted.receive()
        assert j_again.job == "j" and j_again.attempt not in (0, first_j.attempt)
        await router.send_multipart([*old, *encode(PlanReply(job="j", rank=1, status="ready", step=3))])
        await asyncio.sleep(0.2)
        assert not again.done()  # the late answer went to the closed socket
        for job, rank, step in (("j", 1, 9), ("k", 0, 4)):
            await router.send_multipart(
                [*fresh, *encode(PlanReply(job=job, rank=rank, status="ready", step=step))]
            )
        async with asyncio.timeout(TIMEOUT):
            assert [(await again).step, (await waiting_k).step] == [9, 4]

    scripted.run(gives_up)


@pytest.mark.parametrize("coordinator", [{"plan_hold": 0.0}], indirect=True)
def test_against_a_coordinator_that_holds_nothing_plan_polls_until_its_deadline(
    coordinator: Coordinator,
) -> None:
    async def body(client: CoordinatorClient) -> None:
        t0 = time.monotonic()
        with pytest.raises(
            CoordinatorUnavailable, match=r"rank 0: 1 of 4 ranks accounted for; waiting for rank"
        ):
            await client.plan(_ask(0), t0 + 0.6)
        assert 0.55 <= time.monotonic() - t0 < 3.0

    asyncio.run(_with_node(coordinator.endpoint, body))


@pytest.mark.timeout(30)
def test_a_refusal_naming_no_job_fails_the_call_and_the_plan_reader_goes_quiet(scripted: _Scripted) -> None:
    """A coordinator that refuses a request without naming its job (it could not read it) fails every waiting
    call. The plan reader then has no rank to ask for: it waits for replies instead of asking again in a loop
    that never yields (which once spun at 100% CPU, starving the sidecar's other tasks and its SIGTERM)."""
    router, client = scripted.router, scripted.client

    async def refuse_and_watch() -> None:
        call = asyncio.ensure_future(client.plan(_ask(2), time.monotonic() + TIMEOUT))
        async with asyncio.timeout(TIMEOUT):
            frames = await router.recv_multipart()
        await router.send_multipart(
            [frames[0], *encode(Error(code=ErrorCode.BAD_MESSAGE, message="unreadable"))]
        )
        with pytest.raises(ProtocolError, match="unreadable"):
            async with asyncio.timeout(TIMEOUT):
                await call
        assert client._pump is None and not client._groups  # the reader stopped with the last call
        assert not await router.poll(200)  # and nothing was asked again

    scripted.run(refuse_and_watch)
