"""The pipe contract, held by both networks: ZeroMQ (``tcp://``) and in-memory (``mem://``).

Whole multipart messages, in order; a server sees each client's identity and answers by it; a reply to a peer
that left is refused with TransportError, never queued; a client may send before its server is bound; a
training process's blocking pipe talks to a server on an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import zmq

from snapshotd.transport import MEMORY, Network, Role, Security, TransportError, connect_rank
from snapshotd.transport.zeromq import ZmqNetwork, ZmqPipe

pytestmark = pytest.mark.timeout(30)

KINDS = ("zeromq", "memory")


@contextlib.asynccontextmanager
async def network(kind: str) -> AsyncIterator[tuple[Network, str]]:
    """A network of ``kind`` and a fresh address on it to bind (port 0 / a unique name)."""
    if kind == "zeromq":
        net = ZmqNetwork(Security())
        try:
            yield net, "tcp://127.0.0.1:0"
        finally:
            net.close()
    else:
        yield MEMORY, f"mem://test-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("kind", KINDS)
def test_requests_and_replies_keep_their_frames_and_order(kind: str) -> None:
    async def scenario() -> None:
        async with network(kind) as (net, address):
            server = net.serve(address, Role.DATA)
            a, b = net.connect(server.address, Role.PEER), net.connect(server.address, Role.PEER)
            try:
                async with asyncio.timeout(10):
                    for i in range(3):
                        await a.send([b"head-a", memoryview(bytes([i]) * 3)])
                    await b.send([b"head-b"])
                    got = [await server.recv(copy=True) for _ in range(4)]
                    by_client: dict[bytes, list[list[bytes]]] = {}
                    for ident, *frames in got:
                        by_client.setdefault(bytes(ident), []).append([bytes(f) for f in frames])
                    assert sorted(len(v) for v in by_client.values()) == [1, 3]
                    ident_a = next(k for k, v in by_client.items() if len(v) == 3)
                    # in order, whole
                    assert by_client[ident_a] == [[b"head-a", bytes([i]) * 3] for i in range(3)]
                    await server.send([ident_a, b"reply", b"x" * 100_000])
                    assert [bytes(f) for f in await a.recv()] == [b"reply", b"x" * 100_000]
                    assert not await b.poll(0.05) and b.recv_nowait() is None  # nothing for b
            finally:
                for pipe in (a, b, server):
                    pipe.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_to_a_peer_that_left_is_refused(kind: str) -> None:
    async def scenario() -> None:
        async with network(kind) as (net, address):
            server = net.serve(address, Role.DATA)
            client = net.connect(server.address, Role.PEER)
            try:
                async with asyncio.timeout(10):
                    await client.send([b"hello"])
                    ident, _ = await server.recv(copy=True)
                    client.close()
                    with pytest.raises(TransportError):
                        for _ in range(100):  # ZeroMQ learns of the disconnection a moment later
                            await server.send([ident, b"late"])
                            await asyncio.sleep(0.02)
                    with pytest.raises(TransportError):
                        server.send_nowait([b"\0nobody", b"x"])
            finally:
                server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("call", ["send_nowait", "poll"])
def test_a_waiting_recv_wakes_after_a_pipe_call_took_its_signal(call: str) -> None:
    """ZeroMQ signals a socket's readiness on an edge-triggered descriptor, and any call that processes the
    socket's pending commands (a poll, a send) consumes the edge that a waiting ``recv`` sleeps on. A pipe's own
    calls must wake such a waiter: a sidecar whose replies went out by ``send_nowait`` beside its data loop's
    ``recv`` stayed deaf to a peer's pull requests until that peer connected afresh."""

    async def scenario() -> None:
        net = ZmqNetwork(Security())
        server = net.serve("tcp://127.0.0.1:0", Role.DATA)
        client = net.connect(server.address, Role.PEER)
        assert isinstance(server, ZmqPipe)
        try:
            async with asyncio.timeout(10):
                await client.send([b"hello"])
                ident, _ = await server.recv(copy=True)
                waiting = asyncio.ensure_future(server.recv(copy=True))
                await asyncio.sleep(0)  # it reads nothing and waits on the descriptor
                assert not waiting.done()
                await client.send([b"request"])  # done at once: the loop does not run before the next line
                assert server.raw.poll(5000, zmq.POLLIN)  # the request is queued, and its edge consumed
                if call == "send_nowait":
                    assert server.send_nowait([ident, b"reply"])
                else:
                    assert await server.poll(0)
                done, _ = await asyncio.wait([waiting], timeout=3)
                assert done, "the waiting recv slept through a request queued on its socket"
                if call == "poll":
                    assert server.send_nowait([ident, b"reply"])
                assert [bytes(f) for f in waiting.result()] == [ident, b"request"]
                assert [bytes(f) for f in await client.recv()] == [b"reply"]
        finally:
            client.close()
            server.close()
            net.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_may_send_before_its_server_is_bound(kind: str) -> None:
    async def scenario() -> None:
        async with network(kind) as (net, address):
            # a fixed port: a plain socket finds a free one and frees it at once (a ZeroMQ
            if kind == "zeromq":
                # listener closes later, in its I/O thread, and could take the early message with it)
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
            client = net.connect(address, Role.COORDINATOR)
            server = None
            try:
                async with asyncio.timeout(10):
                    sent = asyncio.ensure_future(client.send([b"early"]))
                    await asyncio.sleep(0.1)
                    server = net.serve(address, Role.CONTROL)
                    await sent
                    _, frame = await server.recv(copy=True)
                    assert bytes(frame) == b"early"
            finally:
                client.close()
                if server is not None:
                    server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_training_process_pipe_wait_ends_on_a_wake_from_another_thread(kind: str, tmp_path) -> None:
    """wake() ends a wait() in progress at once (False: no message), or the next one when none is in progress;
    several wakes make one; after close() it does nothing."""
    sidecar = f"mem://ipc-{uuid.uuid4().hex[:8]}" if kind == "memory" else f"{tmp_path}/nobody.ipc"
    pipe = connect_rank(sidecar)
    try:
        pipe.wake()
        pipe.wake()
        t0 = time.monotonic()
        assert not pipe.wait(30) and time.monotonic() - t0 < 10  # the pending wakes end it
        assert not pipe.wait(0.01)  # both were answered by that return
        waiting = threading.Thread(target=lambda: ended.append(pipe.wait(30)))
        ended: list[bool] = []
        waiting.start()
        pipe.wake()
        waiting.join(10)
        assert ended == [False] and not waiting.is_alive()
    finally:
        pipe.close()
    pipe.wake()  # closed: nothing happens


