"""Replicated state: each tensor snapshotted by one rank, shared out again on restore (real gloo ranks)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from snapshotd.client import ConfigMismatch, ReplicaGroupError, Snapshotter
from snapshotd.client.copies import copy_into
from snapshotd.client.load import restore_into
from snapshotd.client.replicas import ELIDED, ReplicaShard, assign_keepers, fail_remaining
from snapshotd.client.state import flatten

from ..gloo_ranks import run_gloo_ranks

WORLD = 3


def test_keepers_balance_bytes_largest_first_and_agree() -> None:
    sizes = [100, 10, 60, 50, 40, 0, 30]
    keeper = assign_keepers(sizes, 3)
    assert keeper == assign_keepers(list(sizes), 3)  # a pure function of the sizes
    loads = [sum(s for s, k in zip(sizes, keeper, strict=True) if k == r) for r in range(3)]
    assert sorted(loads) == [90, 100, 100]
    assert keeper[0] == 0 and keeper[2] == 1 and keeper[3] == 2  # the largest go to ranks 0, 1, 2 in turn
    assert assign_keepers(sizes, 1) == [0] * len(sizes)


def _build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "step": 0}


def _train(state: dict[str, Any], steps: int, rank: int) -> list[float]:
    losses = []
    for i in range(steps):
        x = torch.arange(8) + i  # every rank the same batch: the replicas stay alike, as after an all-reduce
        loss = state["model"](x).logsumexp(-1).mean()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["step"] += 1
        losses.append(loss.item())
    return losses


def _rank_body(rank: int) -> dict[str, Any]:
    state = _build(0)
    _train(state, 3, rank)
    state["model"][1].running_mean.add_(rank)  # as under DDP: buffers are each rank's own
    shards = [ReplicaShard(state["model"], dist.group.WORLD, "model")]
    shards.append(ReplicaShard(state["optim"], dist.group.WORLD, "optim", before=shards))
    taken = flatten({"model": shards[0], "optim": shards[1], "step": state["step"]})
    data = torch.empty(taken.data_bytes, dtype=torch.uint8)
    copy_into(taken, data)
    whole = flatten(state).data_bytes
    state_before_mean = state["model"][1].running_mean.clone()
    reference = _train(state, 5, rank)

    fresh = _build(1)  # other weights, and an optimizer without moments: all of it comes from the snapshot
    shards = [ReplicaShard(fresh["model"], dist.group.WORLD, "model")]
    shards.append(ReplicaShard(fresh["optim"], dist.group.WORLD, "optim", before=shards))
    view = {"model": shards[0], "optim": shards[1], "step": 0}
    restore_into(view, taken.entries, taken.meta, data)
    fresh["step"] = view["step"]
    own_buffer = bool(torch.equal(fresh["model"][1].running_mean, state_before_mean))
    again = _train(fresh, 5, rank)

    # a snapshot taken with replicated= is refused without it, and one taken without it is refused with it
    try:
        restore_into(_build(2), taken.entries, taken.meta, data)
        unsharded_restore = "restored"
    except ValueError as exc:
        unsharded_restore = str(exc)
    plain = flatten(_build(3))
    plain_data = torch.empty(plain.data_bytes, dtype=torch.uint8)
    copy_into(plain, plain_data)
    other = _build(4)
    shards = [ReplicaShard(other["model"], dist.group.WORLD, "model")]
    shards.append(ReplicaShard(other["optim"], dist.group.WORLD, "optim", before=shards))
    try:
        restore_into(
            {"model": shards[0], "optim": shards[1], "step": 0}, plain.entries, plain.meta, plain_data
        )
        sharded_restore = "restored"
    except ValueError as exc:
        sharded_restore = str(exc)
    # a rank whose restore fails before its shards are loaded takes part in their agreement as failed, so the
    # others raise there instead of waiting in a broadcast
    other = _build(5)
    shards = [ReplicaShard(other["model"], dist.group.WORLD, "model")]
    shards.append(ReplicaShard(other["optim"], dist.group.WORLD, "optim", before=shards))
    view = {"model": shards[0], "optim": shards[1], "step": 0}
    if rank == 1:
        view = {"model": shards[0], "optim": shards[1], "steps": 0}  # not the snapshot's keys: refused first
    try:
        restore_into(view, taken.entries, taken.meta, data)
        partial = "restored"
    except (ConfigMismatch, ReplicaGroupError) as exc:
        fail_remaining(shards)
        partial = str(exc)

    # a rank whose own part did not come tells the others before any of them waits in a broadcast for it
    snap = Snapshotter(
        state,
        job="j",
        rank=rank,
        world_size=WORLD,
        sidecar=os.path.join(tempfile.gettempdir(), "snapshotd-none.ipc"),
        timeout=1,
        replicated=("model", "optim"),
    )
    try:
        snap._restorer._agree(ok=rank != 1, timeout=30)
        agreed = "ok"
    except RuntimeError as exc:
        agreed = str(exc)
    finally:
        snap.close(unregister=False)
    result = {
        "kept": taken.data_bytes,
        "whole": whole,
        "markers": taken.meta.count(ELIDED.encode()),
        "same": again == reference,
        "agreed": agreed,
        "own_buffer": own_buffer,
        "partial": partial,
        "unsharded_restore": unsharded_restore,
        "sharded_restore": sharded_restore,
    }
    return result


def test_each_rank_keeps_a_third_and_restore_shares_it_out(tmp_path: Path) -> None:
    results = run_gloo_ranks(_rank_body, WORLD, tmp_path)
    for res in results:
        assert res["same"], res  # the next 5 losses equal an uninterrupted run's exactly
        assert 0.25 < res["kept"] / res["whole"] < 0.45, results
        assert res["markers"] > 0
    assert sum(r["kept"] for r in results) < 1.1 * results[0]["whole"]
    assert results[1]["agreed"] == "ok"  # the failing rank raises its own error
    assert "snapshot does not match the state" in results[1]["partial"]
    for r in (0, 2):
        assert "rank(s) [1] of the replica group could not load their part of it" in results[r]["partial"], (
            results
        )
    for res in results:
        assert res["own_buffer"], res  # BatchNorm's running statistics came back as each rank had them
        assert "was snapshotted with replicated=" in res["unsharded_restore"], res
        assert "snapshotted without replicated=" in res["sharded_restore"], res
    for r in (0, 2):
        assert "rank(s) [1] of the replica group could not restore" in results[r]["agreed"]


def test_bad_replicated_arguments_are_named() -> None:
    state = _build(0)
    with pytest.raises(ValueError, match=r"replicated keys \['model2'\] are not in the state"):
        Snapshotter(state, job="j", rank=0, world_size=1, replicated=("model2",))
    with pytest.raises(ValueError, match="sequence of state keys, got the string 'model'"):
        Snapshotter(state, job="j", rank=0, world_size=1, replicated="model")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="needs torch.distributed initialised"):
            Snapshotter(state, job="j", rank=0, world_size=1, replicated=("model",))
