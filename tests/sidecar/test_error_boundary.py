"""Every request handler of the sidecar is an error boundary: one failing request is answered, the rest served.

The sidecar is a real one, run in this process (so that a handler's dependency can be made to fail), with a real
coordinator process and real ZeroMQ sockets: a raw DEALER on its ipc endpoint plays a training rank.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from snapshotd.harness.cluster import LocalCluster
from snapshotd.proto import (
    Error,
    ErrorCode,
    Message,
    PullManifest,
    RankRegistered,
    RegisterRank,
    decode,
    encode,
)
from snapshotd.proto.limits import MAX_TEXT_LEN
from snapshotd.shm import SHM_DIR
from snapshotd.sidecar import ingest
from snapshotd.sidecar.config import SidecarConfig
from snapshotd.sidecar.daemon import Sidecar
from snapshotd.sidecar.node import Counters
from snapshotd.sidecar.outbox import Outbox
from snapshotd.sidecar.tasks import ServiceDied
from snapshotd.status import fetch_status

from ..deployments import InProcess, in_process_sidecar
from ..waits import wait_until

pytestmark = pytest.mark.timeout(60)


class _Peer:
    """A raw DEALER on one endpoint; every receive has a deadline."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)

    def __enter__(self) -> _Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close(linger=0)

    def request(self, msg: Message, timeout: float = 10.0) -> Message:
        self.sock.send_multipart(encode(msg))
        assert self.sock.poll(int(timeout * 1000)), f"no answer to {msg.TYPE}"
        return decode(self.sock.recv_multipart())


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_failing_request_is_answered_and_the_sidecar_keeps_serving(
    tmp_path, ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = uuid.uuid4().hex[:8]
    job = f"boundary-{tag}"
    real_create = ingest.create_arena
    calls: list[int] = []

    def create_arena(*args, **kwargs):  # the first arena cannot be made: /dev/shm full, say
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return real_create(*args, **kwargs)

    monkeypatch.setattr(ingest, "create_arena", create_arena)
    with LocalCluster(str(tmp_path)) as cluster:
        cluster.start_coordinator()
        cfg = SidecarConfig(
            coordinator=cluster.coordinator_addr, node=f"a-{tag}", ipc=str(tmp_path / "a.ipc"), nice=0
        )
        with (
            in_process_sidecar(cfg) as (sidecar, data_addr, ipc),
            _Peer(ctx, f"ipc://{ipc}") as rank,
            _Peer(ctx, data_addr) as peer,
        ):
            register = RegisterRank(job=job, rank=0, world_size=1, pid=os.getpid(), data_bytes=4096, slots=2)
            refused = rank.request(register)
            assert isinstance(refused, Error), refused
            assert (
                refused.code == "internal" and "OSError" in refused.message and "injected" in refused.message
            )
            assert (refused.job, refused.rank) == (job, 0)
            assert sidecar.state.counters.errors == 1

            accepted = rank.request(register)  # the same request again: served
            assert isinstance(accepted, RankRegistered), accepted
            missing = peer.request(PullManifest(job=job, rank=0, step=3))  # the data plane answers as ever
            assert isinstance(missing, Error) and missing.code == "not_found", missing
    assert not [n for n in os.listdir(SHM_DIR) if tag in n], "the sidecar's arena outlived it"


def test_an_error_reply_longer_than_the_protocol_carries_is_cut_not_dropped() -> None:
    """An error text built from long parts (a peer's reason quoted in ours) broke the text limit at encoding,
    and the reply was dropped: the asker waited for its timeout."""
    outbox = Outbox(Counters(), timeout=1.0)
    outbox.reply(b"peer", Error(job="j", code=ErrorCode.PLAN_TIMEOUT, message="no plan: " + "why " * 5000))
    (queued,) = outbox._queues[b"peer"]
    assert (
        isinstance(queued, Error) and len(queued.message) == MAX_TEXT_LEN and queued.message.endswith("...")
    )
    assert decode(encode(queued)) == queued


def test_a_service_that_fails_stops_the_sidecar_and_the_coordinator_declares_its_node_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ipc endpoint's loop breaks (not one request: the loop itself): the sidecar must not go on heartbeating
    while deaf to its ranks. It stops with ServiceDied, and its node is declared dead."""
    die = threading.Event()
    serve = Sidecar._serve

    async def breaking(self: Sidecar, pipe: Any, outbox: Any, handle: Any, what: str) -> None:
        if what != "ipc":
            return await serve(self, pipe, outbox, handle, what)
        loop = asyncio.ensure_future(serve(self, pipe, outbox, handle, what))
        try:
            while not die.is_set():
                await asyncio.sleep(0.01)
        finally:
            loop.cancel()
        raise OSError("the ipc socket broke")

    monkeypatch.setattr(Sidecar, "_serve", breaking)
    with InProcess() as dep:
        node = f"A-{dep.tag}"
        cfg = SidecarConfig(
            coordinator=dep.coordinator,
            node=node,
            ipc=f"mem://{node}-ipc",
            data_bind=f"mem://{node}-data",
            nice=0,
        )
        with pytest.raises(RuntimeError, match=f"sidecar-{node} failed") as failed, in_process_sidecar(cfg):
            wait_until(lambda: _node_alive(dep.coordinator, node), "the sidecar to register")
            die.set()
            dep.wait_dead("A")
        cause = failed.value.__cause__
        assert isinstance(
            cause, ServiceDied
        ) and "the ipc endpoint failed: OSError: the ipc socket broke" in str(cause)


def _node_alive(coordinator: str, node: str) -> bool:
    nodes = fetch_status(coordinator, secret=None, timeout=2.0)["nodes"]
    return any(n["node"] == node and n["alive"] for n in nodes)