@pytest.mark.parametrize("kind", KINDS)
def test_a_training_process_pipe_talks_to_a_server_on_an_event_loop(kind: str, tmp_path) -> None:
    """The rank's blocking pipe (its channel thread) against the sidecar's ipc server on a loop."""

    async def scenario() -> None:
        async with network(kind) as (net, _):
            address = f"mem://ipc-{uuid.uuid4().hex[:8]}" if kind == "memory" else f"ipc://{tmp_path}/s.ipc"
            server = net.serve(address, Role.IPC)
            sidecar = address if kind == "memory" else address.removeprefix("ipc://")
            replies: list[bytes] = []

            def rank() -> None:
                pipe = connect_rank(sidecar)
                try:
                    assert pipe.send_nowait([b"register"])
                    assert pipe.wait(10)
                    replies.extend(bytes(f) for f in pipe.recv_nowait() or [])
                    assert not pipe.wait(0.05) and pipe.recv_nowait() is None
                finally:
                    pipe.close()

            thread = threading.Thread(target=rank)
            thread.start()
            try:
                async with asyncio.timeout(10):
                    ident, frame = await server.recv(copy=True)
                    assert bytes(frame) == b"register"
                    await server.send([ident, b"registered"])
                    await asyncio.to_thread(thread.join, 10)
            finally:
                thread.join(10)
                server.close()
            assert replies == [b"registered"]

    asyncio.run(scenario())
