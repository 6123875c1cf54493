"""End-to-end integrity: a bit flipped anywhere between the announce and the load is caught before a restore
loads it.

Each story runs real sidecars and a coordinator in this process over the in-memory transport
(:class:`~tests.deployments.InProcess`), so that a test can flip one bit where a fault would: in a rank's own
shared-memory slot, in a buddy's stored copy, or in a message in flight (:attr:`MemoryNetwork.tamper`). Rank 0
lives on node A, rank 1 on node B; the sidecars cut snapshots into 4 KiB blocks, so a rank's state is many
blocks and a pull stripes several ranges of them across its holders.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import torch

from snapshotd.client import IntegrityError, Snapshotter
from snapshotd.proto import blob_digest, checksum
from snapshotd.sidecar.integrity import CorruptCopy, Seal
from snapshotd.transport import MEMORY
from tests.waits import wait_until

from ..deployments import InProcess, restore_all, snapshot_then_crash

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STEPS = 3
FLOATS = 300_000  # 1.2 MB: 293 blocks of 4 KiB, five pull ranges


def _state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(FLOATS, generator=gen), "loop": {"step": step}}


def _restart(ipcs: dict[int, str], job: str) -> tuple[list[dict], list[Snapshotter]]:
    restored = [{"w": torch.zeros(FLOATS), "loop": {}} for _ in (0, 1)]
    snaps = [
        Snapshotter(restored[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=10) for r in (0, 1)
    ]
    return restored, snaps


def _assert_step(restored: dict, rank: int) -> None:
    assert torch.equal(restored["w"], _state(rank, STEPS)["w"])
    assert restored["loop"] == {"step": STEPS}


def _flip_every_block(dep: InProcess, node: str, job: str, rank: int, step: int) -> int:
    """Flip one bit in each block of ``node``'s stored copy of ``(job, rank, step)``, as bytes gone bad at rest;
    the number of blocks."""
    snap = dep.sidecars[node].state.store.get(job, rank, step)
    for block in range(snap.nchunks):
        buf = snap.data.writable(block)
        buf[block % buf.nbytes] ^= 0x10
    return snap.nchunks


@pytest.fixture
def tamper() -> Iterator[None]:
    """Whatever a test sets as the in-memory network's tamper is removed after it."""
    yield
    MEMORY.tamper = None


def test_seal_checks_blobs_and_blocks_and_takes_missing_sums_once() -> None:
    data = bytearray(range(256)) * 40  # 10,240 B: blocks of 4,096, 4,096 and 2,048
    seal = Seal.announced(4096, b"table", b"meta")
    seal.check(memoryview(data), b"table", b"meta", "the copy")
    assert seal.sums == {i: checksum(memoryview(data)[i * 4096 : (i + 1) * 4096]) for i in range(3)}
    with pytest.raises(CorruptCopy, match="tensor table or meta"):
        seal.check_blobs(b"table", b"meta!", "the copy")
    data[4096 + 7] ^= 1
    with pytest.raises(CorruptCopy, match="the copy: block 1 failed its end-to-end checksum") as info:
        seal.check(memoryview(data), b"table", b"meta", "the copy")
    assert info.value.block == 1
    assert seal.digest == blob_digest(b"table", b"meta") != blob_digest(b"tablem", b"eta")


def test_a_bit_flipped_in_the_ranks_own_shared_memory_is_caught_and_the_step_pulled_from_its_buddy() -> None:
    job = f"shm-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        snapshot_then_crash(ipcs, job, STEPS, _state)
        a = dep.sidecars["A"].state
        lr = a.rank(job, 0)
        assert lr is not None
        index = lr.find(STEPS)
        assert index is not None
        lr.arena.slot(index)[123_457] ^= 0x01  # one bit of rank 0's own copy of the step it will restore

        restored, snaps = _restart(ipcs, job)
        try:
            assert restore_all(snaps, timeout=30) == [STEPS, STEPS]
            assert snaps[0].restored["source"] == "pull", snaps[0].restored  # not the corrupt local copy
            assert snaps[1].restored["source"] == "local"
            for r in (0, 1):
                _assert_step(restored[r], r)
            assert a.counters.corrupt == 1
            assert dep.sidecars["B"].state.counters.corrupt == 0
        finally:
            for s in snaps:
                s.close()


