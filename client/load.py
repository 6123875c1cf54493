"""Reading a rank's snapshot back: load a tensor table, a data buffer and a msgpack blob into a live state.

The format is :mod:`snapshotd.snapshot_format`'s; :mod:`.state` writes it. Decoding the blob is msgpack only, never unpickling,
and every value is checked before it is used.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from snapshotd.snapshot_format import (
    ELIDED,
    MAX_DEPTH,
    PLAIN,
    STATEFUL,
    TORCH_DTYPES,
    Path,
    TensorRef,
    check_table,
    decode_meta,
    dtensor_type,
    is_stateful,
    where,
)

from ..proto.manifest import TensorEntry
from .errors import ConfigMismatch

__all__ = ["restore_into"]

logger = logging.getLogger(__name__)


def _has_marker(tree: Any, depth: int = 0) -> bool:
    """Whether a decoded tree holds a :data:`ELIDED` marker (a tensor another rank of a replica group kept)."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(tree, dict):
        return ELIDED in tree or any(_has_marker(v, depth + 1) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_marker(v, depth + 1) for v in tree)
    return False


class _Restorer:
    """Rebuilds values from decoded meta, copying tensor bytes into the live tensors where they fit."""

    __slots__ = ("data", "dtensor", "entries", "like", "placed")

    def __init__(
        self, entries: Sequence[TensorEntry], data: torch.Tensor, placed: Mapping[int, torch.Tensor]
    ) -> None:
        self.entries = entries
        self.data = data
        self.placed = placed
        self.dtensor = dtensor_type()
        self.like: dict[Path, Any] = {}
        """Path of a container -> the DTensor whose layout a DTensor shard in it that the live state lacks
        takes (an optimizer's per-parameter state: its parameter; see :func:`_optimizer_templates`)."""

    def new_dtensor(self, src: torch.Tensor, keys: Path) -> Any:
        """A DTensor with the local shard ``src`` (copied), laid out as the parameter it belongs to.

        Raises:
            ValueError: no parameter is known for ``keys``, or its local shard has another shape.
        """
        like = self.like.get(keys[:-1])
        if like is None or tuple(like.to_local().shape) != tuple(src.shape):
            raise ConfigMismatch(
                f"{where(keys)}: the snapshot holds a DTensor shard but the live state has no DTensor here "
                "(only an optimizer's state shaped like its parameter can be rebuilt from the parameter's layout)"
            )
        return self.dtensor.from_local(
            src.clone(),
            like.device_mesh,
            like.placements,
            run_check=False,  # type: ignore[union-attr]
            shape=like.shape,
            stride=like.stride(),
        )

    def tensor(self, ref: TensorRef, cur: Any, keys: Path, strict: bool) -> Any:
        e = self.entries[ref.index]
        if e.path != "/".join(map(str, keys)):
            raise ValueError(f"{where(keys)}: the table names {e.path!r} here; table and meta do not match")
        dtype = TORCH_DTYPES[e.dtype]
        target = cur
        live_dtensor = self.dtensor is not None and isinstance(cur, self.dtensor)
        if live_dtensor:
            target, strict = cur.to_local(), True
        src = self.placed.get(ref.index)
        if src is None:
            if e.nbytes:
                src = self.data[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)
            else:
                src = torch.empty(e.shape, dtype=dtype)
        if ref.dtensor and not live_dtensor:
            return self.new_dtensor(src, keys)
        if isinstance(target, torch.Tensor) and target.dtype == dtype and tuple(target.shape) == e.shape:
            same = (
                target.device == src.device
                and target.data_ptr() == src.data_ptr()
                and target.stride() == src.stride()
            )
            if not same:  # a placed tensor is often the live one itself: its bytes are already there
                target.copy_(src)
            return cur
        if strict:
            live = f"{target.dtype} {list(target.shape)}" if isinstance(target, torch.Tensor) else type(cur)
            raise ConfigMismatch(
                f"{where(keys)}: snapshot holds {e.dtype} {list(e.shape)}, the live value is {live}"
            )
        return src.clone()

    def merge(self, node: Any, cur: Any, keys: Path, inplace: bool) -> Any:
        """The restored value of ``node``; containers of ``cur`` are updated in place when ``inplace``."""
        t = type(node)
        if t is TensorRef:
            return self.tensor(node, cur, keys, strict=False)
        if len(keys) > MAX_DEPTH:
            raise ValueError(f"{where(keys)}: snapshot meta nests deeper than {MAX_DEPTH} levels")
        if t is dict or t is collections.OrderedDict:
            if inplace and isinstance(cur, dict):
                for k, x in node.items():
                    cur[k] = self.merge(x, cur.get(k), (*keys, k), True)
                for k in [k for k in cur if k not in node]:
                    del cur[k]
                return cur
            sub = cur if isinstance(cur, Mapping) else {}
            return t((k, self.merge(x, sub.get(k), (*keys, k), inplace)) for k, x in node.items())
        if t is list or t is tuple:
            seq = cur if isinstance(cur, list | tuple) else ()
            n = len(seq)
            items = [
                self.merge(x, seq[i] if i < n else None, (*keys, i), inplace) for i, x in enumerate(node)
            ]
            if t is tuple:
                return tuple(items)
            if inplace and type(cur) is list:
                cur[:] = items
                return cur
            return items
        if (
            t is np.ndarray
            and inplace
            and isinstance(cur, np.ndarray)
            and (cur.dtype, cur.shape) == (node.dtype, node.shape)
            and cur.flags.writeable
        ):
            np.copyto(cur, node)
            return cur
        return node


