"""Flatten a rank's state into a tensor table, a data buffer and a msgpack blob, and restore it in place.

A snapshot of one rank is a :class:`~snapshotd.proto.manifest.TensorEntry` table, one flat byte buffer holding
every tensor at the offset its entry gives (64-byte aligned), and ``meta``: msgpack of the whole structure
with each tensor replaced by a placeholder. Nothing is ever pickled.

``meta`` is ``[FORMAT_VERSION, {key: [kind, tree]}]``, where ``kind`` says whether the live value was Stateful
(``tree`` is its ``state_dict()``) or a plain value. Inside ``tree``, dict (keys: str, int, float, bool, None,
bytes), list, str, int (64-bit), float (float64, NaN and inf included), bool, None and bytes are msgpack's
own; the rest are ext types, so that types survive exactly: 1 a tensor placeholder (its table index, 4 bytes
big-endian), 2 the same for a DTensor's local shard, 3 tuple, 4 ``torch.Size``, 5 ``OrderedDict`` (each
packing its items), 6 NumPy array ``[dtype.str, shape, C-order bytes]``, 7 NumPy scalar
``[dtype.str, bytes]``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import sys
import threading
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from ..proto import limits as L
from ..proto.manifest import DTYPE_SIZES, TensorEntry

__all__ = ["ALIGN", "ELIDED", "FlatState", "check_tensor", "copy_into", "dtensor_type", "flatten", "restore_into"]

logger = logging.getLogger(__name__)

ALIGN = 64
"""Every tensor's offset in the data buffer is a multiple of this."""
ELIDED = "\0snapshotd.elided"
"""The key of the marker dict that stands in a snapshot for a tensor another rank of its replica group kept:
``{ELIDED: [keeper, dtype, shape]}`` (see :mod:`snapshotd.client.replicas`)."""

FORMAT_VERSION = 1
MAX_DEPTH = 32
"""Deepest nesting of containers in a state (deeper is almost surely a reference cycle). It also bounds the
recursion of decoding nested ext types, each level of which takes ~40 KiB of C stack inside msgpack."""

_STATEFUL, _PLAIN = 0, 1
_EXT_TENSOR, _EXT_DTENSOR, _EXT_TUPLE, _EXT_SIZE, _EXT_ODICT, _EXT_NDARRAY, _EXT_NPSCALAR = range(1, 8)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_KEY_TYPES = (str, int, float, bool, type(None), bytes)
_SCALAR_TYPES = frozenset({str, float, bool, type(None), bytes})
_DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, n): n for n in DTYPE_SIZES if hasattr(torch, n)}
_TORCH_DTYPES: dict[str, torch.dtype] = {n: d for d, n in _DTYPE_NAMES.items()}
_MAX_ELEMENT = max(DTYPE_SIZES.values())

Path = tuple[Any, ...]
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FlatState:
    """One capture of a state: what to copy where, and the non-tensor rest.

    ``tensors`` alias the live state (detached; a DTensor contributes its local shard), so their values are
    those at the time :func:`copy_into` runs, not at the time of :func:`flatten`.
    """

    entries: list[TensorEntry]
    """The tensor table, in the order of ``tensors``; offsets aligned to :data:`ALIGN` bytes."""
    tensors: list[torch.Tensor]
    meta: bytes
    """msgpack of the whole structure with tensors replaced by placeholders (see the module docstring)."""
    data_bytes: int
    """Size of the data buffer the entries need."""
    layout: Layout
    """``(path, dtype, shape)`` of every entry: equal layouts mean equal tables."""


def _where(keys: Path) -> str:
    return "state" + "".join(f"[{k!r}]" for k in keys)


def _unsupported(keys: Path, what: str) -> TypeError:
    return TypeError(
        f"{_where(keys)}: cannot snapshot {what} "
        "(snapshotd carries tensors and msgpack data only, never pickle)"
    )


