"""Live hostile input: messages a real sidecar once died of, or that left its node dead to the coordinator.

Each test speaks to a real ``snapshotd serve`` process over its ipc socket, as a misbehaving or malicious
local process would, then shows the sidecar alive and its node alive to the coordinator.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from snapshotd.proto import (
    Error,
    LimitExceeded,
    Message,
    RankRegistered,
    RegisterRank,
    SlotUpdate,
    StreamAccept,
    StreamBegin,
    TensorEntry,
    blob_digest,
    encode,
    encode_table,
)
from snapshotd.proto import limits as L
from snapshotd.status import fetch_status

from .conftest import Cluster, DataPeer

pytestmark = pytest.mark.integration


def _wait(cond: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _node(cluster: Cluster, name: str) -> dict | None:
    status = fetch_status(cluster.coordinator_addr, secret=None, timeout=5)
    return next((n for n in status["nodes"] if n["node"] == cluster.node(name)), None)


def test_a_pid_at_the_top_of_its_range_is_one_the_sidecar_can_check() -> None:
    """A pid the kernel could never give (over ``PID_MAX_LIMIT``) is refused as the message is read: it once got
    through to ``os.kill`` at the next heartbeat, which overflowed and ended the sidecar."""
    with pytest.raises(LimitExceeded):
        encode(RegisterRank(job="j", rank=0, world_size=1, pid=L.MAX_PID + 1, data_bytes=1))
    assert L.MAX_PID >= 4_194_304  # Linux's PID_MAX_LIMIT: every real pid fits


@pytest.mark.timeout(60)
def test_hostile_registrations_leave_the_sidecar_and_its_node_alive(cluster: Cluster) -> None:
    sidecar = cluster.start("A")
    job = cluster.job("hostile")
    with DataPeer(f"ipc://{cluster.ipc('A')}") as ipc:
        # the largest pid the protocol lets through: the sidecar checks it at every heartbeat
        top = ipc.request(RegisterRank(job=job, rank=0, world_size=2, pid=L.MAX_PID, data_bytes=100))
        assert isinstance(top, RankRegistered) and isinstance(ipc.recv(), SlotUpdate)
        # a rank outside its world size: refused at once, so it never reaches a heartbeat (the coordinator
        # would refuse every heartbeat of the node that reported it, and the node would stay dead)
        beyond = ipc.request(RegisterRank(job=job, rank=5, world_size=4, pid=1, data_bytes=100))
        assert isinstance(beyond, Error) and beyond.code == "bad_message", beyond
        assert "rank 5" in beyond.message and "world size 4" in beyond.message, beyond.message
    # the pid was checked (the rank is reported gone: no such process) and the node is alive
    node = _wait(lambda: (n := _node(cluster, "A")) is not None and n["ranks"] == [[job, 0, False]] and n,
                 "the coordinator to hear that rank 0's process is gone")  # fmt: skip
    assert node["alive"]
    assert sidecar.alive(), cluster.tail(sidecar)


@pytest.mark.timeout(60)
def test_an_abandoned_stream_gives_its_memory_back(cluster: Cluster) -> None:
    """A peer that begins a stream as large as the memory limit and never sends a chunk held the reservation
    forever, so every real snapshot was refused; now the stream is aborted after twice the peer timeout."""
    cluster.start("B", "--memory-limit", "1536KiB", "--peer-timeout", "0.5s")
    job = cluster.job("abandoned")
    table = encode_table([TensorEntry("x", "uint8", (1 << 20,), 0, 1 << 20)])

    def offer(step: int) -> Message:
        return StreamBegin(job=job, rank=0, step=step, src_node="X", data_bytes=1 << 20, chunk_bytes=1 << 16,
                           digest=blob_digest(table, b""), table=table, meta=b"")  # fmt: skip

    with DataPeer(cluster.sidecars[cluster.node("B")].fields["data"]) as peer:
        assert isinstance(peer.request(offer(1)), StreamAccept)  # and then silence
        refused = peer.request(offer(2))
        assert isinstance(refused, Error) and refused.code == "memory_limit", refused
        accepted = _wait(lambda: isinstance(reply := peer.request(offer(2)), StreamAccept) and reply,
                         "the abandoned stream's reservation to be given back")  # fmt: skip
        assert accepted.step == 2
