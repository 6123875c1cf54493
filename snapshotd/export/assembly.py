"""The checkpoint's state dict, assembled from the ranks' snapshots as they arrive.

Per top-level key of the ``Snapshotter``'s state the checkpoint holds a Stateful value's ``state_dict()``, a plain
value as it is; snapshotd's own keys (DDP bucket layouts) are left out.

- A DTensor (FSDP2) is written as its global tensor, assembled from every rank's shard at the global offset the
  snapshot recorded (format 2; a format 1 snapshot lacks it and is refused), so that DCP reshards it on load.
- Any other tensor and every other value is replicated in DCP's sense: rank 0's is written.
- A tensor that ``replicated=`` had one rank keep (:mod:`snapshotd.client.replicas`) is taken from that rank.

:class:`Assembly` builds the state from rank 0's snapshot and says which other ranks are needed (the keepers of
replicated tensors, every rank when the state holds DTensors); each further snapshot is merged and can be dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

from snapshotd.proto import TensorEntry
from snapshotd.snapshot_format import (
    DDP_KEY,
    ELIDED,
    TORCH_DTYPES,
    TensorRef,
    check_table,
    decode_meta,
    where,
)

from .result import ExportError

__all__ = ["Assembly", "Snapshot"]

Path = tuple[Any, ...]


@dataclasses.dataclass(slots=True)
class Snapshot:
    """One rank's pulled snapshot: its tensor table, its meta and its tensor bytes."""

    rank: int
    entries: list[TensorEntry]
    meta: bytes | memoryview
    data: torch.Tensor


class _Sharded:
    """A DTensor's global tensor being filled from the ranks' shards."""

    __slots__ = ("boxes", "covered", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.boxes: set[tuple[int, ...]] = set()
        self.covered = 0

    def add(self, shard: torch.Tensor, offset: tuple[int, ...]) -> None:
        if offset in self.boxes or not shard.numel():
            return  # a replica of a shard already in (a Replicate dimension of the mesh), or an empty one
        self.boxes.add(offset)
        self.covered += shard.numel()
        self.tensor[tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))].copy_(shard)

    @property
    def complete(self) -> bool:
        return self.covered >= self.tensor.numel()


class _Elided:
    """A tensor of a ``replicated=`` value that another rank kept: filled from the first snapshot holding it."""

    __slots__ = ("keeper", "tensor")

    def __init__(self, keeper: int, tensor: torch.Tensor) -> None:
        self.keeper = keeper
        self.tensor = tensor