def test_a_bit_flipped_in_a_buddys_stored_copy_is_caught_and_its_chunks_come_from_another_holder() -> None:
    """Rank 0's step has copies on B and C (two replicas); node A dies and rank 0 restarts on D, pulling from B
    and C at once. B's copy has gone bad at rest: B finds it out before sending a byte of it, drops it, and
    rank 0 gets every chunk from C."""
    job = f"buddy-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096, replicas=2) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        dep.start_sidecar("C")
        snapshot_then_crash(ipcs, job, STEPS, _state)
        b = dep.sidecars["B"].state
        assert _flip_every_block(dep, "B", job, 0, STEPS) > 64  # more than one pull range: B is asked for one
        bad = b.store.get(job, 0, STEPS)
        ipcs[0] = dep.replace_node("A", "D")

        restored, snaps = _restart(ipcs, job)
        try:
            assert restore_all(snaps, timeout=30) == [STEPS, STEPS]
            assert snaps[0].restored["source"] == "pull"
            for r in (0, 1):
                _assert_step(restored[r], r)
            assert b.counters.corrupt == 1
            # Dropped: never served or reported again. The coordinator may have re-replicated the step to B
            # since (from C), as a new copy whose every block verifies.
            if STEPS in b.store.steps(job, 0):  # complete copies only (a copy may still be arriving)
                again = b.store.get(job, 0, STEPS)
                assert again is not bad
                good = dep.sidecars["C"].state.store.get(job, 0, STEPS)
                assert bytes(again.data.view(0, again.data_bytes)) == bytes(
                    good.data.view(0, good.data_bytes)
                )
            assert dep.sidecars["C"].state.counters.corrupt == 0
        finally:
            for s in snaps:
                s.close()


def test_when_no_copy_is_good_the_restore_names_rank_step_and_chunk() -> None:
    job = f"none-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        snapshot_then_crash(ipcs, job, STEPS, _state)
        _flip_every_block(dep, "B", job, 0, STEPS)  # rank 0's only copy once A is gone
        ipcs[0] = dep.replace_node("A", "C")

        restored, snaps = _restart(ipcs, job)
        try:
            outcome = restore_all(snaps, timeout=30)
            assert outcome[1] == STEPS
            error = outcome[0]
            assert isinstance(error, IntegrityError), error
            text = str(error)
            assert f"rank 0 step {STEPS}" in text and "chunk 0 " in text and "end-to-end checksum" in text, (
                text
            )
            assert torch.equal(restored[0]["w"], torch.zeros(FLOATS))  # nothing was loaded
            assert dep.sidecars["B"].state.counters.corrupt == 1
        finally:
            for s in snaps:
                s.close()