def _optimizer_templates(key: str, optimizer: torch.optim.Optimizer, dtensor: type) -> dict[Path, Any]:
    """``(key, "state", i)`` -> parameter ``i`` of ``optimizer`` (its state dict's numbering), for the DTensor
    parameters: an optimizer that has not stepped yet has no state to restore DTensor moments into, so each is
    rebuilt with its parameter's mesh and placements."""
    out: dict[Path, Any] = {}
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, dtensor):
                out[(key, "state", index)] = param
            index += 1
    return out


def restore_into(
    state: Mapping[str, Any],
    entries: Sequence[TensorEntry],
    meta: bytes | memoryview,
    data: torch.Tensor,
    *,
    placed: Mapping[int, torch.Tensor] | None = None,
) -> None:
    """Load a snapshot into ``state`` in place: the inverse of :func:`~.state.flatten` + :func:`~.copies.copy_into`.

    A Stateful value gets ``load_state_dict()`` of a state dict rebuilt from ``meta``, in which every tensor
    that has the path, dtype and shape of a tensor in its current ``state_dict()`` is that tensor with the
    snapshot's bytes copied in (module parameters are never reallocated); other tensors are new copies. A
    plain tensor (a DTensor: its local shard) is overwritten in place. Plain dicts and lists are updated in
    place; other plain values are replaced in ``state`` when it is a MutableMapping. ``data`` is not
    referenced after this returns.

    Args:
        state: the live state, with the keys the snapshot was taken with.
        entries: the snapshot's tensor table.
        meta: the snapshot's msgpack blob. Decoded with msgpack only, never unpickled.
        data: contiguous 1-D uint8 CPU tensor holding the data buffer, starting at a multiple of 16 bytes of
            its storage.
        placed: entry index -> a tensor of that entry's dtype and shape that already holds its bytes (the
            sidecar wrote them there); ``data`` is not read for those entries.

    Raises:
        ValueError: malformed meta, a table that does not fit ``data`` or ``meta``, keys that differ from
            ``state``'s (named), a plain tensor whose dtype or shape differs (named by path). The state may be
            partly restored when this is raised after the checks of the table, meta and keys.
    """
    check_table(entries, data)
    _, top = decode_meta(meta, len(entries))
    missing, extra = [k for k in state if k not in top], [k for k in top if k not in state]
    if missing or extra:
        raise ConfigMismatch(
            f"snapshot does not match the state: state keys missing {missing}, extra keys {extra}"
        )

    for key, value in state.items():
        if not getattr(value, "fills_markers", False) and _has_marker(top[key][1]):
            raise ConfigMismatch(
                f"{where((key,))} was snapshotted with replicated=, each rank keeping part of it: "
                "restore it with the same replicated= keys and group size"
            )
    restorer = _Restorer(entries, data, placed or {})
    if restorer.dtensor is not None:
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                restorer.like.update(_optimizer_templates(key, value, restorer.dtensor))
    with torch.no_grad():
        for key, value in state.items():
            kind, tree = top[key]
            keys = (key,)
            stateful = not isinstance(value, torch.Tensor) and is_stateful(value)
            if kind != (STATEFUL if stateful else PLAIN):
                raise ConfigMismatch(
                    f"{where(keys)}: snapshot and state disagree on whether this is Stateful"
                )
            if isinstance(value, torch.Tensor):
                if type(tree) is not TensorRef:
                    raise ConfigMismatch(f"{where(keys)}: the snapshot holds no tensor here")
                restorer.tensor(tree, value, keys, strict=True)
            elif stateful:
                current = value.state_dict()
                restored = restorer.merge(tree, current, keys, inplace=False)
                version_info = getattr(current, "_metadata", None)  # nn.Module's per-submodule versions
                if version_info is not None and type(restored) is collections.OrderedDict:
                    restored._metadata = version_info  # type: ignore[attr-defined]
                value.load_state_dict(restored)
            else:
                restored = restorer.merge(tree, value, keys, inplace=True)
                if restored is not value:
                    if not isinstance(state, MutableMapping):
                        raise ConfigMismatch(
                            f"{where(keys)}: cannot replace this value in a read-only mapping"
                        )
                    state[key] = restored
    logger.debug("restored %d tensors into %d state keys", len(entries), len(state))