class Assembly:
    """The checkpoint's state dict, built from rank 0's snapshot and completed from the others'.

    ``pending`` maps the path of every tensor rank 0's snapshot cannot give whole (a DTensor not yet covered by
    the shards merged so far, a tensor another rank kept) to what fills it. :meth:`add` may run in several
    threads at once.
    """

    def __init__(self, job: str, step: int) -> None:
        self.what = f"job {job!r} step {step}"
        self.state: dict[str, Any] = {}
        self.pending: dict[Path, _Sharded | _Elided] = {}
        self.lock = threading.Lock()

    def keepers(self) -> list[int]:
        return sorted({p.keeper for p in self.pending.values() if isinstance(p, _Elided)})

    def sharded(self) -> bool:
        return any(isinstance(p, _Sharded) for p in self.pending.values())

    def first(self, snap: Snapshot) -> None:
        """Build the state dict from rank 0's snapshot."""
        version, top = self._decode(snap)
        for key, (_, tree) in top.items():
            if key == DDP_KEY:
                continue
            self.state[key] = self._build(tree, (key,), snap, version)
        self.pending = {k: v for k, v in self.pending.items() if not (isinstance(v, _Sharded) and v.complete)}

    def add(self, snap: Snapshot) -> None:
        """Fill what is pending from another rank's snapshot."""
        version, top = self._decode(snap)
        with self.lock:
            for keys, leaf in _leaves({k: t for k, (_, t) in top.items() if k != DDP_KEY}, ()):
                slot = self.pending.get(keys)
                if slot is None:
                    continue
                if isinstance(slot, _Sharded):
                    if isinstance(leaf, TensorRef) and leaf.dtensor:
                        shape, offset = self._place(leaf, keys, snap, version)
                        if shape != tuple(slot.tensor.shape):
                            raise ExportError(
                                f"{self.what}: {where(keys)} is a DTensor of global shape {list(shape)} "
                                f"on rank {snap.rank}, {list(slot.tensor.shape)} on rank 0"
                            )
                        slot.add(self._tensor(leaf, keys, snap), offset)
                        if slot.complete:
                            del self.pending[keys]
                elif isinstance(leaf, TensorRef) and not leaf.dtensor:
                    src = self._tensor(leaf, keys, snap)
                    if src.dtype == slot.tensor.dtype and src.shape == slot.tensor.shape:
                        slot.tensor.copy_(src)
                        del self.pending[keys]

    def check_complete(self) -> None:
        """Raise ExportError naming a tensor that no pulled snapshot gave whole."""
        if not self.pending:
            return
        keys, slot = next(iter(self.pending.items()))
        if isinstance(slot, _Sharded):
            raise ExportError(
                f"{self.what}: the ranks' shards of the DTensor {where(keys)} cover "
                f"{slot.covered} of its {slot.tensor.numel()} elements"
            )
        raise ExportError(
            f"{self.what}: no rank's snapshot holds {where(keys)}, which rank {slot.keeper} of the "
            "replica group kept (a replica_group other than the whole world?)"
        )

    def _decode(self, snap: Snapshot) -> tuple[int, dict[str, list[Any]]]:
        try:
            check_table(snap.entries, snap.data)
            return decode_meta(snap.meta, len(snap.entries))
        except ValueError as exc:
            raise ExportError(
                f"{self.what}: the snapshot of rank {snap.rank} does not decode: {exc}"
            ) from exc

    def _tensor(self, ref: TensorRef, keys: Path, snap: Snapshot) -> torch.Tensor:
        """The bytes of ``ref`` as a tensor of its own (the snapshot's buffer is dropped after merging)."""
        e = snap.entries[ref.index]
        if e.path != "/".join(map(str, keys)):
            raise ExportError(
                f"{self.what}: the snapshot of rank {snap.rank} names {e.path!r} at {where(keys)}: "
                "its table and meta do not match"
            )
        dtype = TORCH_DTYPES[e.dtype]
        if not e.nbytes:
            return torch.empty(e.shape, dtype=dtype)
        return snap.data[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape).clone()

    def _place(
        self, ref: TensorRef, keys: Path, snap: Snapshot, version: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if version < 2:
            raise ExportError(
                f"{self.what}: the snapshot of rank {snap.rank} is of format {version}, which does not "
                f"record where a DTensor's shard lies in the global tensor ({where(keys)}); snapshots "
                "taken by this build of the client can be exported"
            )
        if ref.place is None:
            raise ExportError(
                f"{self.what}: {where(keys)} on rank {snap.rank} is a DTensor shard with no place in "
                "the global tensor (a Partial placement, or a layout snapshotd cannot place)"
            )
        shape, offset = ref.place
        local = snap.entries[ref.index].shape
        if len(local) != len(shape) or any(o + n > g for o, n, g in zip(offset, local, shape, strict=True)):
            raise ExportError(
                f"{self.what}: {where(keys)} on rank {snap.rank}: a shard {list(local)} at offset "
                f"{list(offset)} does not fit the global shape {list(shape)}"
            )
        return shape, offset

    def _build(self, node: Any, keys: Path, snap: Snapshot, version: int) -> Any:
        t = type(node)
        if t is TensorRef:
            if not node.dtensor:
                return self._tensor(node, keys, snap)
            shape, offset = self._place(node, keys, snap, version)
            dtype = TORCH_DTYPES[snap.entries[node.index].dtype]
            sharded = _Sharded(torch.zeros(shape, dtype=dtype))
            sharded.add(self._tensor(node, keys, snap), offset)
            self.pending[keys] = sharded
            return sharded.tensor
        if t is dict and ELIDED in node:
            keeper, dtype_name, dims = _marker(node, keys, self.what)
            elided = _Elided(keeper, torch.empty(dims, dtype=TORCH_DTYPES[dtype_name]))
            self.pending[keys] = elided
            return elided.tensor
        if t is dict or t is collections.OrderedDict:
            return t((k, self._build(v, (*keys, k), snap, version)) for k, v in node.items())
        if t is list:
            return [self._build(v, (*keys, i), snap, version) for i, v in enumerate(node)]
        if t is tuple:
            return tuple(self._build(v, (*keys, i), snap, version) for i, v in enumerate(node))
        return node


def _leaves(node: Any, keys: Path) -> Iterator[tuple[Path, Any]]:
    """The tensor placeholders and replica markers of a decoded tree, with their paths (as ``Assembly._build``
    names them)."""
    t = type(node)
    if t is TensorRef or (t is dict and ELIDED in node):
        yield keys, node
    elif t is dict or t is collections.OrderedDict:
        for k, v in node.items():
            yield from _leaves(v, (*keys, k))
    elif t is list or t is tuple:
        for i, v in enumerate(node):
            yield from _leaves(v, (*keys, i))


def _marker(node: dict[Any, Any], keys: Path, what: str) -> tuple[int, str, list[int]]:
    try:
        keeper, dtype_name, shape = node[ELIDED]
        if (
            type(keeper) is not int
            or dtype_name not in TORCH_DTYPES
            or not all(type(n) is int for n in shape)
        ):
            raise TypeError
        return keeper, dtype_name, shape
    except (TypeError, ValueError):
        raise ExportError(f"{what}: malformed replica marker at {where(keys)}") from None
