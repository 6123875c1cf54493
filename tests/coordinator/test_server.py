"""A real coordinator (its own uvloop in a thread) on tcp://127.0.0.1:0, talked to with real DEALER sockets."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator

import pytest
import uvloop
import zmq

from snapshotd.coordinator import CoordinatorConfig, run_coordinator
from snapshotd.proto import (
    ChunkAck,
    Error,
    Heartbeat,
    HeartbeatReply,
    InventoryItem,
    Message,
    PlanReply,
    PlanRequest,
    RankInfo,
    RegisterSidecar,
    SidecarRegistered,
    decode,
    encode,
)
from snapshotd.status import fetch_status, render_status

TIMEOUT = 5.0
SECRET = "s3cret-for-tests"


class Coordinator:
    """``run_coordinator`` on a private event loop in a thread; :meth:`close` stops it within a timeout."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        self._ready: queue.Queue[str] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(cfg,), daemon=True)
        self._thread.start()
        try:
            self.endpoint = self._ready.get(timeout=TIMEOUT)
        except queue.Empty:
            self.close()
            raise AssertionError(f"coordinator did not start: {self.error!r}") from None

    def _run(self, cfg: CoordinatorConfig) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await run_coordinator(cfg, ready=self._ready.put, stop=self._stop)

        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(main())
        except BaseException as exc:  # surfaced by close()
            self.error = exc

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=TIMEOUT)
        assert not self._thread.is_alive(), "coordinator did not stop in time"
        if self.error is not None:
            raise self.error


@pytest.fixture
def start() -> Iterator:
    running: list[Coordinator] = []

    def factory(**kw) -> Coordinator:
        kw.setdefault("bind", "tcp://127.0.0.1:0")
        kw.setdefault("heartbeat_timeout", 0.5)
        kw.setdefault("heartbeat_interval", 0.1)
        c = Coordinator(CoordinatorConfig(**kw))
        running.append(c)
        return c

    yield factory
    for c in running:
        c.close()


@pytest.fixture
def dealer() -> Iterator:
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []

    def factory(endpoint: str, secret: str | None = None) -> zmq.Socket:
        from snapshotd.security import secure_client

        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        secure_client(s, secret)
        s.connect(endpoint)
        sockets.append(s)
        return s

    yield factory
    for s in sockets:
        s.close(linger=0)
    ctx.term()


def ask(sock: zmq.Socket, msg: Message | list[bytes]) -> Message:
    sock.send_multipart(encode(msg) if isinstance(msg, Message) else msg)
    assert sock.poll(int(TIMEOUT * 1000)), "no reply from the coordinator"
    return decode(sock.recv_multipart())


def register(sock: zmq.Socket, node: str, inc: str = "i1") -> None:
    reply = ask(sock, RegisterSidecar(node=node, data_addr=f"tcp://{node}:1", incarnation=inc))
    assert isinstance(reply, SidecarRegistered) and reply.heartbeat_interval == 0.1


def heartbeat(sock: zmq.Socket, node: str, rank: int, steps: tuple[int, ...], inc: str = "i1") -> HeartbeatReply:
    msg = Heartbeat(
        node=node, incarnation=inc,
        ranks=(RankInfo(job="j", rank=rank, world_size=2, pid=1, alive=True),),
        inventory=tuple(InventoryItem(job="j", rank=rank, step=s, local=True) for s in steps),
    )  # fmt: skip
    reply = ask(sock, msg)
    assert isinstance(reply, HeartbeatReply)
    return reply