def dtensor_type() -> Any:
    """DTensor's class if ``torch.distributed.tensor`` is loaded (no DTensor can exist before), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _plain_dtype(dt: np.dtype) -> bool:
    return not dt.hasobject and dt.fields is None and dt.subdtype is None and dt.itemsize > 0


class _Flattener:
    """One walk over a state: collects tensors and turns the rest into msgpack-ready values."""

    __slots__ = ("dtensor", "specs", "tensors")

    def __init__(self) -> None:
        self.dtensor = dtensor_type()
        self.tensors: list[torch.Tensor] = []
        self.specs: list[tuple[str, str, tuple[int, ...]]] = []

    def value(self, v: Any, keys: Path) -> Any:
        t = type(v)
        if t in _SCALAR_TYPES:
            return v
        if t is int:
            if _INT_MIN <= v <= _INT_MAX:
                return v
            raise _unsupported(keys, "an int outside 64 bits")
        if isinstance(v, torch.Tensor):
            return self.tensor(v, keys)
        if len(keys) > MAX_DEPTH:
            raise _unsupported(keys, f"a structure deeper than {MAX_DEPTH} levels (a reference cycle?)")
        if t is dict:
            return self.mapping(v, keys)
        if t is list:
            return [self.value(x, (*keys, i)) for i, x in enumerate(v)]
        if t is tuple:
            items = [self.value(x, (*keys, i)) for i, x in enumerate(v)]
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(items))
        if t is collections.OrderedDict:
            return msgpack.ExtType(_EXT_ODICT, msgpack.packb(self.mapping(v, keys)))
        if t is torch.Size:
            return msgpack.ExtType(_EXT_SIZE, msgpack.packb(list(v)))
        if t is np.ndarray and _plain_dtype(v.dtype):
            return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb([v.dtype.str, list(v.shape), v.tobytes()]))
        if isinstance(v, np.generic) and _plain_dtype(v.dtype):
            return msgpack.ExtType(_EXT_NPSCALAR, msgpack.packb([v.dtype.str, v.tobytes()]))
        raise _unsupported(keys, f"a value of type {t.__name__}")

    def mapping(self, v: Mapping[Any, Any], keys: Path) -> dict[Any, Any]:
        out = {}
        for k, x in v.items():
            if type(k) not in _KEY_TYPES or (type(k) is int and not _INT_MIN <= k <= _INT_MAX):
                raise _unsupported(keys, f"a dict key {k!r} of type {type(k).__name__}")
            out[k] = self.value(x, (*keys, k))
        return out

    def tensor(self, v: torch.Tensor, keys: Path) -> msgpack.ExtType:
        code = _EXT_TENSOR
        if self.dtensor is not None and isinstance(v, self.dtensor):
            v, code = v.to_local(), _EXT_DTENSOR
        name = check_tensor(v, keys)
        index = len(self.tensors)
        self.tensors.append(v.detach())
        self.specs.append(("/".join(map(str, keys)), name, tuple(v.shape)))
        return msgpack.ExtType(code, index.to_bytes(4, "big"))


def check_tensor(v: torch.Tensor, keys: Path) -> str:
    """The dtype name of a (local) tensor that snapshots can carry.

    Raises:
        TypeError: a layout, dtype or device they cannot, naming ``keys``.
    """
    if v.layout != torch.strided:
        raise _unsupported(keys, f"a tensor with layout {v.layout}")
    name = _DTYPE_NAMES.get(v.dtype)
    if name is None:
        raise _unsupported(keys, f"a tensor of dtype {v.dtype}")
    if v.is_meta:
        raise _unsupported(keys, "a tensor on the meta device")
    return name


def _has_marker(tree: Any, depth: int = 0) -> bool:
    """Whether a decoded tree holds a :data:`ELIDED` marker (a tensor another rank of a replica group kept)."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(tree, dict):
        return ELIDED in tree or any(_has_marker(v, depth + 1) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_marker(v, depth + 1) for v in tree)
    return False


