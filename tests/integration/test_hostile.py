"""Live hostile input: messages a real sidecar once died of, or that left its node dead to the coordinator.

Each test speaks to a real ``snapshotd serve`` process over its ipc socket, as a misbehaving or malicious
local process would, then shows the sidecar alive and its node alive to the coordinator.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.proto import (
    Error,
    LimitExceeded,
    Message,
    RankRegistered,
    RegisterRank,
    RestoreFetched,
    RestoreReply,
    RestoreRequest,
    SlotUpdate,
    StreamAccept,
    StreamBegin,
    TensorEntry,
    UnregisterRank,
    blob_digest,
    decode,
    encode,
    encode_table,
)
from snapshotd.proto import limits as L
from snapshotd.shm import SHM_DIR
from snapshotd.status import fetch_status
from snapshotd.transport import MEMORY, ThreadPipe, connect_rank
from tests.waits import wait_until

from ..deployments import InProcess
from .conftest import Cluster, DataPeer

pytestmark = pytest.mark.integration


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
    node = wait_until(
        lambda: (n := _node(cluster, "A")) is not None and n["ranks"] == [[job, 0, False]] and n,
        "the coordinator to hear that rank 0's process is gone",
        20.0,
    )
    assert node["alive"]
    assert sidecar.alive(), cluster.tail(sidecar)


@pytest.mark.timeout(60)
def test_a_fetch_answer_no_restore_waits_for_is_dropped_without_a_reply(cluster: Cluster) -> None:
    """An answer to a fetch the sidecar never asked (or gave up on) gets no Error: one would reach whatever
    request the rank waits on next."""
    sidecar = cluster.start("A")
    job = cluster.job("stale-fetch")
    with DataPeer(f"ipc://{cluster.ipc('A')}") as ipc:
        assert isinstance(
            ipc.request(RegisterRank(job=job, rank=0, world_size=2, pid=os.getpid(), data_bytes=100)),
            RankRegistered,
        )
        assert isinstance(ipc.recv(), SlotUpdate)
        ipc.send(RestoreFetched(job=job, rank=0, step=3, fetch=12345, ok=True, sums=bytes(8)))
        # replies come in order: an Error about the answer would come before this registration's reply
        again = ipc.request(RegisterRank(job=job, rank=1, world_size=2, pid=os.getpid(), data_bytes=100))
        assert isinstance(again, RankRegistered), again
    wait_until(
        lambda: "answered a fetch of step 3 that no restore waits for" in cluster.tail(sidecar, 100),
        "the sidecar to log the dropped answer",
        20.0,
    )
    assert sidecar.alive()


@pytest.mark.timeout(60)
def test_an_abandoned_stream_gives_its_memory_back(cluster: Cluster) -> None:
    """A peer that begins a stream as large as the memory limit and never sends a chunk held the reservation
    forever, so every real snapshot was refused; after twice the peer timeout it gives the reservation up to a
    new stream."""
    cluster.start("B", "--memory-limit", "1536KiB", "--peer-timeout", "0.5s")
    job = cluster.job("abandoned")
    table = encode_table([TensorEntry("x", "uint8", (1 << 20,), 0, 1 << 20)])

    def offer(step: int) -> Message:
        return StreamBegin(
            job=job,
            rank=0,
            step=step,
            src_node="X",
            data_bytes=1 << 20,
            chunk_bytes=1 << 16,
            digest=blob_digest(table, b""),
            table=table,
            meta=b"",
        )

    with DataPeer(cluster.sidecars[cluster.node("B")].fields["data"]) as peer:
        assert isinstance(peer.request(offer(1)), StreamAccept)  # and then silence
        refused = peer.request(offer(2))
        assert isinstance(refused, Error) and refused.code == "memory_limit", refused
        accepted = wait_until(
            lambda: isinstance(reply := peer.request(offer(2)), StreamAccept) and reply,
            "the abandoned stream's reservation to be given back",
            20.0,
        )
        assert accepted.step == 2


@pytest.mark.timeout(60)
def test_a_rank_that_unregisters_while_its_restore_pulls_gets_an_answer_and_leaves_nothing(
    tamper: None,
) -> None:
    """Node A died; rank 0 restarts on node C with a smaller state than its snapshot, and unregisters just as its
    restore begins to pull from B. The restore went on into the removed arena's place: a new, larger arena that
    nothing owned, left in /dev/shm."""
    job = f"gone-{uuid.uuid4().hex[:6]}"
    with InProcess() as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        states = [{"w": torch.full((10_000,), float(r))} for r in (0, 1)]
        snaps = [
            Snapshotter(states[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=10) for r in (0, 1)
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda s: s.restore(timeout=30), snaps)) == [0, 0]
        for s in snaps:
            assert s.capture(1) and s.wait(30)
            s.close(unregister=False)
        pipe = connect_rank(dep.replace_node("A", "C"))
        c = dep.sidecars["C"].state

        def unregister_at_the_manifest(address: str, to_server: bool, frames: list) -> list:
            header = msgpack.unpackb(bytes(frames[0]))
            if not to_server and header.get("type") == "stream_begin" and header.get("job") == job:
                pipe.send_nowait(encode(UnregisterRank(job=job, rank=0)))
                wait_until(lambda: c.rank(job, 0) is None, "C to drop rank 0", 20.0)
            return frames

        try:
            pipe.send_nowait(
                encode(RegisterRank(job=job, rank=0, world_size=2, pid=os.getpid(), data_bytes=16))
            )
            assert isinstance(_next(pipe), RankRegistered)
            MEMORY.tamper = unregister_at_the_manifest
            pipe.send_nowait(encode(RestoreRequest(job=job, rank=0, world_size=2, timeout_s=30)))
            assert _restore_rank1(job, ipcs[1], 10_000) == 1
            reply = _next(pipe, skip=SlotUpdate)
            assert isinstance(reply, Error) and reply.code == "not_registered", reply
            assert "unregistered while its restore was pending" in reply.message
            assert not [n for n in os.listdir(SHM_DIR) if job in n and "-r0-" in n]  # no arena of rank 0 left
        finally:
            pipe.close()


@pytest.mark.timeout(60)
def test_a_rank_that_registers_again_while_its_restore_waits_abandons_that_restore(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 0's process asks for its restore, the plan waiting for rank 1; a new process of rank 0 registers (its
    restart) and asks again. The first restore went on: once the plan came it answered the process that had gone,
    and wrote into the new process at the old one's tensor addresses (a pull, ``targets``). Now the registration
    abandons it unanswered, and only the new process's request is answered."""
    caplog.set_level(logging.INFO, logger="snapshotd.sidecar.restore")
    job = f"again-{uuid.uuid4().hex[:6]}"
    with InProcess() as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        gone, restarted = connect_rank(ipcs[0]), connect_rank(ipcs[0])
        try:
            for pipe, pid in ((gone, os.getpid() + 1), (restarted, os.getpid())):
                pipe.send_nowait(encode(RegisterRank(job=job, rank=0, world_size=2, pid=pid, data_bytes=16)))
                assert isinstance(_next(pipe, skip=SlotUpdate), RankRegistered)
                pipe.send_nowait(encode(RestoreRequest(job=job, rank=0, world_size=2, timeout_s=30)))
            wait_until(
                lambda: "its pending restore is abandoned" in caplog.text, "the first restore abandoned", 20.0
            )
            assert _restore_rank1(job, ipcs[1], 4) == 0  # the plan comes once every rank asked
            reply = _next(restarted, skip=SlotUpdate)
            assert isinstance(reply, RestoreReply) and reply.source == "fresh", reply
            # a second answer would come at once
            with pytest.raises(AssertionError, match="no reply in time"):
                _next(gone, skip=SlotUpdate, timeout=1.0)
        finally:
            gone.close()
            restarted.close()


