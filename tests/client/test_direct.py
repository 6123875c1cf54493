"""What a restoring process offers its sidecar for direct placement."""

from __future__ import annotations

import os

import numpy as np
import torch

from snapshotd.client.direct import direct_targets, writable_by
from snapshotd.client.state import flatten


def test_targets_are_the_live_bytes_of_contiguous_cpu_tensors_only() -> None:
    w = torch.arange(12.0)
    t = torch.arange(12.0).reshape(3, 4).t()  # a transposed view: not contiguous
    flat = flatten({"w": w, "t": t, "e": torch.empty(0)})
    addresses = np.frombuffer(direct_targets(flat), dtype="<u8").tolist()
    assert addresses == [w.data_ptr(), 0, 0]
    assert direct_targets(flatten({"t": t})) == b""  # nothing placeable: the request carries no targets


def test_writable_by_is_harmless_without_yama_or_a_pid() -> None:
    for pid in (0, os.getpid()):
        with writable_by(pid):
            pass


def test_restore_targets_take_every_tensor_container_but_leave_statefuls_that_may_act() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from snapshotd.client.view import restore_targets, snapshot_view

    model = torch.nn.Linear(4, 2)
    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    state = {
        "model": model,
        "optim": torch.optim.SGD(model.parameters(), lr=0.1),
        "tensors": [torch.zeros(3), (torch.ones(2), {"m": torch.ones(1)})],  # a plain container of tensors
        "loop": {"step": 3, "name": "run"},
        "loader": loader,  # its state_dict() would start an iterator: never flattened before its load
        "wrapped": [loader],
    }
    view, _, _ = snapshot_view(state, (), None)
    assert set(restore_targets(view)) == {"model", "optim", "tensors", "loop"}
