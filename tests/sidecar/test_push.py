"""A stream pushed over the buddy's bulk port: the sender's lanes and the buddy's receiving threads, real sockets.

The first tests put a :class:`~snapshotd.sidecar.bulk.BulkServer` on an event loop of its own thread, expecting one
:class:`~snapshotd.sidecar.bulk.Push` into buffers of test size, and send to it with
:class:`~snapshotd.sidecar.push.LanePool`'s lanes, or with a raw socket where a test sends what no sidecar would. The last ones
stream end to end between real sidecars in this process on loopback TCP (:class:`~tests.deployments.InProcess`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.proto import checksum
from snapshotd.proto.bulk import (
    HELLO,
    PUSH_CHUNK,
    PUSH_MAGIC,
    PUSH_SUM,
    VERSION,
    Status,
    send_all,
    send_checked,
)
from snapshotd.sidecar import bulk
from snapshotd.sidecar import push as sender
from snapshotd.sidecar.bulk import BulkServer, Push
from snapshotd.sidecar.integrity import Seal
from snapshotd.sidecar.push import LanePool, Lanes, PushFailed

from ..deployments import InProcess
from ..waits import wait_until

BLOCK = 64 << 10
DATA = os.urandom(5 * BLOCK + 1000)  # six chunks, the last one short
NCHUNKS = 6


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(10)
    lp.close()


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(20)


class Buddy:
    """A bulk port expecting a push of :data:`DATA` (:meth:`expect` another); what landed and why it failed, as
    its callbacks said."""

    def __init__(self, loop: asyncio.AbstractEventLoop, port: int = 0) -> None:
        self.loop = loop

        async def start() -> BulkServer:
            return BulkServer("127.0.0.1", port, served=lambda n: None, ticket_ttl=10.0, timeout=5.0)

        self.server: BulkServer = run(loop, start())
        self.expect()

    def expect(self) -> None:
        """Expect a new push (:attr:`token`) into fresh buffers."""
        self.buffers = [memoryview(bytearray(len(DATA[i * BLOCK : (i + 1) * BLOCK]))) for i in range(NCHUNKS)]
        self.landed: dict[int, int] = {}
        self.failures: list[str] = []

        async def expect() -> bytes:
            push = Push("job 'j' rank 0 step 1", self.buffers, self.landed.update, self.failures.append)
            return self.server.expect(push)

        self.token: bytes = run(self.loop, expect())

    def close(self) -> None:
        run(self.loop, _call(self.server.close))


async def _call(fn: Any) -> Any:
    return fn()


def push_all(
    loop: asyncio.AbstractEventLoop,
    pool: LanePool,
    buddy: Buddy,
    lanes: int,
    seal: Seal,
    data: bytes | bytearray = DATA,
) -> None:
    """Push every chunk of ``data`` to ``buddy``'s expected push over ``lanes`` lanes from ``pool``."""

    async def push() -> None:
        sending = pool.take(
            "127.0.0.1",
            buddy.server.port,
            buddy.token,
            count=lanes,
            seal=seal,
            data=memoryview(data),
            timeout=5.0,
        )
        try:
            for index in range(NCHUNKS):
                sending.send(index)
            await sending.finish()
        finally:
            await sending.stop()

    run(loop, push())


@pytest.fixture
def buddy(loop: asyncio.AbstractEventLoop) -> Iterator[Buddy]:
    b = Buddy(loop)
    yield b
    b.close()


def raw_push(buddy: Buddy, *headers_and_payloads: bytes, token: bytes | None = None) -> bytes:
    """Connect, present ``token`` (the push's own by default), send the given bytes; what the buddy sent back
    before it closed the connection (a buddy that closed it while they were still being sent sent nothing)."""
    with socket.create_connection(("127.0.0.1", buddy.server.port), timeout=5) as s:
        try:
            s.sendall(HELLO.pack(PUSH_MAGIC, VERSION, buddy.token if token is None else token))
            for part in headers_and_payloads:
                s.sendall(part)
            s.shutdown(socket.SHUT_WR)
            return s.recv(100)
        except OSError:
            return b""


def chunk(
    index: int, *, length: int | None = None, sum_: int | None = None, status: int = Status.OK
) -> bytes:
    payload = DATA[index * BLOCK : (index + 1) * BLOCK]
    n = len(payload) if length is None else length
    trailer = PUSH_SUM.pack(checksum(payload) if sum_ is None else sum_)
    return PUSH_CHUNK.pack(index, n, status) + payload[:n] + trailer