@functools.lru_cache(maxsize=8)
def _table(layout: Layout) -> tuple[Layout, tuple[TensorEntry, ...], int]:
    """The layout (so that equal layouts of later steps are one object), its table and data size.

    Cached, since the layout rarely changes between steps.
    """
    entries = []
    offset = end = 0
    for path, dtype, shape in layout:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        entries.append(TensorEntry(path, dtype, shape, offset, nbytes))
        end = offset + nbytes
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, tuple(entries), end


def flatten(state: Mapping[str, Any]) -> FlatState:
    """Walk ``state`` once: call ``state_dict()`` on Statefuls, collect tensors, encode everything else.

    Args:
        state: str keys to Stateful objects (``state_dict()`` / ``load_state_dict()``), tensors, NumPy
            arrays, or nested dict / list / tuple of those and plain data.

    Returns:
        The :class:`FlatState`. Its tensors alias the live state; its entries are never shared with another
        FlatState.

    Raises:
        TypeError: for a value that msgpack cannot carry and that is not a tensor, tuple, ``torch.Size``,
            ``OrderedDict``, or NumPy array / scalar of a plain dtype; the message names its key path.
        ValueError: for a state over the protocol's limits (tensor count, bytes, meta size).
    """
    walk = _Flattener()
    top: dict[str, list[Any]] = {}
    for key, value in state.items():
        if type(key) is not str:
            raise TypeError(f"state keys must be str, got {key!r}")
        if not isinstance(value, torch.Tensor) and _is_stateful(value):
            top[key] = [_STATEFUL, walk.value(value.state_dict(), (key,))]
        else:
            top[key] = [_PLAIN, walk.value(value, (key,))]
    if len(walk.tensors) > L.MAX_TENSORS:
        raise ValueError(f"the state holds {len(walk.tensors)} tensors, at most {L.MAX_TENSORS}")
    layout, entries, data_bytes = _table(tuple(walk.specs))
    if data_bytes > L.MAX_SNAPSHOT_BYTES:
        raise ValueError(f"the state's tensors take {data_bytes} bytes, at most {L.MAX_SNAPSHOT_BYTES}")
    meta = msgpack.packb([FORMAT_VERSION, top])
    if len(meta) > L.MAX_META_BYTES:
        raise ValueError(f"the state's non-tensor data packs to {len(meta)} B, at most {L.MAX_META_BYTES}")
    return FlatState(list(entries), walk.tensors, meta, data_bytes, layout)