def _restore_rank1(job: str, ipc: str, floats: int) -> int:
    """Rank 1 of ``job`` (of 2) restores through the sidecar at ``ipc``, a state of ``floats`` floats; its step."""
    rank1 = Snapshotter({"w": torch.zeros(floats)}, job=job, rank=1, world_size=2, sidecar=ipc, timeout=10)
    try:
        return rank1.restore(timeout=30)
    finally:
        rank1.close()


@pytest.fixture
def tamper() -> Iterator[None]:
    """Whatever a test sets as the in-memory network's tamper is removed after it."""
    yield
    MEMORY.tamper = None


def _next(pipe: ThreadPipe, skip: type[Message] | None = None, timeout: float = 30.0) -> Message:
    """The next message on ``pipe`` (other than ``skip``'s type) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert pipe.wait(max(0.0, deadline - time.monotonic())), "no reply in time"
        frames = pipe.recv_nowait()
        if frames is None:
            continue
        msg = decode(frames)
        if skip is None or not isinstance(msg, skip):
            return msg


@pytest.mark.timeout(60)
def test_an_arena_larger_than_shared_memory_is_refused_by_name() -> None:
    """A registration for a terabyte per slot made a sparse arena the file system could never hold (the ipc
    fuzz left the sidecar mapping 127 TB): a process writing into it would die of SIGBUS."""
    job = f"room-{uuid.uuid4().hex[:6]}"
    with InProcess() as dep:
        pipe = connect_rank(dep.start_sidecar("A"))
        try:
            pipe.send_nowait(
                encode(RegisterRank(job=job, rank=0, world_size=1, pid=os.getpid(), data_bytes=1 << 40))
            )
            refused = _next(pipe)
            assert isinstance(refused, Error) and refused.code == "memory_limit", refused
            assert SHM_DIR in refused.message and "needs an arena of" in refused.message, refused.message
            assert not [n for n in os.listdir(SHM_DIR) if job in n]
            pipe.send_nowait(
                encode(RegisterRank(job=job, rank=0, world_size=1, pid=os.getpid(), data_bytes=4096))
            )
            assert isinstance(_next(pipe), RankRegistered)  # and a real one fits
            pipe.send_nowait(encode(UnregisterRank(job=job, rank=0)))
        finally:
            pipe.close()


@pytest.fixture
def small_shm(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A shared-memory file system of 8 MiB of its own (a tmpfs mounted for the test; root only), used for the
    arenas of the sidecars this test starts."""
    mount = tmp_path / "shm"
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=8m snapshotd-test {mount} 2>/dev/null") != 0:
        pytest.skip("mounting a tmpfs needs root")
    monkeypatch.setattr("snapshotd.shm.SHM_DIR", str(mount))
    monkeypatch.setattr("snapshotd.sidecar.ingest.SHM_DIR", str(mount))
    try:
        yield str(mount)
    finally:
        os.system(f"umount -l {mount}")  # lazily: a mapping the test left closing must not keep it mounted