@pytest.fixture
def pool(loop: asyncio.AbstractEventLoop) -> Iterator[LanePool]:
    lanes = LanePool()
    yield lanes
    run(loop, _call(lanes.close))


def landed_whole(buddy: Buddy) -> None:
    wait_until(lambda: len(buddy.landed) == NCHUNKS, "every chunk to land")
    assert b"".join(bytes(b) for b in buddy.buffers) == DATA
    assert buddy.landed == {i: checksum(DATA[i * BLOCK : (i + 1) * BLOCK]) for i in range(NCHUNKS)}
    assert buddy.failures == []


@pytest.mark.parametrize("lanes", [1, 3])
def test_every_chunk_lands_in_its_buffer_with_its_checksum(
    loop: asyncio.AbstractEventLoop, buddy: Buddy, pool: LanePool, lanes: int
) -> None:
    seal = Seal(BLOCK, 0)
    push_all(loop, pool, buddy, lanes, seal)
    landed_whole(buddy)
    assert seal.sums == buddy.landed


def test_a_block_whose_sum_the_seal_holds_is_sent_with_it_and_checked_against_it(
    loop: asyncio.AbstractEventLoop, buddy: Buddy, pool: LanePool
) -> None:
    """A slot's bytes changed after its seal took their sums (a rank writing into a slot it handed over) never
    become a copy: the buddy checks them against the seal's sums, which the lanes send as they are."""
    seal = Seal(BLOCK, 0)
    seal.fill(memoryview(DATA))
    slot = bytearray(DATA)
    slot[BLOCK + 7] ^= 0xFF  # chunk 1
    with contextlib.suppress(PushFailed):  # the lane may have sent it all before the buddy closed its end
        push_all(loop, pool, buddy, 1, seal, slot)
    wait_until(lambda: buddy.failures, "the push to fail")
    (why,) = buddy.failures
    assert "chunk 1 of job 'j' rank 0 step 1 failed its end-to-end check" in why
    assert buddy.landed == {0: seal.sums[0]}
    buddy.expect()  # the same seal over the bytes it was taken of: every chunk lands with the seal's sums
    push_all(loop, pool, buddy, 2, seal)
    landed_whole(buddy)


def _resizable(buf: bytearray) -> bool:
    """Whether no view of ``buf`` is held anywhere (a bytearray with views exported cannot change size)."""
    try:
        buf.append(0)
    except BufferError:
        return False
    del buf[-1]
    return True


def test_a_lane_waiting_for_the_next_push_holds_no_view_of_the_last(
    loop: asyncio.AbstractEventLoop, buddy: Buddy, pool: LanePool
) -> None:
    """A slot's memory can be unmapped (its rank gone) while the lanes that pushed it wait for the next push."""
    slot = bytearray(DATA)
    push_all(loop, pool, buddy, 2, Seal(BLOCK, 0), slot)
    landed_whole(buddy)
    assert pool.idle == 2
    wait_until(lambda: _resizable(slot), "the lanes to let go of the slot")


def test_the_next_push_to_the_buddy_goes_over_the_same_connections(
    loop: asyncio.AbstractEventLoop, buddy: Buddy, pool: LanePool
) -> None:
    push_all(loop, pool, buddy, 3, Seal(BLOCK, 0))
    landed_whole(buddy)
    assert pool.idle == 3
    buddy.expect()  # the next step's stream
    push_all(loop, pool, buddy, 2, Seal(BLOCK, 0))
    landed_whole(buddy)
    assert buddy.server.accepted == 3 and pool.idle == 3


