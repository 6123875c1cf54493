"""Reading a rank's snapshot back: load a tensor table, a data buffer and a msgpack blob into a live state.

The format is :mod:`.meta`'s; :mod:`.state` writes it. Decoding the blob is msgpack only, never unpickling,
and every value is checked before it is used.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from ..proto import limits as L
from ..proto.manifest import DTYPE_SIZES, TensorEntry
from .errors import ConfigMismatch
from .meta import (
    ELIDED,
    EXT_DTENSOR,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_DEPTH,
    PLAIN,
    READ_VERSIONS,
    STATEFUL,
    TORCH_DTYPES,
    Path,
    check_buffer,
    dtensor_type,
    is_stateful,
    plain_dtype,
    where,
)

__all__ = ["TensorRef", "check_table", "decode_meta", "restore_into"]

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


@dataclasses.dataclass(slots=True)  # eq without frozen: unhashable, so a placeholder can never be a dict key
class TensorRef:
    """A tensor's placeholder in decoded meta: entry ``index`` of the table.

    ``dtensor``: the entry is a DTensor's local shard; ``place`` is then ``(global shape, global offset)`` of that
    shard, or None where the snapshot does not say (format 1) or the shard is no piece of the global tensor (a
    ``Partial`` placement).
    """

    index: int
    dtensor: bool
    place: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class _Decoder:
    """msgpack decoding of ``meta`` with the ext types of the module docstring; raises on anything else."""

    __slots__ = ("count", "depth", "placed", "unplaced")

    def __init__(self, count: int) -> None:
        self.count = count
        self.depth = 0
        self.placed = self.unplaced = 0  # DTensor placeholders with and without the global layout (format 2, 1)

    def unpack(self, buf: bytes | memoryview) -> Any:
        return msgpack.unpackb(buf, ext_hook=self.ext, raw=False, strict_map_key=False)

    def ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR or (code == EXT_DTENSOR and len(data) == 4):
            index = int.from_bytes(data, "big")
            if len(data) != 4 or index >= self.count:
                raise ValueError(f"tensor placeholder {index} is outside the table of {self.count}")
            self.unplaced += code == EXT_DTENSOR
            return TensorRef(index, code == EXT_DTENSOR)
        if code == EXT_DTENSOR:
            ref = self.ext(EXT_TENSOR, data[:4])
            ref.dtensor, ref.place = True, _place(msgpack.unpackb(data[4:]))
            self.placed += 1
            return ref
        if self.depth >= MAX_DEPTH:
            raise ValueError(f"ext types nest deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            obj = self.unpack(data)
        finally:
            self.depth -= 1
        if code == EXT_TUPLE and type(obj) is list:
            return tuple(obj)
        if code == EXT_SIZE and type(obj) is list and all(type(d) is int for d in obj):
            return torch.Size(obj)
        if code == EXT_ODICT and type(obj) is dict:
            return collections.OrderedDict(obj)
        if code == EXT_NDARRAY and type(obj) is list and len(obj) == 3:
            dt, shape, raw = _np_dtype(obj[0]), obj[1], obj[2]
            if (
                type(shape) is not list
                or any(type(d) is not int or d < 0 for d in shape)
                or type(raw) is not bytes
            ):
                raise ValueError("bad NumPy array")
            if math.prod(shape) * dt.itemsize != len(raw):
                raise ValueError("NumPy array bytes do not match its shape")
            return np.frombuffer(raw, dt).reshape(shape).copy()
        if code == EXT_NPSCALAR and type(obj) is list and len(obj) == 2:
            dt, raw = _np_dtype(obj[0]), obj[1]
            if type(raw) is not bytes or len(raw) != dt.itemsize:
                raise ValueError("bad NumPy scalar")
            return np.frombuffer(raw, dt)[0]
        raise ValueError(f"unknown or malformed ext type {code}")


def _place(obj: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A DTensor placeholder's ``[global shape, global offset]`` (or nil), checked."""
    if obj is None:
        return None
    if (
        type(obj) is not list
        or len(obj) != 2
        or any(type(v) is not list or any(type(d) is not int or d < 0 for d in v) for v in obj)
        or len(obj[0]) != len(obj[1])
    ):
        raise ValueError("bad DTensor layout")
    return tuple(obj[0]), tuple(obj[1])


