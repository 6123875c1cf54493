"""MembersGate's decisions: the coordinator's answers remembered for their time, a failed question refusing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from snapshotd.security import DATA_DOMAIN, HandshakeWatch, MembersGate, members


class _Coordinator:
    """Answers member questions from a set of hosts, counting them; ``down`` makes it fail."""

    def __init__(self, *members: str) -> None:
        self.members = set(members)
        self.asked: list[str] = []
        self.down = False

    async def is_member(self, host: str) -> bool:
        self.asked.append(host)
        if self.down:
            raise TimeoutError("coordinator tcp://10.0.0.1:7070 did not answer within 10.0 s")
        return host in self.members


def test_answers_are_remembered_and_a_failure_is_temporary() -> None:
    async def scenario() -> None:
        clock = [100.0]
        coord = _Coordinator("10.0.0.5")
        ctx = zmq.asyncio.Context()
        try:
            gate = MembersGate(ctx, coord.is_member, clock=lambda: clock[0])
            assert await gate.decide("10.0.0.5") == (b"200", "")
            assert await gate.decide("10.0.0.9") == (
                b"400",
                "not the host of any live sidecar registered with the coordinator",
            )
            assert await gate.decide("10.0.0.5") == (b"200", "")
            assert coord.asked == ["10.0.0.5", "10.0.0.9"]  # the second question about .5 was not asked
            clock[0] += members.REFUSED_TTL_S + 0.1
            coord.members.add("10.0.0.9")  # joined since
            assert (await gate.decide("10.0.0.9"))[0] == b"200"
            coord.down = True
            clock[0] += members.MEMBER_TTL_S + 0.1
            code, why = await gate.decide("10.0.0.5")
            assert code == b"300" and "cannot ask the coordinator" in why and "did not answer" in why
            coord.down = False
            assert (await gate.decide("10.0.0.5"))[0] == b"300"  # the failure stands for a moment ...
            clock[0] += members.FAILED_TTL_S + 0.1
            assert (await gate.decide("10.0.0.5"))[0] == b"200"  # ... then the coordinator is asked again
        finally:
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_concurrent_handshakes_from_one_host_ask_once() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        asked: list[str] = []

        async def slow_is_member(host: str) -> bool:
            asked.append(host)
            await release.wait()
            return True

        ctx = zmq.asyncio.Context()
        try:
            gate = MembersGate(ctx, slow_is_member)
            waiting = [asyncio.ensure_future(gate.decide("10.0.0.5")) for _ in range(50)]
            await asyncio.sleep(0.05)
            assert asked == ["10.0.0.5"]
            release.set()
            assert {await w for w in waiting} == {(b"200", "")}
        finally:
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_a_refused_connection_is_retried_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first handshake is refused (the member is not known yet); HandshakeWatch names it, connects again,
    and the next handshake is admitted."""
    monkeypatch.setattr(members, "REFUSED_TTL_S", 0.0)

    async def scenario() -> None:
        coord = _Coordinator()
        ctx = zmq.asyncio.Context()
        gate = MembersGate(ctx, coord.is_member)
        gating = asyncio.ensure_future(gate.run())
        await asyncio.sleep(0)  # the ZAP endpoint is bound before the server's first handshake
        server = ctx.socket(zmq.ROUTER)
        client = ctx.socket(zmq.DEALER)
        watch: HandshakeWatch | None = None
        try:
            server.linger = client.linger = 0
            server.zap_domain = DATA_DOMAIN
            port = server.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
            client.setsockopt(zmq.IMMEDIATE, 1)  # as a PeerLink: nothing queued before a handshake succeeds
            watch = HandshakeWatch(client, endpoint, "peer B", retry_s=0.2)
            watching = asyncio.ensure_future(watch.run())
            client.connect(endpoint)
            async with asyncio.timeout(10):
                while watch.failure is None:
                    await asyncio.sleep(0.02)
                assert "peer B refused this node (status 400)" in watch.failure
                coord.members.add("127.0.0.1")  # the coordinator learns of this host
                await client.send(b"hello")
                assert (await server.recv_multipart())[1] == b"hello"
                while watch.failure is not None:  # the success event may trail the message
                    await asyncio.sleep(0.02)
            assert coord.asked.count("127.0.0.1") >= 2
        finally:
            if watch is not None:
                watching.cancel()
                watch.close()
            client.close(linger=0)
            server.close(linger=0)
            gating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gating
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_a_failure_without_detail_never_hides_a_named_one() -> None:
    """With a security mismatch ZeroMQ reports the mismatch or a bare failure, whichever side notices first, as
    it reconnects: the reason kept is the named one until a handshake succeeds."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    watch = HandshakeWatch(sock, "tcp://127.0.0.1:9", "peer B")
    try:
        mismatch = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        bare = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
        assert watch.note(*bare) is False
        assert watch.failure is not None and watch.failure.startswith(
            "handshake with peer B failed, with no detail"
        )
        watch.note(*mismatch)
        watch.note(*bare)
        assert watch.failure is not None and watch.failure.startswith("security mismatch with peer B")
        assert watch.note(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400) is True  # refused: the caller connects again
        assert watch.failure.startswith("peer B refused this node (status 400)")
        watch.note(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        assert watch.failure is None
        watch.note(*bare)
        assert watch.failure.startswith("handshake with peer B failed")
    finally:
        watch.close()
        sock.close(linger=0)
        ctx.destroy(linger=0)
