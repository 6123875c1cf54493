"""A real coordinator (its own uvloop in a thread) on tcp://127.0.0.1:0, talked to with real DEALER sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from unittest import mock

import msgpack
import pytest
import uvloop
import zmq

from snapshotd.coordinator import CoordinatorConfig, run_coordinator
from snapshotd.proto import (
    ChunkAck,
    Drain,
    DrainReply,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    InventoryItem,
    Message,
    PlanReply,
    PlanRequest,
    RankInfo,
    RegisterSidecar,
    SeatReply,
    SeatRequest,
    SidecarRegistered,
    StatusReply,
    StatusRequest,
    decode,
    encode,
)
from snapshotd.security import secure_client
from snapshotd.status import fetch_status, render_status, status_main

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
        self.started = time.monotonic()
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


def heartbeat(
    sock: zmq.Socket, node: str, rank: int, steps: tuple[int, ...], inc: str = "i1"
) -> HeartbeatReply:
    msg = Heartbeat(
        node=node,
        incarnation=inc,
        ranks=(RankInfo(job="j", rank=rank, world_size=2, pid=1, alive=True),),
        inventory=tuple(InventoryItem(job="j", rank=rank, step=s, local=True) for s in steps),
    )
    reply = ask(sock, msg)
    assert isinstance(reply, HeartbeatReply)
    return reply


def beat_until(
    sidecars: dict[str, tuple[zmq.Socket, int, tuple[int, ...]]], done, limit: float = TIMEOUT
) -> float:
    """Heartbeat every sidecar every 0.05 s (as they would) until ``done()``; the seconds it took."""
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < limit, "timed out"
        for node, (sock, rank, steps) in sidecars.items():
            assert heartbeat(sock, node, rank, steps).known
        time.sleep(0.05)
    return time.monotonic() - t0


def test_register_heartbeat_plan_and_status(start, dealer) -> None:
    coord = start()
    a, b = dealer(coord.endpoint), dealer(coord.endpoint)
    register(a, "a")
    register(b, "b")
    heartbeat(a, "a", 0, (3, 4))
    reply = heartbeat(b, "b", 1, (4,))
    assert reply.known and reply.assignments[0].buddies == ("tcp://a:1",)
    assert (reply.watermarks[0].recoverable, reply.watermarks[0].durable) == (4, -1)
    assert reply.heartbeat_interval == 0.0  # two nodes are far below the target rate: keep the interval
    sidecars = {"a": (a, 0, (3, 4)), "b": (b, 1, (4,))}
    plan_a, plan_b = dealer(coord.endpoint), dealer(coord.endpoint)
    # in the rebuild window
    plan_a.send_multipart(encode(PlanRequest(job="j", rank=0, world_size=2, node="a")))
    beat_until(sidecars, lambda: time.monotonic() - coord.started > 0.7)  # window over: rank 0 recorded, held
    assert not plan_a.poll(0), "a waiting request is held, not answered"
    asked = time.monotonic()
    plan_b.send_multipart(encode(PlanRequest(job="j", rank=1, world_size=2, node="b")))  # the last rank asks
    beat_until(sidecars, lambda: plan_a.poll(0) and plan_b.poll(0))
    took = time.monotonic() - asked  # the replies may be in before beat_until starts: time from the ask
    assert took < 1.0  # rank 0 is answered when the round is decided, not when its hold (3 s) ends
    reply_a, reply_b = decode(plan_a.recv_multipart()), decode(plan_b.recv_multipart())
    assert isinstance(reply_a, PlanReply) and isinstance(reply_b, PlanReply)
    assert (reply_a.status, reply_a.step, reply_a.local) == ("ready", 4, True)
    assert (reply_b.status, reply_b.step, reply_b.local) == ("ready", 4, True)
    assert heartbeat(a, "a", 0, (4, 5)).watermarks[0].recoverable == 4  # the reply is re-encoded on change
    assert heartbeat(b, "b", 1, (4, 5)).watermarks[0].recoverable == 5
    doc = fetch_status(coord.endpoint, secret=None, timeout=TIMEOUT)
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]
    assert doc["jobs"][0]["recoverable"] == 5 and doc["coordinator"]["heartbeats"] >= 4
    assert doc["coordinator"]["heartbeat_interval"] == 0.1
    rendered = render_status(doc)
    assert "recoverable step G = 5" in rendered
    rnd = doc["jobs"][0]["round"]  # rank 0 was held, then answered with rank 1: in the same loop pass
    assert (rnd["outcome"], rnd["step"], rnd["asked"], rnd["answered"]) == ("ready", 4, 2, 2)
    assert 0 <= rnd["answer_s"] < took and rnd["age_s"] >= rnd["answer_s"]
    assert "last plan round: ready at step 4" in rendered and "2 of 2 ranks answered, the last" in rendered


def test_a_status_document_is_built_between_other_requests(start, dealer, monkeypatch) -> None:
    """Built one part per loop pass, a large document never holds up the heartbeats queued behind it."""
    monkeypatch.setattr("snapshotd.coordinator.status.STATUS_PART_ENTRIES", 1)
    monkeypatch.setattr("snapshotd.coordinator.loop._STATUS_SLICE_S", 0.0)
    coord = start(heartbeat_timeout=30.0)  # node a must not die of the seconds a loaded machine may take here
    sock = dealer(coord.endpoint)
    register(sock, "a")
    world = 20_000  # a part per rank (all on node a): thousands of passes of the loop, far longer than this thread's turn takes
    reported = ask(
        sock,
        Heartbeat(
            node="a",
            incarnation="i1",
            ranks=tuple(RankInfo(job="j", rank=r, world_size=world, pid=1, alive=True) for r in range(world)),
        ),
    )
    assert isinstance(reported, HeartbeatReply) and reported.known, reported
    sock.send_multipart(encode(StatusRequest()))
    first = ask(sock, Heartbeat(node="a", incarnation="i1", changed=False))
    assert isinstance(first, HeartbeatReply) and first.known  # answered while the document was being built
    assert sock.poll(int(TIMEOUT * 1000)), "no status reply"
    reply = decode(sock.recv_multipart())
    assert isinstance(reply, StatusReply)
    assert len(msgpack.unpackb(reply.body)["jobs"][0]["ranks"]) == world
    for _ in range(5):  # four are built at once; the fifth is refused by name
        sock.send_multipart(encode(StatusRequest()))
    replies = []
    for _ in range(5):
        assert sock.poll(int(TIMEOUT * 1000)), "a status request went unanswered"
        replies.append(decode(sock.recv_multipart()))
    busy = [r for r in replies if isinstance(r, Error)]
    assert len(busy) == 1 and busy[0].code == "busy" and "status documents are being built" in busy[0].message
    assert all(
        msgpack.unpackb(r.body)["nodes"][0]["node"] == "a" for r in replies if isinstance(r, StatusReply)
    )


def test_a_held_plan_request_is_answered_wait_after_the_hold(start, dealer) -> None:
    coord = start(plan_hold=0.3)
    a = dealer(coord.endpoint)
    register(a, "a")
    beat_until({"a": (a, 0, (3,))}, lambda: time.monotonic() - coord.started > 0.6)  # past the rebuild window
    t0 = time.monotonic()
    reply = ask(a, PlanRequest(job="j", rank=0, world_size=2, node="a"))
    assert isinstance(reply, PlanReply) and reply.status == "wait" and "rank(s) 1" in reply.reason
    assert 0.25 <= time.monotonic() - t0 < 2.5


def test_held_plan_requests_are_answered_when_the_coordinator_stops(start, dealer) -> None:
    coord = start(heartbeat_timeout=0.2)
    sock = dealer(coord.endpoint)
    time.sleep(0.3)  # past the rebuild window
    sock.send_multipart(encode(PlanRequest(job="j", rank=0, world_size=2, node="a")))
    assert not sock.poll(300)  # held
    coord.close()
    assert sock.poll(int(TIMEOUT * 1000)), "a held request must be answered at shutdown"
    reply = decode(sock.recv_multipart())
    assert isinstance(reply, PlanReply) and reply.status == "wait"


def _send(sock: zmq.Socket, msg: Message) -> None:
    sock.send_multipart(encode(msg))


def _answer(sock: zmq.Socket, within: float) -> Message | None:
    return decode(sock.recv_multipart()) if sock.poll(int(within * 1000)) else None


def test_a_seat_request_is_held_until_a_seat_comes_free(start, dealer) -> None:
    """Seats 0 and 1 are a's and b's; spare c asks once. It is not answered ``wait`` but held, and answered
    ``given`` as soon as b is declared dead, with no second ask."""
    coord = start(plan_hold=10.0)
    socks = {n: dealer(coord.endpoint) for n in "abc"}
    for n, sock in socks.items():
        register(sock, n)
    ranks = {"a": 0, "b": 1}
    _beat_while(socks, ranks, lambda: time.monotonic() - coord.started > 0.6)  # past the rebuild window
    seat = {"job": "j", "world_size": 2, "per_node": 1, "timeout_s": 30.0}
    assert ask(socks["a"], SeatRequest(node="a", **seat)) == SeatReply(
        job="j", status="given", first=0, granted=mock.ANY
    )
    assert ask(socks["b"], SeatRequest(node="b", **seat)).first == 1  # type: ignore[attr-defined]
    asker = dealer(coord.endpoint)  # c's heartbeats and its seat request on sockets of their own
    _send(asker, SeatRequest(node="c", **seat))
    t0 = time.monotonic()
    _beat_while(socks, ranks, lambda: time.monotonic() - t0 > 0.5)
    assert _answer(asker, 0.0) is None  # held: b still lives
    del socks["b"]  # b goes silent: declared dead after the death timeout (0.5 s)
    _beat_while(socks, ranks, lambda: asker.poll(0) != 0)
    reply = _answer(asker, TIMEOUT)
    assert isinstance(reply, SeatReply) and reply.status == "given" and reply.first == 1
    assert time.monotonic() - t0 < 5.0  # well before the hold's 10 s


def test_a_seat_request_is_held_no_longer_than_its_asker_waits(start, dealer) -> None:
    """An ask that waits 0.6 s (``timeout_s``) is answered ``wait`` before then, though the hold is 10 s."""
    coord = start(plan_hold=10.0)
    socks = {n: dealer(coord.endpoint) for n in "abc"}
    for n, sock in socks.items():
        register(sock, n)
    ranks = {"a": 0, "b": 1}
    _beat_while(socks, ranks, lambda: time.monotonic() - coord.started > 0.6)
    seat = {"job": "j", "world_size": 2, "per_node": 1}
    for n in "ab":
        reply = ask(socks[n], SeatRequest(node=n, timeout_s=30.0, **seat))
        assert reply.status == "given"  # type: ignore[attr-defined]
    asker = dealer(coord.endpoint)
    t0 = time.monotonic()
    _send(asker, SeatRequest(node="c", timeout_s=0.6, **seat))
    _beat_while(socks, ranks, lambda: asker.poll(0) != 0)
    reply = _answer(asker, TIMEOUT)
    assert isinstance(reply, SeatReply) and reply.status == "wait"
    assert time.monotonic() - t0 < 0.6


def test_a_drain_is_held_while_copies_remain_and_answered_with_the_count_when_the_hold_ends(
    start, dealer
) -> None:
    coord = start(plan_hold=0.4)
    socks = {n: dealer(coord.endpoint) for n in "abc"}
    for n, sock in socks.items():
        register(sock, n)
    ranks, steps = {"a": 0, "b": 1}, (3,)
    _beat_while(socks, ranks, lambda: time.monotonic() - coord.started > 0.6, steps)
    # at once
    assert ask(socks["c"], Drain(node="c", incarnation="i1")) == DrainReply(remaining=0, unplaceable=0)
    drainer = dealer(coord.endpoint)
    t0 = time.monotonic()
    _send(drainer, Drain(node="b", incarnation="i1"))  # b holds rank 1's only copy of G: held
    _beat_while(socks, ranks, lambda: drainer.poll(0) != 0, steps)
    reply = _answer(drainer, TIMEOUT)
    assert reply == DrainReply(remaining=1, unplaceable=0) and time.monotonic() - t0 >= 0.35


def _beat_while(
    socks: dict[str, zmq.Socket], ranks: dict[str, int], done, steps: tuple[int, ...] = ()
) -> None:
    """Heartbeat each of ``socks`` every 0.05 s (the nodes in ``ranks`` reporting that rank of job j, of 2, and
    ``steps`` of it) until ``done()``."""
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < TIMEOUT, "timed out"
        for node, sock in socks.items():
            if node in ranks:
                assert heartbeat(sock, node, ranks[node], steps).known
            else:
                assert ask(sock, Heartbeat(node=node, incarnation="i1")).known  # type: ignore[attr-defined]
        time.sleep(0.05)


def test_malformed_and_unexpected_messages_get_errors_and_the_loop_goes_on(
    start, dealer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="snapshotd.coordinator.loop")
    coord = start()
    sock = dealer(coord.endpoint)
    for junk in ([b"\xff\x00garbage"], [b"\x80"], [b"\x82\xa1v\x01\xa4type\xa9heartbeat"], [b"x", b"y"]):
        reply = ask(sock, junk)
        assert isinstance(reply, Error) and reply.code == "bad_message"
    sock.send_multipart([b"", b"junk"])  # a REQ-style envelope is answered with the same envelope
    assert sock.poll(int(TIMEOUT * 1000))
    frames = sock.recv_multipart()
    assert frames[0] == b"" and decode(frames[1:]).code == "bad_message"  # type: ignore[attr-defined]
    nonsense = ask(sock, PlanRequest(job="j", rank=3, world_size=2, node="a"))
    assert isinstance(nonsense, Error) and nonsense.code == "bad_message" and "world size" in nonsense.message
    unexpected = ask(sock, ChunkAck(job="j", rank=0, step=1, index=0))
    assert isinstance(unexpected, Error) and unexpected.code == "unexpected"
    sock.send_multipart(encode(Error(code=ErrorCode.INTERNAL, message="oops")))  # counted, never answered
    assert not sock.poll(200)
    assert isinstance(ask(sock, Heartbeat(node="ghost", incarnation="x")), HeartbeatReply)
    assert fetch_status(coord.endpoint, secret=None, timeout=TIMEOUT)["coordinator"]["bad_messages"] == 8
    complaints = [r.getMessage() for r in caplog.records if r.name == "snapshotd.coordinator.loop"]
    assert len(complaints) == 1 and "bad message from peer" in complaints[0]  # once per peer per minute


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


def test_fetch_status_times_out_without_a_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        fetch_status("tcp://127.0.0.1:9", secret=None, timeout=0.3)
    assert status_main("tcp://127.0.0.1:9", watch=False, as_json=False, secret=None, timeout=0.3) == 1
    assert "no answer from coordinator at tcp://127.0.0.1:9 within 0.3 s" in capsys.readouterr().err
    assert status_main("nonsense", watch=False, as_json=True, secret=None, timeout=0.3) == 1
    assert "cannot reach coordinator" in capsys.readouterr().err
    assert time.monotonic() - t0 < 3.0


def test_status_main_prints_tables_and_json(start, dealer, capsys: pytest.CaptureFixture[str]) -> None:
    coord = start()
    sock = dealer(coord.endpoint)
    register(sock, "a")
    heartbeat(sock, "a", 0, (3,))
    assert status_main(coord.endpoint, watch=False, as_json=False, secret=None) == 0
    text = capsys.readouterr().out
    assert "NODE" in text and "a " in text and "job j: world size 2" in text
    assert status_main(coord.endpoint, watch=False, as_json=True, secret=None) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"][0]["ranks"] == [["j", 0, True]] and doc["jobs"][0]["missing"] == [[1, 1]]


_MAIN = """
import sys, uvloop
from snapshotd.coordinator import CoordinatorConfig, run_coordinator
cfg = CoordinatorConfig(bind="tcp://127.0.0.1:0")
uvloop.run(run_coordinator(cfg, ready=lambda endpoint: print(endpoint, flush=True)))
print("stopped", flush=True)
"""


def test_process_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), proc.stderr.read() if proc.stderr else ""
        assert fetch_status(endpoint, secret=None, timeout=TIMEOUT)["coordinator"]["replicas"] == 1
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert out.strip() == "stopped"


def test_status_watch_refreshes_until_ctrl_c(start, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    coord = start()
    naps: list[float] = []

    def sleep(seconds: float) -> None:  # the user presses Ctrl-C during the second pause
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("snapshotd.status.time.sleep", sleep)
    assert status_main(coord.endpoint, watch=True, as_json=False, secret=None) == 0
    assert naps == [1.0, 1.0] and capsys.readouterr().out.count("coordinator: up") == 2


def test_a_silent_node_is_declared_dead_even_with_a_death_timeout_near_the_idle_wait(start, dealer) -> None:
    """The loop's own idle wait (0.1 s) is not a stall of the coordinator: with a 0.3 s death timeout, whose
    quarter is shorter than that wait, a node that stops heartbeating is still declared dead."""
    coord = start(heartbeat_timeout=0.3, heartbeat_interval=0.1)
    a = dealer(coord.endpoint)
    register(a, "a")
    time.sleep(1.5)  # a says nothing more, nor does anyone else: the coordinator's loop idles all along
    nodes = fetch_status(coord.endpoint, secret=None, timeout=TIMEOUT)["nodes"]
    assert [(n["node"], n["alive"]) for n in nodes] == [("a", False)]