def _np_dtype(s: Any) -> np.dtype:
    if type(s) is not str:
        raise ValueError("bad NumPy dtype")
    dt = np.dtype(s)
    if not plain_dtype(dt):
        raise ValueError(f"NumPy dtype {s!r} is not plain data")
    return dt


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
        return self.dtensor.from_local(src.clone(), like.device_mesh, like.placements, run_check=False,  # type: ignore[union-attr]
                                       shape=like.shape, stride=like.stride())  # fmt: skip

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
                target.device == src.device and target.data_ptr() == src.data_ptr() and target.stride() == src.stride()
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


def check_table(entries: Sequence[TensorEntry], data: torch.Tensor) -> None:
    """Check that every entry of a snapshot's table is a tensor of a known dtype lying, aligned, inside ``data``.

    Raises:
        ValueError: ``data`` is not a contiguous aligned 1-D uint8 tensor, or an entry is bad (named).
    """
    check_buffer(data, 0, "data")
    for e in entries:
        size = DTYPE_SIZES.get(e.dtype)
        if e.dtype not in TORCH_DTYPES or size is None or e.nbytes != math.prod(e.shape) * size:
            raise ValueError(f"tensor table entry {e.path!r}: bad dtype or size")
        if e.offset < 0 or e.offset % size or e.offset + e.nbytes > data.numel():
            raise ValueError(f"tensor table entry {e.path!r}: byte range outside the data or misaligned")


def decode_meta(meta: bytes | memoryview, count: int) -> tuple[int, dict[str, list[Any]]]:
    """Decode a snapshot's ``meta`` (msgpack only, never unpickled): its format version and ``{key: [kind,
    tree]}``, each tensor of a tree a :class:`TensorRef` into a table of ``count`` entries.

    Raises:
        ValueError: malformed meta, or a format this build does not read.
    """
    if memoryview(meta).nbytes > L.MAX_META_BYTES:
        raise ValueError(f"snapshot meta is over {L.MAX_META_BYTES} bytes")
    decoder = _Decoder(count)
    try:
        decoded = decoder.unpack(meta)
    except Exception as exc:
        raise ValueError(f"malformed snapshot meta: {exc}") from exc
    if type(decoded) is not list or len(decoded) != 2 or type(decoded[1]) is not dict:
        raise ValueError("malformed snapshot meta: not [version, {key: [kind, tree]}]")
    version = decoded[0]
    if version not in READ_VERSIONS:
        raise ValueError(f"snapshot meta of format {version!r}: this build reads formats {list(READ_VERSIONS)} "
                         "(the snapshot was taken by a newer snapshotd?)")  # fmt: skip
    if decoder.placed if version == 1 else decoder.unplaced:
        raise ValueError(f"malformed snapshot meta: a DTensor placeholder of another format than {version}")
    top: dict[Any, Any] = decoded[1]
    if any(type(v) is not list or len(v) != 2 or v[0] not in (STATEFUL, PLAIN) for v in top.values()):
        raise ValueError("malformed snapshot meta: a top-level value is not [kind, tree]")
    return version, top


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
            raise ConfigMismatch(f"{where((key,))} was snapshotted with replicated=, each rank keeping part of it: "
                             "restore it with the same replicated= keys and group size")  # fmt: skip
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
                raise ConfigMismatch(f"{where(keys)}: snapshot and state disagree on whether this is Stateful")
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
                        raise ConfigMismatch(f"{where(keys)}: cannot replace this value in a read-only mapping")
                    state[key] = restored
    logger.debug("restored %d tensors into %d state keys", len(entries), len(state))