@pytest.mark.timeout(60)
def test_an_arena_that_a_full_shared_memory_could_not_back_is_refused_and_what_is_held_stays(
    small_shm: str,
) -> None:
    """/dev/shm filling up (another job's files) left a registration a sparse arena that the rank would die of
    SIGBUS writing into; it is refused by name, and the arena already there keeps its snapshots."""
    job = f"full-{uuid.uuid4().hex[:6]}"
    with InProcess() as dep:
        ipc = dep.start_sidecar("A")
        state = {"w": torch.arange(250_000, dtype=torch.float32)}  # 1 MB
        snap = Snapshotter(state, job=job, rank=0, world_size=2, sidecar=ipc, timeout=10)
        pipe = connect_rank(ipc)
        try:
            assert snap.capture(1)  # rank 0's arena: 3 slots of 1 MB, one filled
            # its copy and announce run in the background
            wait_until(
                lambda: (
                    (held := dep.sidecars["A"].state.rank(job, 0)) is not None and held.find(1) is not None
                ),
                "the sidecar holding step 1",
                20.0,
            )
            with open(os.path.join(small_shm, "someone-elses"), "wb") as f:
                # 4 MiB of the 8 taken: 2 MB of rank 0's arena and 2 MiB left unbacked
                f.write(b"\1" * (4 << 20))
            pipe.send_nowait(
                encode(RegisterRank(job=job, rank=1, world_size=2, pid=os.getpid(), data_bytes=1 << 20))
            )
            refused = _next(pipe)
            assert isinstance(refused, Error) and refused.code == "memory_limit", refused
            assert "free" in refused.message and small_shm in refused.message, refused.message
            lr = dep.sidecars["A"].state.rank(job, 0)
            assert lr is not None and lr.find(1) is not None  # what was held stays
            os.unlink(os.path.join(small_shm, "someone-elses"))
            pipe.send_nowait(
                encode(RegisterRank(job=job, rank=1, world_size=2, pid=os.getpid(), data_bytes=1 << 20))
            )
            assert isinstance(_next(pipe, skip=SlotUpdate), RankRegistered)  # with room again, it fits
        finally:
            pipe.close()
            snap.close()
