"""The client's channel to its sidecar: a request is answered by the message that carries its id, and nothing else.

The sidecar here is a server pipe of the in-memory network driven by the test, so that it can send what a real
sidecar sends in the worst order: an error about an earlier announce, or a reply to another request, just before
the answer awaited.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from snapshotd.client.channel import Channel
from snapshotd.client.errors import SidecarRefused
from snapshotd.proto import Error, ErrorCode, Message, RankRegistered, RegisterRank, decode, encode
from snapshotd.transport import MEMORY, Role
from snapshotd.transport.memory import MemoryPipe

from ..waits import wait_until

REQUEST = RegisterRank(job="j", rank=0, world_size=1, pid=1, data_bytes=4096)


def registered(request_id: int) -> RankRegistered:
    return RankRegistered(
        job="j", rank=0, arena="/dev/shm/x", slot_bytes=4096, slots=2, pid=2, request_id=request_id
    )


@pytest.fixture
def sidecar() -> Iterator[tuple[str, MemoryPipe]]:
    address = f"mem://channel-{uuid.uuid4().hex[:8]}"
    server = MEMORY.serve(address, Role.IPC)
    yield address, server
    server.close()


def answer_with(server: MemoryPipe, answers: Callable[[Message], list[Message]]) -> threading.Thread:
    """A thread that waits for one request and sends ``answers(request)`` back, in order."""

    def run() -> None:
        wait_until(lambda: server.wait(0.1), "the request")
        frames = server.recv_nowait()
        assert frames is not None
        for msg in answers(decode(frames[1:])):
            server.send_nowait([frames[0], *encode(msg)])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_error_about_an_earlier_announce_does_not_answer_a_waiting_request(sidecar) -> None:  # type: ignore[no-untyped-def]
    address, server = sidecar
    unsolicited: list[Message] = []
    channel = Channel(address, unsolicited.append)
    late = Error(
        job="j", code=ErrorCode.BAD_MESSAGE, message="announce of step 3: steps only grow", rank=0, step=3
    )
    try:
        answer_with(server, lambda req: [late, registered(req.request_id)])  # type: ignore[attr-defined]
        reply = channel.request(REQUEST, RankRegistered.TYPE, timeout=10)
        assert isinstance(reply, RankRegistered) and reply.request_id != 0
        wait_until(lambda: unsolicited, "the late error to reach on_message")
        assert unsolicited == [late]
    finally:
        channel.close()


def test_an_answer_to_another_request_is_not_taken_for_this_ones(sidecar) -> None:  # type: ignore[no-untyped-def]
    address, server = sidecar
    unsolicited: list[Message] = []
    channel = Channel(address, unsolicited.append)
    try:
        answer_with(server, lambda req: [registered(req.request_id + 1000), registered(req.request_id)])  # type: ignore[attr-defined]
        reply = channel.request(REQUEST, RankRegistered.TYPE, timeout=10)
        assert isinstance(reply, RankRegistered)
        assert [m.request_id for m in unsolicited] == [reply.request_id + 1000]  # type: ignore[attr-defined]
    finally:
        channel.close()


def test_an_error_carrying_the_requests_id_answers_it(sidecar) -> None:  # type: ignore[no-untyped-def]
    address, server = sidecar
    channel = Channel(address, lambda msg: None)
    refused = "rank 0 of job 'j' is outside its world size 0"
    try:
        # type: ignore[attr-defined]
        answer_with(
            server,
            lambda req: [
                Error(job="j", code=ErrorCode.BAD_MESSAGE, message=refused, request_id=req.request_id)
            ],
        )
        with pytest.raises(SidecarRefused, match="outside its world size"):
            channel.request(REQUEST, RankRegistered.TYPE, timeout=10)
    finally:
        channel.close()