def test_a_bit_flipped_in_a_streamed_chunk_never_makes_a_copy(tamper: None) -> None:
    """In flight on a stream: the buddy refuses the chunk, the step never becomes complete there (nor durable),
    and the next step streams whole."""
    job = f"stream-{uuid.uuid4().hex[:6]}"
    flipped = threading.Event()

    def flip_one_stream_chunk(address: str, to_server: bool, frames: list) -> list:
        header = msgpack.unpackb(bytes(frames[0]))
        if to_server and header.get("type") == "chunk" and header.get("job") == job and not flipped.is_set():
            flipped.set()
            payload = bytearray(frames[1])
            payload[len(payload) // 2] ^= 0x04
            return [frames[0], bytes(payload)]
        return frames

    with InProcess(chunk_bytes=4096) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        state = _state(0, 1)
        with Snapshotter(
            state, job=job, rank=0, world_size=1, sidecar=ipcs[0], timeout=10, when_busy="block"
        ) as snap:
            assert snap.restore(timeout=30) == 0
            MEMORY.tamper = flip_one_stream_chunk
            assert snap.capture(1)
            assert not snap.wait(30) and flipped.is_set()  # step 1 did not reach its buddy
            assert snap.stats.failed == 1 and "xxh3" in snap.stats.last_error, snap.stats
            b = dep.sidecars["B"].state.store  # the sender's abort of the stream reaches B on B's own thread
            wait_until(lambda: not b.holds(job, 0, 1), "B to drop the aborted step 1")
            state["w"].add_(1.0)
            assert snap.capture(2) and snap.wait(30)
            held = dep.sidecars["B"].state.store.get(job, 0, 2)
            assert held.data.tobytes() == state["w"].numpy().tobytes()
            lr = dep.sidecars["A"].state.rank(job, 0)
            assert lr is not None
            index = lr.find(2)
            assert index is not None
            sent = lr.slots[index].seal
            assert sent is not None and held.seal.sums == sent.sums and len(sent.sums) == held.nchunks
            assert held.seal.digest == sent.digest


def test_a_bit_flipped_in_a_pulled_chunk_is_caught_and_the_chunk_taken_from_another_holder(
    tamper: None,
) -> None:
    job = f"pull-{uuid.uuid4().hex[:6]}"
    flipped: list[str] = []

    def flip_first_pulled_chunk(address: str, to_server: bool, frames: list) -> list:
        header = msgpack.unpackb(bytes(frames[0]))
        if not to_server and header.get("type") == "chunk" and header.get("job") == job and not flipped:
            flipped.append(address)
            payload = bytearray(frames[1])
            payload[0] ^= 0x80
            return [frames[0], bytes(payload)]
        return frames

    with InProcess(chunk_bytes=4096, replicas=2) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        dep.start_sidecar("C")
        snapshot_then_crash(ipcs, job, STEPS, _state)
        ipcs[0] = dep.replace_node("A", "D")
        MEMORY.tamper = flip_first_pulled_chunk
        restored, snaps = _restart(ipcs, job)
        try:
            assert restore_all(snaps, timeout=30) == [STEPS, STEPS]
            assert flipped  # a holder's chunk was changed on its way
            for r in (0, 1):
                _assert_step(restored[r], r)
            # the holder's copy was good: it is kept (only a holder that finds its own copy bad drops it)
            assert all(dep.sidecars[n].state.store.holds(job, 0, STEPS) for n in ("B", "C"))
        finally:
            for s in snaps:
                s.close()


def test_a_stream_whose_blobs_fail_their_digest_is_refused() -> None:
    with InProcess(chunk_bytes=4096) as dep:
        dep.start_sidecar("A")
        store = dep.sidecars["A"].state.store
        with pytest.raises(ValueError, match="fail their digest"):
            store.begin(
                "j",
                0,
                1,
                src_node="X",
                data_bytes=10,
                chunk_bytes=4096,
                table=b"t",
                meta=b"m",
                digest=blob_digest(b"t", b"m") ^ 1,
            )
        assert not store.holds("j", 0, 1)


def test_a_ranks_only_copy_found_corrupt_in_its_shared_memory_is_an_integrity_error() -> None:
    """A one-node job: the rank's own slot is its only copy; a flipped bit there is IntegrityError, not a
    failed pull, and nothing is loaded."""
    job = f"only-{uuid.uuid4().hex[:6]}"
    with InProcess(chunk_bytes=4096) as dep:
        ipc = dep.start_sidecar("A")
        state = _state(0, 1)
        snap = Snapshotter(state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block")
        assert snap.restore(timeout=30) == 0
        assert snap.capture(1)
        snap.wait(30)  # no buddy on a one-node job: the step stays in the rank's own slot only
        snap.close(unregister=False)
        lr = dep.sidecars["A"].state.rank(job, 0)
        assert lr is not None and (index := lr.find(1)) is not None
        lr.arena.slot(index)[4096 * 3 + 5] ^= 0x02
        restored = {"w": torch.zeros(FLOATS), "loop": {}}
        with (
            Snapshotter(restored, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10) as again,
            pytest.raises(IntegrityError, match="own copy failed its end-to-end checksum"),
        ):
            again.restore(timeout=30)
        assert torch.equal(restored["w"], torch.zeros(FLOATS))
