"""The state as snapshots see it: the user's mapping, some values stood in for, some keys added.

A :class:`~snapshotd.client.Snapshotter` snapshots more than the user's values as they are: with
``replicated=`` a value is snapshotted through a :class:`~snapshotd.client.replicas.ReplicaShard`, and a state
holding modules carries DDP's gradient bucket layouts under :data:`~snapshotd.client.ddp.DDP_KEY`. A
:class:`SnapshotView` presents that, while a plain value that a restore replaces is written to the user's own
mapping, where the training loop reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from .ddp import DDP_KEY, DDPBuckets
from .replicas import ReplicaShard

__all__ = ["SnapshotView", "restore_targets", "snapshot_view"]


class SnapshotView(MutableMapping[str, Any]):
    """``base`` with the values of ``stand_ins`` in place of its own and the keys of ``extra`` after its own.

    Writing a key of ``base`` writes to ``base`` (a ``ValueError`` when it is read-only); the keys of
    ``stand_ins`` and ``extra`` cannot be written or deleted.
    """

    def __init__(
        self, base: Mapping[str, Any], stand_ins: Mapping[str, Any], extra: Mapping[str, Any]
    ) -> None:
        self.base = base
        self.stand_ins = dict(stand_ins)
        self.extra = dict(extra)

    def __getitem__(self, key: str) -> Any:
        if key in self.stand_ins:
            return self.stand_ins[key]
        if key in self.extra:
            return self.extra[key]
        return self.base[key]

    def __iter__(self) -> Iterator[str]:
        yield from self.base
        yield from self.extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self.stand_ins or key in self.extra or not isinstance(self.base, MutableMapping):
            raise ValueError(f"state[{key!r}]: cannot replace this value in a read-only mapping")
        self.base[key] = value

    def __delitem__(self, key: str) -> None:
        raise ValueError(f"state[{key!r}]: snapshots never delete a state key")


def snapshot_view(
    state: Mapping[str, Any], replicated: Sequence[str], group: Any
) -> tuple[SnapshotView, Any, DDPBuckets | None]:
    """``state`` as snapshots see it, the replica group (None without ``replicated``), and the DDP layouts'
    Stateful (None when no value of ``state`` is a module).

    Raises:
        ValueError: ``replicated`` names a key not in ``state``, or is a string; no process group for it.
    """
    if isinstance(replicated, str):
        raise ValueError(f"replicated must be a sequence of state keys, got the string {replicated!r}")
    missing = [k for k in replicated if k not in state]
    if missing:
        raise ValueError(f"replicated keys {missing} are not in the state (its keys: {list(state)})")
    if replicated and group is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError("replicated= needs torch.distributed initialised, or a replica_group")
        group = torch.distributed.group.WORLD
    shards: dict[str, ReplicaShard] = {}
    for key in state:
        if key in replicated:
            shards[key] = ReplicaShard(state[key], group, key, before=list(shards.values()))
    if DDP_KEY in state:
        raise ValueError(f"the state key {DDP_KEY!r} is snapshotd's own")
    ddp = DDPBuckets(state) if any(isinstance(v, torch.nn.Module) for v in state.values()) else None
    view = SnapshotView(state, shards, {DDP_KEY: ddp} if ddp is not None else {})
    return view, (group if replicated else None), ddp


def restore_targets(view: SnapshotView) -> dict[str, Any]:
    """The values of ``view`` whose tensors a restore may write in place before loading the rest: those whose
    flattening runs no code that may act (tensors, modules, optimizers, and plain containers and values holding
    only those), which hold nearly all the bytes.

    Other Statefuls are left out, with any container holding one: their ``state_dict()`` must not run before their
    ``load_state_dict()``, since it may act (a ``StatefulDataLoader`` starts an iterator and its worker processes
    to answer it).
    """
    return {key: view[key] for key in view if _inert(view[key])}


def _inert(value: Any, depth: int = 0) -> bool:
    """Whether flattening ``value`` runs no code of the user's but a module's or optimizer's ``state_dict()``."""
    if isinstance(value, ReplicaShard):
        value = value.inner
    if isinstance(value, torch.Tensor | torch.nn.Module | torch.optim.Optimizer):
        return True
    if depth > 32:  # deeper than any state: left out rather than walked
        return False
    if isinstance(value, Mapping):
        return all(_inert(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_inert(v, depth + 1) for v in value)
    return not callable(getattr(value, "state_dict", None))
