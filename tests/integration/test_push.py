"""Streams pushed over the buddy's bulk port, end to end: real sidecars in this process on loopback TCP."""

from __future__ import annotations

import uuid

import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.sidecar.integrity import Seal

from ..deployments import InProcess
from ..waits import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLOATS = 300_000  # 1.2 MB: 19 chunks of 64 KiB


def _state(step: int) -> dict:
    return {"w": torch.randn(FLOATS, generator=torch.Generator().manual_seed(step)), "loop": {"step": step}}


@pytest.mark.parametrize("connections", [0, 1, 3])
def test_a_stream_pushed_or_sent_as_messages_makes_the_same_copy(connections: int) -> None:
    job = f"push-{uuid.uuid4().hex[:6]}"
    with InProcess(tcp=True, chunk_bytes=64 << 10, push_connections=connections) as dep:
        ipc = dep.start_sidecar("A")
        dep.start_sidecar("B")
        state = _state(1)
        with Snapshotter(state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block") as snap:
            assert snap.restore(timeout=30) == 0
            for step in (1, 2, 3):
                state["w"].copy_(_state(step)["w"])
                assert snap.capture(step) and snap.wait(30), snap.stats
            b = dep.sidecars["B"].state
            held = b.store.get(job, 0, 3)
            assert held.data.tobytes() == state["w"].numpy().tobytes()
            lr = dep.sidecars["A"].state.rank(job, 0)
            assert lr is not None and (index := lr.find(3)) is not None
            sent = lr.slots[index].seal
            assert sent is not None and held.seal.sums == sent.sums and held.seal.digest == sent.digest
            assert b.counters.pushes_in == (3 if connections else 0)


def test_a_chunk_the_buddy_finds_corrupt_fails_that_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's lane carries a checksum that its bytes do not match (as bytes changed after the seal was
    taken): the buddy refuses the chunk, the step is not durable there, and the next step streams whole."""
    job = f"push-{uuid.uuid4().hex[:6]}"
    block_sum = Seal.block_sum

    def spoil_one(seal: Seal, index: int, view: memoryview) -> int:
        value = block_sum(seal, index, view)
        return value ^ 1 if index == 5 else value

    with InProcess(tcp=True, chunk_bytes=64 << 10) as dep:
        ipc = dep.start_sidecar("A")
        dep.start_sidecar("B")
        state = _state(1)
        with Snapshotter(state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block") as snap:
            assert snap.restore(timeout=30) == 0
            assert snap.capture(1) and snap.wait(30)
            monkeypatch.setattr(Seal, "block_sum", spoil_one)
            state["w"].add_(1.0)
            assert snap.capture(2)
            assert not snap.wait(30)  # step 2 did not reach its buddy
            assert snap.stats.failed == 1 and "chunk 5" in snap.stats.last_error and "xxh3" in snap.stats.last_error
            b = dep.sidecars["B"].state.store
            wait_until(lambda: not b.holds(job, 0, 2), "the sender's abort to reach the buddy")
            monkeypatch.setattr(Seal, "block_sum", block_sum)
            state["w"].add_(1.0)
            assert snap.capture(3) and snap.wait(30)
            assert b.get(job, 0, 3).data.tobytes() == state["w"].numpy().tobytes()