def _check_buffer(buf: torch.Tensor, need: int, name: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D uint8 tensor, got {buf.dtype} {list(buf.shape)}")
    if buf.numel() < need:
        raise ValueError(f"{name} holds {buf.numel()} bytes, the table needs {need}")
    if buf.storage_offset() % _MAX_ELEMENT:
        raise ValueError(f"{name} must start at a multiple of {_MAX_ELEMENT} bytes of its storage")


class _DstViews:
    """Typed views of a destination buffer, one per entry, kept as long as that buffer object lives.

    Building views costs more than copying a small tensor, and a Snapshotter copies into the same few slots
    every step with an unchanged layout. Views are cached per ``dst`` object (by id, confirmed by a weak
    reference and the data pointer) and dropped by a finalizer when ``dst`` is collected, so they never keep
    memory alive longer than ``dst`` itself does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], int, Layout, list[torch.Tensor | None]]] = {}

    def get(self, flat: FlatState, dst: torch.Tensor) -> list[torch.Tensor | None]:
        key, ptr = id(dst), dst.data_ptr()
        with self._lock:
            hit = self._cache.get(key)
        alive = hit is not None and hit[0]() is dst
        if alive and hit[1] == ptr and (hit[2] is flat.layout or hit[2] == flat.layout):  # type: ignore
            return hit[3]  # type: ignore
        views = [
            dst[e.offset : e.offset + e.nbytes].view(_TORCH_DTYPES[e.dtype]).view(e.shape)
            if e.nbytes
            else None
            for e in flat.entries
        ]
        ref = weakref.ref(dst)
        with self._lock:
            self._cache[key] = (ref, ptr, flat.layout, views)
        if not alive:
            weakref.finalize(dst, self._drop, key, ref)
        return views

    def _drop(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] is ref:
                del self._cache[key]


_dst_views = _DstViews()


def copy_into(
    flat: FlatState, dst: torch.Tensor, *, only: Sequence[int] | None = None, non_blocking: bool = False
) -> None:
    """Copy every tensor of ``flat`` into ``dst[offset : offset + nbytes]``: one ``copy_`` per tensor, any
    strides, no intermediate copy.

    Args:
        flat: from :func:`flatten`; its tensors are read now.
        dst: a contiguous 1-D uint8 CPU tensor (e.g. a view of a shared-memory slot) of at least
            ``flat.data_bytes`` bytes, starting at a multiple of 16 bytes of its storage. Bytes between
            entries are left as they are. Views of it are cached while this tensor object lives: pass the same
            object every step.
        only: indices into ``flat.tensors`` to copy (default: all).
        non_blocking: passed to ``copy_`` (CUDA sources into page-locked ``dst``; call on the copy stream).

    Raises:
        ValueError: if ``dst`` is not such a tensor.
    """
    _check_buffer(dst, flat.data_bytes, "dst")
    views = _dst_views.get(flat, dst)
    for i in range(len(views)) if only is None else only:
        view = views[i]
        if view is not None:
            view.copy_(flat.tensors[i], non_blocking=non_blocking)


@dataclasses.dataclass(slots=True)  # eq without frozen: unhashable, so a placeholder can never be a dict key
class _Ref:
    index: int
    dtensor: bool


class _Decoder:
    """msgpack decoding of ``meta`` with the ext types of the module docstring; raises on anything else."""

    __slots__ = ("count", "depth")

    def __init__(self, count: int) -> None:
        self.count = count
        self.depth = 0

    def unpack(self, buf: bytes | memoryview) -> Any:
        return msgpack.unpackb(buf, ext_hook=self.ext, raw=False, strict_map_key=False)

    def ext(self, code: int, data: bytes) -> Any:
        if code in (_EXT_TENSOR, _EXT_DTENSOR):
            index = int.from_bytes(data, "big")
            if len(data) != 4 or index >= self.count:
                raise ValueError(f"tensor placeholder {index} is outside the table of {self.count}")
            return _Ref(index, code == _EXT_DTENSOR)
        if self.depth >= MAX_DEPTH:
            raise ValueError(f"ext types nest deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            obj = self.unpack(data)
        finally:
            self.depth -= 1
        if code == _EXT_TUPLE and type(obj) is list:
            return tuple(obj)
        if code == _EXT_SIZE and type(obj) is list and all(type(d) is int for d in obj):
            return torch.Size(obj)
        if code == _EXT_ODICT and type(obj) is dict:
            return collections.OrderedDict(obj)
        if code == _EXT_NDARRAY and type(obj) is list and len(obj) == 3:
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
        if code == _EXT_NPSCALAR and type(obj) is list and len(obj) == 2:
            dt, raw = _np_dtype(obj[0]), obj[1]
            if type(raw) is not bytes or len(raw) != dt.itemsize:
                raise ValueError("bad NumPy scalar")
            return np.frombuffer(raw, dt)[0]
        raise ValueError(f"unknown or malformed ext type {code}")


def _np_dtype(s: Any) -> np.dtype:
    if type(s) is not str:
        raise ValueError("bad NumPy dtype")
    dt = np.dtype(s)
    if not _plain_dtype(dt):
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
            raise ValueError(
                f"{_where(keys)}: the snapshot holds a DTensor shard but the live state has no DTensor here "
                "(only an optimizer's state shaped like its parameter can be rebuilt from the parameter's layout)"
            )
        return self.dtensor.from_local(src.clone(), like.device_mesh, like.placements, run_check=False,  # type: ignore[union-attr]
                                       shape=like.shape, stride=like.stride())  # fmt: skip

    def tensor(self, ref: _Ref, cur: Any, keys: Path, strict: bool) -> Any:
        e = self.entries[ref.index]
        if e.path != "/".join(map(str, keys)):
            raise ValueError(f"{_where(keys)}: the table names {e.path!r} here; table and meta do not match")
        dtype = _TORCH_DTYPES[e.dtype]
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
            raise ValueError(
                f"{_where(keys)}: snapshot holds {e.dtype} {list(e.shape)}, the live value is {live}"
            )
        return src.clone()

    def merge(self, node: Any, cur: Any, keys: Path, inplace: bool) -> Any:
        """The restored value of ``node``; containers of ``cur`` are updated in place when ``inplace``."""
        t = type(node)
        if t is _Ref:
            return self.tensor(node, cur, keys, strict=False)
        if len(keys) > MAX_DEPTH:
            raise ValueError(f"{_where(keys)}: snapshot meta nests deeper than {MAX_DEPTH} levels")
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
    """Load a snapshot into ``state`` in place: the inverse of :func:`flatten` + :func:`copy_into`.

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
    _check_buffer(data, 0, "data")
    for e in entries:
        size = DTYPE_SIZES.get(e.dtype)
        if e.dtype not in _TORCH_DTYPES or size is None or e.nbytes != math.prod(e.shape) * size:
            raise ValueError(f"tensor table entry {e.path!r}: bad dtype or size")
        if e.offset < 0 or e.offset % size or e.offset + e.nbytes > data.numel():
            raise ValueError(f"tensor table entry {e.path!r}: byte range outside the data or misaligned")
    if memoryview(meta).nbytes > L.MAX_META_BYTES:
        raise ValueError(f"snapshot meta is over {L.MAX_META_BYTES} bytes")
    try:
        decoded = _Decoder(len(entries)).unpack(meta)
    except Exception as exc:
        raise ValueError(f"malformed snapshot meta: {exc}") from exc
    if (
        type(decoded) is not list
        or len(decoded) != 2
        or decoded[0] != FORMAT_VERSION
        or type(decoded[1]) is not dict
    ):
        raise ValueError("malformed snapshot meta: not [version 1, {key: [kind, tree]}]")
    top: dict[Any, Any] = decoded[1]
    if any(type(v) is not list or len(v) != 2 or v[0] not in (_STATEFUL, _PLAIN) for v in top.values()):
        raise ValueError("malformed snapshot meta: a top-level value is not [kind, tree]")
    missing, extra = [k for k in state if k not in top], [k for k in top if k not in state]
    if missing or extra:
        raise ValueError(
            f"snapshot does not match the state: state keys missing {missing}, extra keys {extra}"
        )

    for key, value in state.items():
        if not getattr(value, "fills_markers", False) and _has_marker(top[key][1]):
            raise ValueError(f"{_where((key,))} was snapshotted with replicated=, each rank keeping part of it: "
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
            stateful = not isinstance(value, torch.Tensor) and _is_stateful(value)
            if kind != (_STATEFUL if stateful else _PLAIN):
                raise ValueError(f"{_where(keys)}: snapshot and state disagree on whether this is Stateful")
            if isinstance(value, torch.Tensor):
                if type(tree) is not _Ref:
                    raise ValueError(f"{_where(keys)}: the snapshot holds no tensor here")
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
                        raise ValueError(f"{_where(keys)}: cannot replace this value in a read-only mapping")
                    state[key] = restored
    logger.debug("restored %d tensors into %d state keys", len(entries), len(state))
