"""The export's assembly of a checkpoint from ranks' snapshots, and its retry when a step is collected meanwhile.

Snapshots are built by hand here (tables, meta and data as the client writes them), so that DTensor shards need
no process group; ``tests/integration/test_export.py`` runs the whole export against real sidecars and ranks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import torch

from snapshotd.client.copies import copy_into
from snapshotd.client.state import flatten
from snapshotd.export import ExportError
from snapshotd.export.assembly import Assembly, Snapshot
from snapshotd.export.gather import attempts
from snapshotd.proto import TensorEntry
from snapshotd.sidecar.pull import PullFailed
from snapshotd.snapshot_format import ELIDED, PLAIN, STATEFUL


def _snapshot(rank: int, values: dict[str, Any]) -> Snapshot:
    flat = flatten(values)
    data = torch.zeros(max(flat.data_bytes, 1), dtype=torch.uint8)
    copy_into(flat, data)
    return Snapshot(rank, flat.entries, flat.meta, data)


def _sharded(rank: int, shard: torch.Tensor, place: Any, version: int = 2) -> Snapshot:
    """A snapshot whose value ``w`` is a DTensor shard of a 1-D global tensor, at ``place`` ([shape, offset])."""
    data = torch.zeros(64, dtype=torch.uint8)
    data[: shard.numel() * 4] = shard.view(torch.uint8)
    ext = (0).to_bytes(4, "big") + (msgpack.packb(place) if version == 2 else b"")
    meta = msgpack.packb([version, {"w": [PLAIN, msgpack.ExtType(2, ext)]}])
    return Snapshot(rank, [TensorEntry("w", "float32", tuple(shard.shape), 0, shard.numel() * 4)], meta, data)


def test_dtensor_shards_make_the_global_tensor() -> None:
    full = torch.arange(10.0)
    shards = [(0, 3), (3, 3), (6, 3), (9, 1)]  # torch.chunk of 10 over 4 ranks
    a = Assembly("j", 5)
    a.first(_sharded(0, full[0:3], [[10], [0]]))
    assert a.sharded()
    for rank, (offset, n) in enumerate(shards[1:3], start=1):
        a.add(_sharded(rank, full[offset : offset + n], [[10], [offset]]))
    with pytest.raises(ExportError, match=r"state\['w'\] cover 9 of its 10 elements"):
        a.check_complete()
    a.add(_sharded(3, full[9:], [[10], [9]]))
    a.check_complete()
    assert torch.equal(a.state["w"], full)


def test_dtensor_without_its_place_is_refused() -> None:
    with pytest.raises(
        ExportError, match="rank 0 is of format 1, which does not record where a DTensor's shard"
    ):
        Assembly("j", 5).first(_sharded(0, torch.ones(2), None, version=1))
    with pytest.raises(ExportError, match="a DTensor shard with no place in the global tensor"):
        Assembly("j", 5).first(_sharded(0, torch.ones(2), None))
    with pytest.raises(
        ExportError, match=r"a shard \[2\] at offset \[9\] does not fit the global shape \[10\]"
    ):
        Assembly("j", 5).first(_sharded(0, torch.ones(2), [[10], [9]]))


def test_replicated_tensors_come_from_a_rank_that_holds_them() -> None:
    marker = {ELIDED: [1, "float32", [3]]}
    a = Assembly("j", 5)
    a.first(_snapshot(0, {"m": {"a": torch.ones(2), "b": marker}, "loop": {"step": 5}}))
    assert a.keepers() == [1] and not a.sharded()
    a.add(_snapshot(2, {"m": {"a": torch.zeros(2), "b": {ELIDED: [1, "float32", [3]]}}, "loop": {"step": 5}}))
    with pytest.raises(ExportError, match=r"no rank's snapshot holds state\['m'\]\['b'\], which rank 1"):
        a.check_complete()
    a.add(
        _snapshot(
            1, {"m": {"a": {ELIDED: [0, "float32", [2]]}, "b": torch.full((3,), 7.0)}, "loop": {"step": 5}}
        )
    )
    a.check_complete()
    assert torch.equal(a.state["m"]["a"], torch.ones(2))  # rank 0's
    assert torch.equal(a.state["m"]["b"], torch.full((3,), 7.0))  # its keeper's
    assert a.state["loop"] == {"step": 5}


def test_stateful_values_are_their_state_dicts_and_snapshotd_keys_are_left_out() -> None:
    model = torch.nn.Linear(2, 1)
    snap = _snapshot(0, {"model": model, "\0snapshotd.ddp_buckets": {"layouts": {}}})
    kinds = {k: v[0] for k, v in msgpack.unpackb(snap.meta, strict_map_key=False)[1].items()}
    assert kinds["model"] == STATEFUL
    a = Assembly("j", 5)
    a.first(snap)
    assert list(a.state) == ["model"]
    assert set(a.state["model"]) == {"weight", "bias"} and torch.equal(
        a.state["model"]["weight"], model.weight
    )


class _FakeExporter:
    """Holds steps 3 then 4 as D; the pull of step 3 fails as if D had moved past it and it was dropped."""

    job = "j"
    pulled_bytes = 0

    def __init__(self) -> None:
        self.durable = 3
        self.collected: list[int] = []

    async def holders(self, step: int) -> tuple[int, int, list[tuple[str, ...]]]:
        return (self.durable if step < 0 else step), 1, [("tcp://a:1",)]

    async def ask(self, step: int) -> Any:
        return type("Reply", (), {"step": self.durable})()

    async def collect(self, step: int, world_size: int, sources: Any) -> tuple[dict[str, Any], list[int]]:
        self.collected.append(step)
        if step == 3:
            self.durable = 4
            raise PullFailed("pull of step 3 failed: not_found")
        return {"x": step}, [0]


def test_a_step_collected_meanwhile_is_exported_at_the_newer_durable_step() -> None:
    fake = _FakeExporter()
    state, done = asyncio.run(attempts(fake, None))  # type: ignore[arg-type]
    assert (state, done.step, fake.collected) == ({"x": 4}, 4, [3, 4])
    fake = _FakeExporter()
    with pytest.raises(ExportError, match="job 'j' step 3: pull of step 3 failed"):
        asyncio.run(attempts(fake, 3))  # type: ignore[arg-type]  # a step named is never swapped for another
    assert fake.collected == [3]