def test_a_lane_whose_buddy_closed_its_connection_is_replaced(
    loop: asyncio.AbstractEventLoop, buddy: Buddy, pool: LanePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buddy closes an idle push connection after a while, and all of them when it restarts: the next push
    connects afresh instead of failing on a connection that is gone."""
    monkeypatch.setattr(bulk, "PUSH_IDLE", 0.2)
    push_all(loop, pool, buddy, 2, Seal(BLOCK, 0))
    landed_whole(buddy)
    wait_until(lambda: buddy.server.accepted == 2 and not buddy.server._conns, "the buddy to close idle ones")
    buddy.expect()
    push_all(loop, pool, buddy, 2, Seal(BLOCK, 0))
    landed_whole(buddy)
    assert buddy.server.accepted == 4
    port = buddy.server.port
    buddy.close()  # a sidecar restarted on the same port
    again = Buddy(loop, port)
    try:
        push_all(loop, pool, again, 2, Seal(BLOCK, 0))
        landed_whole(again)
        assert again.server.accepted == 2
    finally:
        again.close()


def test_a_lane_idle_longer_than_the_pool_keeps_it_closes_itself(
    loop: asyncio.AbstractEventLoop, buddy: Buddy
) -> None:
    pool = LanePool(idle_seconds=0.3)
    push_all(loop, pool, buddy, 2, Seal(BLOCK, 0))
    assert pool.idle == 2
    # no push follows: the lanes close their connections by themselves, and the buddy's threads end
    wait_until(lambda: not buddy.server._conns, "the idle lanes to close")
    buddy.expect()
    push_all(loop, pool, buddy, 2, Seal(BLOCK, 0))
    landed_whole(buddy)
    assert buddy.server.accepted == 4
    run(loop, _call(pool.close))
    assert pool.idle == 0
    wait_until(lambda: not buddy.server._conns, "the buddy to see the closed lanes go")


def test_a_chunk_whose_bytes_fail_their_checksum_ends_the_push_naming_it(buddy: Buddy) -> None:
    assert raw_push(buddy, chunk(0), chunk(1, sum_=12345), chunk(2)) == b""  # the buddy closed the connection
    wait_until(lambda: buddy.failures, "the push to fail")
    assert buddy.landed == {0: checksum(DATA[:BLOCK])}  # chunk 2 was never taken
    (why,) = buddy.failures
    assert "chunk 1 of job 'j' rank 0 step 1 failed its end-to-end check: xxh3-64 of 65536 bytes" in why
    assert raw_push(buddy, chunk(3)) == b"" and 3 not in buddy.landed  # an ended push admits no connection


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (PUSH_CHUNK.pack(NCHUNKS, BLOCK, Status.OK), f"chunk {NCHUNKS} is outside 0..{NCHUNKS - 1}"),
        (PUSH_CHUNK.pack(0, BLOCK - 1, Status.OK), f"chunk 0 is {BLOCK - 1} B, expected {BLOCK} B"),
        (PUSH_CHUNK.pack(0, BLOCK, Status.CORRUPT), "a chunk header with status 1"),
    ],
)
def test_a_chunk_that_does_not_fit_the_stream_ends_the_push(buddy: Buddy, header: bytes, why: str) -> None:
    raw_push(buddy, header)
    wait_until(lambda: buddy.failures, "the push to fail")
    assert buddy.failures == [f"job 'j' rank 0 step 1: {why}"] and buddy.landed == {}


def test_a_chunk_sent_twice_ends_the_push(buddy: Buddy) -> None:
    raw_push(buddy, chunk(1), chunk(1))
    wait_until(lambda: buddy.failures, "the push to fail")
    assert buddy.failures == ["job 'j' rank 0 step 1: chunk 1 arrived twice"] and list(buddy.landed) == [1]


def test_a_wrong_token_or_an_ended_push_is_refused_and_nothing_lands(
    loop: asyncio.AbstractEventLoop, buddy: Buddy
) -> None:
    assert raw_push(buddy, chunk(0), token=bytes(16)) == b""

    async def end() -> None:
        buddy.server.end(buddy.token)

    run(loop, end())
    assert raw_push(buddy, chunk(0)) == b""
    assert buddy.landed == {} and buddy.failures == []  # a refusal is no failure of the push


def test_lanes_whose_buddy_goes_away_fail_naming_the_cause(
    loop: asyncio.AbstractEventLoop, buddy: Buddy, pool: LanePool
) -> None:
    buddy.close()
    with pytest.raises(PushFailed, match="ConnectionRefusedError|ConnectionResetError|BrokenPipeError"):
        push_all(loop, pool, buddy, 2, Seal(BLOCK, 0))
    assert pool.idle == 0  # a lane that failed is never kept


def _push_to_no_reader(pool: LanePool, listener: socket.socket, timeout: float) -> Lanes:
    """One lane's push of 64 MiB, far more than the socket buffers at both ends hold, to a port whose
    connections are taken (by the kernel's backlog) but never read: the lane ends up blocked in a send."""
    sending = pool.take(
        "127.0.0.1",
        listener.getsockname()[1],
        bytes(16),
        count=1,
        seal=Seal(4 << 20, 0),
        data=memoryview(bytearray(64 << 20)),
        timeout=timeout,
    )
    for index in range(16):
        sending.send(index)
    return sending


def test_a_lane_whose_buddy_stops_reading_fails_after_its_timeout(
    loop: asyncio.AbstractEventLoop, pool: LanePool
) -> None:
    """A buddy that took the connection but reads nothing (hung, or its path black-holed) fails the push once
    the socket's buffers are full and no byte goes for the lane's timeout: the lane never blocks for good."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        async def push() -> None:
            sending = _push_to_no_reader(pool, listener, 0.5)
            try:
                await sending.finish()
            finally:
                await sending.stop()

        with pytest.raises(
            PushFailed, match=r"TimeoutError: the bulk port 127\.0\.0\.1:\d+ took no byte for 0\.5 s"
        ):
            run(loop, push())
    assert pool.idle == 0


def test_stopping_a_lane_blocked_in_a_send_ends_it_at_once(
    loop: asyncio.AbstractEventLoop, pool: LanePool
) -> None:
    """A stream cancelled while its lane waits in the kernel for a buddy that reads nothing does not wait out the
    lane's timeout: stop() cuts the connection and the lane lets go of the data."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        async def push() -> float:
            sending = _push_to_no_reader(pool, listener, 30.0)
            with pytest.raises(TimeoutError):  # still sending, the buddy's buffers full: the stream gives up
                await asyncio.wait_for(sending.finish(), 0.5)
            started = loop.time()
            await sending.stop(timeout=5.0)
            return loop.time() - started

        assert run(loop, push()) < 2.0
    assert pool.idle == 0


def test_a_chunk_whose_checksum_never_comes_does_not_land(buddy: Buddy) -> None:
    whole = chunk(0)
    raw_push(buddy, whole[: -PUSH_SUM.size])  # the sender closed between the payload and its checksum
    raw_push(buddy, chunk(1))
    wait_until(lambda: 1 in buddy.landed, "the next connection's chunk to land")
    assert 0 not in buddy.landed and buddy.failures == []


FLOATS = 300_000  # 1.2 MB: 19 chunks of 64 KiB


def _state(step: int) -> dict:
    return {"w": torch.randn(FLOATS, generator=torch.Generator().manual_seed(step)), "loop": {"step": step}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connections", [0, 1, 3])
def test_a_stream_pushed_or_sent_as_messages_makes_the_same_copy(connections: int) -> None:
    job = f"push-{uuid.uuid4().hex[:6]}"
    with InProcess(tcp=True, chunk_bytes=64 << 10, push_connections=connections) as dep:
        ipc = dep.start_sidecar("A")
        dep.start_sidecar("B")
        state = _state(1)
        with Snapshotter(
            state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block"
        ) as snap:
            assert snap.restore(timeout=30) == 0
            for step in (1, 2, 3):
                state["w"].copy_(_state(step)["w"])
                assert snap.capture(step) and snap.wait(30), snap.stats
            b = dep.sidecars["B"].state
            held = b.store.get(job, 0, 3)
            assert held.data.tobytes() == state["w"].numpy().tobytes()
            lr = dep.sidecars["A"].state.rank(job, 0)
            assert lr is not None and (index := lr.find(3)) is not None
            sent = lr.slots[index].seal
            assert sent is not None and held.seal.sums == sent.sums and held.seal.digest == sent.digest
            assert b.counters.pushes_in == (3 if connections else 0)


@pytest.mark.timeout(120)
def test_a_chunk_the_buddy_finds_corrupt_fails_that_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's lane carries a checksum that its bytes do not match (as bytes changed after the seal was
    taken): the buddy refuses the chunk, the step is not durable there, and the next step streams whole."""
    job = f"push-{uuid.uuid4().hex[:6]}"

    def spoil_one(sock: socket.socket, header: bytes, view: memoryview) -> int:
        if PUSH_CHUNK.unpack(header)[0] != 5:
            return send_checked(sock, header, view)
        value = checksum(view) ^ 1
        send_all(sock, [header, view, PUSH_SUM.pack(value)])
        return value

    with InProcess(tcp=True, chunk_bytes=64 << 10) as dep:
        ipc = dep.start_sidecar("A")
        dep.start_sidecar("B")
        state = _state(1)
        with Snapshotter(
            state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block"
        ) as snap:
            assert snap.restore(timeout=30) == 0
            assert snap.capture(1) and snap.wait(30)
            monkeypatch.setattr(sender, "send_checked", spoil_one)
            state["w"].add_(1.0)
            assert snap.capture(2)
            assert not snap.wait(30)  # step 2 did not reach its buddy
            assert (
                snap.stats.failed == 1
                and "chunk 5" in snap.stats.last_error
                and "xxh3" in snap.stats.last_error
            )
            b = dep.sidecars["B"].state.store
            wait_until(lambda: not b.holds(job, 0, 2), "the sender's abort to reach the buddy")
            monkeypatch.setattr(sender, "send_checked", send_checked)
            state["w"].add_(1.0)
            assert snap.capture(3) and snap.wait(30)
            assert b.get(job, 0, 3).data.tobytes() == state["w"].numpy().tobytes()
