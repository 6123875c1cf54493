"""DDP's gradient bucket layout travels in snapshots: a restored DDP run equals the uninterrupted one bit for bit.

Four gloo ranks (spawned processes, no sidecar: snapshots are taken and loaded with ``flatten`` / ``copy_into`` /
``restore_into`` through the Snapshotter's own state view). Each rank trains a small MLP under DDP with small
buckets, so DDP's rebuilt layout (after the first iteration) differs from its initial one. A fresh DDP module
stands in for the restarted process: its reducer starts in the initial layout, as a new process's does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from snapshotd.client.copies import copy_into
from snapshotd.client.ddp import DDP_KEY
from snapshotd.client.load import restore_into
from snapshotd.client.state import flatten
from snapshotd.client.view import snapshot_view

from ..gloo_ranks import run_gloo_ranks

WORLD = 4
STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 32),
        torch.nn.Linear(32, 1),
    )


def _job(*, wrap_value: bool, hook: bool) -> tuple[DDP, dict[str, Any]]:
    """A DDP model and its state mapping, the model given as the DDP module or as its ``.module``."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.01)  # ~10 KB buckets: three of them once rebuilt
    if hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return ddp, {"model": ddp if wrap_value else model, "optim": opt}


def _train(
    ddp: DDP, opt: torch.optim.Optimizer, start: int, stop: int, rank: int, on_step: Any = None
) -> list[float]:
    losses = []
    for step in range(start, stop):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1)
    return losses


def _take(state: dict[str, Any], *, layouts: bool = True) -> tuple[Any, torch.Tensor]:
    """A snapshot of ``state`` as the Snapshotter takes one (without DDP's layouts when not ``layouts``)."""
    view, _, _ = snapshot_view(state, (), None)
    if not layouts:
        view.extra.clear()
    flat = flatten(view)
    data = torch.zeros(flat.data_bytes, dtype=torch.uint8)
    copy_into(flat, data)
    return flat, data


def _resume(
    snapshot: tuple[Any, torch.Tensor], step: int, rank: int, *, wrap_value: bool, hook: bool
) -> list[float]:
    """A fresh DDP job restored from ``snapshot``, trained to the end; its losses and a parameter sum."""
    flat, data = snapshot
    ddp, state = _job(wrap_value=wrap_value, hook=hook)
    view, _, _ = snapshot_view(state, (), None)
    if DDP_KEY.encode() not in flat.meta:
        view.extra.clear()
    restore_into(view, flat.entries, flat.meta, data)
    return _train(ddp, state["optim"], step, STEPS, rank) + [float(sum(p.sum() for p in ddp.parameters()))]


def _rank_body(rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    late: tuple[Any, list[float]] = (None, [])
    for wrap_value, hook in ((False, False), (True, True)):
        ddp, state = _job(wrap_value=wrap_value, hook=hook)
        snaps: dict[Any, Any] = {}

        def take(step: int, state: dict[str, Any] = state, snaps: dict[Any, Any] = snaps) -> None:
            if step in (1, 3):
                snaps[step] = _take(state)
            if step == 3:
                snaps["naive"] = _take(state, layouts=False)

        reference = _train(ddp, state["optim"], 0, STEPS, rank, take)
        reference.append(float(sum(p.sum() for p in ddp.parameters())))
        layouts = snapshot_view(state, (), None)[2]
        assert layouts is not None
        res: dict[Any, Any] = {"buckets": len(layouts.state_dict()["model"] or [])}
        for step in (1, 3):
            res[step] = _resume(snaps[step], step, rank, wrap_value=wrap_value, hook=hook) == reference[step:]
        res["naive"] = _resume(snaps["naive"], 3, rank, wrap_value=wrap_value, hook=hook) == reference[3:]
        result[f"wrap={wrap_value},hook={hook}"] = res
        if not wrap_value:
            late = (snaps[3], reference)
    # a model wrapped in DDP only after its state was handed over: the restore finds the wrapper and sets its layout
    (flat, data), reference = late
    model = _model()
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    view, _, _ = snapshot_view(state, (), None)  # no DDP module lives yet
    ddp = DDP(model, bucket_cap_mb=0.01)
    restore_into(view, flat.entries, flat.meta, data)
    resumed = _train(ddp, state["optim"], 3, STEPS, rank) + [float(sum(p.sum() for p in ddp.parameters()))]
    result["wrapped_later"] = resumed == reference[3:]
    # a snapshot of a DDP model restored into a state whose model is not wrapped in DDP: refused, loudly
    _, state = _job(wrap_value=False, hook=False)
    snapshot = _take(state)  # before any step: DDP's initial layout
    bare = {"model": _model(), "optim": torch.optim.AdamW(_model().parameters())}
    view, _, _ = snapshot_view(bare, (), None)
    try:
        restore_into(view, snapshot[0].entries, snapshot[0].meta, snapshot[1])
        result["unwrapped"] = "restored"
    except ValueError as exc:
        result["unwrapped"] = str(exc)
    return result


def test_restored_ddp_runs_equal_the_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    results = run_gloo_ranks(_rank_body, WORLD, tmp_path)
    for res in results:
        for name in ("wrap=False,hook=False", "wrap=True,hook=True"):
            assert res[name]["buckets"] >= 2, res  # DDP rebuilt its buckets: a layout unlike the initial one
            assert res[name][1] and res[name][3], (name, res)  # restored after step 1 and after step 3
            assert res[name]["naive"] is False, (name, res)  # the control: without the layout, another run
        assert res["wrapped_later"], res
    # a snapshot taken before DDP's first iteration names DDP's initial layout, which needs DDP too
    assert all("Wrap the model in DDP before restore()" in res["unwrapped"] for res in results), results


def test_the_state_key_for_layouts_is_reserved() -> None:
    with pytest.raises(ValueError, match="snapshotd's own"):
        snapshot_view({DDP_KEY: torch.zeros(1), "m": torch.nn.Linear(1, 1)}, (), None)


def test_a_restore_without_ddp_looks_through_no_live_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    # a walk over every live object costs tens of ms in a training process: on the path of every recovery
    state = {"model": _model(), "optim": torch.optim.AdamW(_model().parameters())}
    flat, data = _take(state)
    view, _, ddp = snapshot_view(state, (), None)
    assert ddp is not None and ddp.modules == {}

    def walk() -> list[Any]:
        raise AssertionError("the restore walked every live object")

    monkeypatch.setattr("snapshotd.client.ddp.gc.get_objects", walk)
    restore_into(view, flat.entries, flat.meta, data)


def test_a_state_without_modules_carries_no_layouts() -> None:
    view, _, ddp = snapshot_view({"w": torch.zeros(2)}, (), None)
    assert ddp is None and list(view) == ["w"]