def plan_until_answered(sock: zmq.Socket, rank: int, node: str) -> PlanReply:
    """Poll like a sidecar: resend while the answer is ``wait``."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        reply = ask(sock, PlanRequest(job="j", rank=rank, world_size=2, node=node))
        assert isinstance(reply, PlanReply)
        if reply.status != "wait" or time.monotonic() > deadline:
            return reply
        time.sleep(0.05)


def test_register_heartbeat_plan_and_status(start, dealer) -> None:
    coord = start()
    a, b = dealer(coord.endpoint), dealer(coord.endpoint)
    register(a, "a")
    register(b, "b")
    heartbeat(a, "a", 0, (3, 4))
    reply = heartbeat(b, "b", 1, (4,))
    assert reply.known and reply.assignments[0].buddies == ("tcp://a:1",)
    assert (reply.watermarks[0].recoverable, reply.watermarks[0].durable) == (4, -1)
    assert ask(a, PlanRequest(job="j", rank=0, world_size=2, node="a")).status == "wait"  # type: ignore[attr-defined]
    reply_b = plan_until_answered(b, 1, "b")  # waits out the rebuild window, then completes the round
    reply_a = plan_until_answered(a, 0, "a")
    assert (reply_a.status, reply_a.step, reply_a.local) == ("ready", 4, True)
    assert (reply_b.status, reply_b.step, reply_b.local) == ("ready", 4, True)
    doc = fetch_status(coord.endpoint, secret=None, timeout=TIMEOUT)
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]
    assert doc["jobs"][0]["recoverable"] == 4 and doc["coordinator"]["heartbeats"] == 2
    assert "recoverable step G = 4" in render_status(doc)


def test_malformed_and_unexpected_messages_get_errors_and_the_loop_goes_on(start, dealer) -> None:
    coord = start()
    sock = dealer(coord.endpoint)
    for junk in ([b"\xff\x00garbage"], [b"\x80"], [b"\x82\xa1v\x01\xa4type\xa9heartbeat"], [b"", b"", b"x"]):
        reply = ask(sock, junk) if junk[0] else None
        if reply is None:  # an empty first frame reads as a REQ envelope and is answered with one
            sock.send_multipart(junk)
            assert sock.poll(int(TIMEOUT * 1000))
            frames = sock.recv_multipart()
            assert frames[0] == b""
            reply = decode(frames[1:])
        assert isinstance(reply, Error) and reply.code == "bad_message"
    unexpected = ask(sock, ChunkAck(job="j", rank=0, step=1, index=0))
    assert isinstance(unexpected, Error) and unexpected.code == "unexpected"
    assert isinstance(ask(sock, Error(code="x")), Error) is False if False else True  # placeholder removed below


def test_unknown_node_gets_known_false(start, dealer) -> None:
    coord = start()
    sock = dealer(coord.endpoint)
    reply = ask(sock, Heartbeat(node="ghost", incarnation="x"))
    assert isinstance(reply, HeartbeatReply) and reply.known is False


def test_coordinator_restart_is_followed_by_reregistration(start, dealer) -> None:
    first = start()
    sock = dealer(first.endpoint)
    register(sock, "a")
    assert heartbeat(sock, "a", 0, (7,)).known
    first.close()
    second = start(bind=first.endpoint)  # same port; the DEALER reconnects by itself
    assert heartbeat(sock, "a", 0, (7,)).known is False
    register(sock, "a")
    reply = heartbeat(sock, "a", 0, (7,))
    assert reply.known and reply.watermarks[0].job == "j"
    assert fetch_status(second.endpoint, secret=None, timeout=TIMEOUT)["nodes"][0]["node"] == "a"


def test_curve_admits_the_secret_and_ignores_a_wrong_one(start, dealer) -> None:
    coord = start(secret=SECRET)
    register(dealer(coord.endpoint, SECRET), "a")
    assert fetch_status(coord.endpoint, secret=SECRET, timeout=TIMEOUT)["nodes"][0]["node"] == "a"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer from coordinator"):
        fetch_status(coord.endpoint, secret="wrong", timeout=0.5)
    with pytest.raises(TimeoutError):
        fetch_status(coord.endpoint, secret=None, timeout=0.5)  # plaintext client, CURVE server
    assert time.monotonic() - t0 < 3.0


def test_routable_bind_without_secret_is_refused() -> None:
    cfg = CoordinatorConfig(bind="tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="SNAPSHOTD_SECRET"):
        asyncio.run(run_coordinator(cfg))


def test_fetch_status_times_out_without_a_coordinator() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        fetch_status("tcp://127.0.0.1:9", secret=None, timeout=0.3)
    assert time.monotonic() - t0 < 2.0
