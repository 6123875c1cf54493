"""The outbox of a server pipe: one peer that stops reading holds up no other peer."""

from __future__ import annotations

import asyncio

import pytest

from snapshotd.proto import ChunkAck, decode
from snapshotd.sidecar.node import Counters
from snapshotd.sidecar.outbox import Outbox
from snapshotd.transport import Frames, Pipe, TransportError


class _Pipe(Pipe):
    """A server pipe whose sends to ``stuck`` never complete (a stopped peer with its connection full)."""

    address = "fake"

    def __init__(self, stuck: bytes) -> None:
        self.stuck = stuck
        self.sent: list[tuple[bytes, int]] = []

    async def send(self, frames: Frames) -> None:
        if frames[0] == self.stuck:
            await asyncio.get_running_loop().create_future()  # never
        msg = decode(frames[1:])
        assert isinstance(msg, ChunkAck)
        self.sent.append((frames[0], msg.index))

    def send_nowait(self, frames: Frames) -> bool:
        raise AssertionError("the outbox waits for room")

    async def recv(self, *, copy: bool = False) -> Frames:
        raise AssertionError

    def recv_nowait(self, *, copy: bool = True) -> Frames | None:
        return None

    async def poll(self, timeout: float) -> bool:
        return False

    def close(self) -> None:
        pass


def _ack(index: int) -> ChunkAck:
    return ChunkAck(job="j", rank=0, step=1, index=index)


def test_a_peer_that_stops_reading_holds_up_no_other_and_its_stale_queue_is_dropped_after_the_timeout() -> (
    None
):
    """One writer for all peers sent in arrival order: a served pull to a stopped peer held every other peer's
    replies up to the send timeout per chunk, and the sidecar's data plane went silent for minutes."""

    async def story() -> None:
        pipe = _Pipe(stuck=b"A")
        outbox = Outbox(Counters(), timeout=2.0)  # long enough that A is not given up before its puts below
        writer = asyncio.create_task(outbox.run(pipe))
        try:
            for i in range(3):
                await outbox.put(b"A", _ack(i))  # A stops reading after these
            for i in range(3):
                outbox.reply(b"B", _ack(i))
            async with asyncio.timeout(0.3):  # well within A's timeout
                while len(pipe.sent) < 3:
                    await asyncio.sleep(0.01)
            assert pipe.sent == [(b"B", 0), (b"B", 1), (b"B", 2)]  # in order, and not behind A
            # A's queue fills
            waiting = [asyncio.create_task(outbox.put(b"A", _ack(i))) for i in range(3, 3 + 64)]
            await asyncio.sleep(0.1)
            assert sum(t.done() for t in waiting) < 64  # a pull to A waits for room in A's queue alone
            # A's send times out: what is queued for A is dropped, the puts waiting fail
            async with asyncio.timeout(10):
                results = await asyncio.gather(*waiting, return_exceptions=True)
            assert any(isinstance(r, TransportError) and "stopped taking" in str(r) for r in results), results
            outbox.reply(b"A", _ack(100))  # A is given up: its replies are dropped ...
            assert b"A" not in outbox._queues
            outbox.heard(b"A")  # ... until it sends again
            outbox.reply(b"A", _ack(101))
            assert list(outbox._queues[b"A"]) == [_ack(101)]
            outbox.reply(b"B", _ack(3))
            async with asyncio.timeout(0.3):
                while len(pipe.sent) < 4:
                    await asyncio.sleep(0.01)
            assert pipe.sent[-1] == (b"B", 3)
        finally:
            writer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await writer

    asyncio.run(story())
