"""Writing a rank's snapshot: flatten its state into a tensor table, a data buffer and a msgpack blob.

The format is :mod:`snapshotd.snapshot_format`'s; :mod:`.load` reads a snapshot back into a live state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import torch

from snapshotd.snapshot_format import (
    ALIGN,
    DTYPE_NAMES,
    EXT_DTENSOR,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    FORMAT_VERSION,
    INT_MAX,
    INT_MIN,
    KEY_TYPES,
    MAX_DEPTH,
    PLAIN,
    SCALAR_TYPES,
    STATEFUL,
    Layout,
    Path,
    dtensor_type,
    is_stateful,
    plain_dtype,
    where,
)

from ..proto import limits as L
from ..proto.manifest import DTYPE_SIZES, TensorEntry

__all__ = ["FlatState", "StateWalker", "check_tensor", "flatten"]


@dataclasses.dataclass(frozen=True, slots=True)
class FlatState:
    """One capture of a state: what to copy where, and the non-tensor rest.

    ``tensors`` alias the live state (detached where they require grad; a DTensor contributes its local shard), so their values are
    those at the time :func:`~.copies.copy_into` runs, not at the time of :func:`flatten`.
    """

    entries: list[TensorEntry]
    """The tensor table, in the order of ``tensors``; offsets aligned to :data:`ALIGN` bytes."""
    tensors: list[torch.Tensor]
    meta: bytes
    """msgpack of the whole structure with tensors replaced by placeholders (see the module docstring)."""
    data_bytes: int
    """Size of the data buffer the entries need."""
    layout: Layout
    """``(key path, dtype, shape)`` of every entry: equal layouts mean equal tables."""


def _unsupported(keys: Path, what: str) -> TypeError:
    return TypeError(
        f"{where(keys)}: cannot snapshot {what} "
        "(snapshotd carries tensors and msgpack data only, never pickle)"
    )


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """An ExtType without ``ExtType.__new__``'s type checks (the walk builds its code and data itself)."""
    return tuple.__new__(msgpack.ExtType, (code, data))  # type: ignore[no-any-return]


def _plain(x: Any) -> bool:
    """Whether ``x`` goes into msgpack as it is (a scalar, or an int within 64 bits)."""
    t = type(x)
    return t in SCALAR_TYPES or (t is int and INT_MIN <= x <= INT_MAX)


def _ints(v: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``v`` holds only ints within 64 bits (C-level loops: it may hold thousands)."""
    return not v or (set(map(type, v)) == {int} and min(v) >= INT_MIN and max(v) <= INT_MAX)


class _Flattener:
    """One walk over a state: collects tensors and turns the rest into msgpack-ready values.

    It runs in ``capture()`` on the training thread, once per tensor and value of the state, so the common cases
    (plain scalars in dicts and lists, tensors) take the shortest path; key paths are built only where a value
    needs them (a tensor's, or an error's).
    """

    __slots__ = ("dtensor", "specs", "tensors")

    def __init__(self) -> None:
        self.dtensor = dtensor_type()
        self.tensors: list[torch.Tensor] = []
        self.specs: list[tuple[Path, str, tuple[int, ...]]] = []

    def value(self, v: Any, keys: Path) -> Any:
        t = type(v)
        if t in SCALAR_TYPES:
            return v
        if t is int:
            if INT_MIN <= v <= INT_MAX:
                return v
            raise _unsupported(keys, "an int outside 64 bits")
        if isinstance(v, torch.Tensor):
            return self.tensor(v, keys)
        if len(keys) > MAX_DEPTH:
            raise _unsupported(keys, f"a structure deeper than {MAX_DEPTH} levels (a reference cycle?)")
        if t is dict:
            return self.mapping(v, keys)
        if t is list:
            if _ints(v):
                return v  # an optimizer's parameter indices: packed as they are (flatten packs before it returns)
            return [x if _plain(x) else self.value(x, (*keys, i)) for i, x in enumerate(v)]
        if t is tuple:
            if _ints(v):  # the state of Python's random module: packed as it is
                return _ext(EXT_TUPLE, msgpack.packb(v))
            items = [x if _plain(x) else self.value(x, (*keys, i)) for i, x in enumerate(v)]
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items))
        if t is collections.OrderedDict:
            return msgpack.ExtType(EXT_ODICT, msgpack.packb(self.mapping(v, keys)))
        if t is torch.Size:
            return msgpack.ExtType(EXT_SIZE, msgpack.packb(list(v)))
        if t is np.ndarray and plain_dtype(v.dtype):
            return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([v.dtype.str, list(v.shape), v.tobytes()]))
        if isinstance(v, np.generic) and plain_dtype(v.dtype):
            return msgpack.ExtType(EXT_NPSCALAR, msgpack.packb([v.dtype.str, v.tobytes()]))
        raise _unsupported(keys, f"a value of type {t.__name__}")

    def mapping(self, v: Mapping[Any, Any], keys: Path) -> dict[Any, Any]:
        out = {}
        for k, x in v.items():
            if type(k) not in KEY_TYPES or (type(k) is int and not INT_MIN <= k <= INT_MAX):
                raise _unsupported(keys, f"a dict key {k!r} of type {type(k).__name__}")
            if type(x) is torch.Tensor:
                out[k] = self.tensor(x, (*keys, k))
            else:
                out[k] = x if _plain(x) else self.value(x, (*keys, k))
        return out

    def tensor(self, v: torch.Tensor, keys: Path) -> msgpack.ExtType:
        code, place = EXT_TENSOR, b""
        if self.dtensor is not None and isinstance(v, self.dtensor):
            local = v.to_local()
            place = _global_place(tuple(v.shape), v.device_mesh, tuple(v.placements), tuple(local.shape))
            v, code = local, EXT_DTENSOR
        name = check_tensor(v, keys)
        index = len(self.tensors)
        self.tensors.append(v.detach() if v.requires_grad else v)
        self.specs.append((keys, name, tuple(v.shape)))
        return _ext(code, index.to_bytes(4, "big") + place)


@functools.lru_cache(maxsize=4096)
def _global_place(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], local: tuple[int, ...]
) -> bytes:
    """msgpack of ``[global shape, global offset]`` of this rank's shard (of shape ``local``) of a DTensor laid out
    so, or of ``nil`` when its local values may not be one block of the global tensor (a placement other than
    ``Shard`` and ``Replicate``, such as ``Partial`` or the strided shards of FSDP2 over tensor parallelism, or
    a layout whose computed shard shape is not the real one). Cached: a DTensor's layout does not change between
    steps, and each capture would otherwise compute it again for every DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(
        type(p) not in (Shard, Replicate) for p in placements
    ):  # Partial, _StridedShard (FSDP2 + TP): not one block
        return msgpack.packb(None)
    computed, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(computed) != local:
        return msgpack.packb(None)
    return msgpack.packb([list(shape), list(offset)])


def check_tensor(v: torch.Tensor, keys: Path) -> str:
    """The dtype name of a (local) tensor that snapshots can carry.

    Raises:
        TypeError: a layout, dtype or device they cannot, naming ``keys``.
    """
    if v.layout != torch.strided:
        raise _unsupported(keys, f"a tensor with layout {v.layout}")
    name = DTYPE_NAMES.get(v.dtype)
    if name is None:
        raise _unsupported(keys, f"a tensor of dtype {v.dtype}")
    if v.is_meta:
        raise _unsupported(keys, "a tensor on the meta device")
    return name


@functools.lru_cache(maxsize=8)
def _table(layout: Layout) -> tuple[Layout, tuple[TensorEntry, ...], int]:
    """The layout (so that equal layouts of later steps are one object), its table and data size.

    Cached, since the layout rarely changes between steps.
    """
    entries = []
    offset = end = 0
    for keys, dtype, shape in layout:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        entries.append(TensorEntry("/".join(map(str, keys)), dtype, shape, offset, nbytes))
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
    return StateWalker().flatten(state)


_SHAPE, _DTYPE, _GRAD = (operator.attrgetter(a) for a in ("shape", "dtype", "requires_grad"))
_OPTIMIZER_KEYS = ("state", "param_groups")
_OPTIMIZER_HEAD = b"\x82" + msgpack.packb("state")
_GROUPS_KEY = msgpack.packb("param_groups")


def _header(n: int, fix: int, short: int) -> bytes:
    """msgpack's header of an array (``fix`` 0x90, ``short`` 0xdc) or map (0x80, 0xde) of ``n`` items."""
    if n < 16:
        return bytes((fix | n,))
    if n < 1 << 16:
        return bytes((short,)) + n.to_bytes(2, "big")
    return bytes((short + 1,)) + n.to_bytes(4, "big")


@dataclasses.dataclass(slots=True)
class _Memo:
    """What the last walk of one top-level Stateful found, for a state dict of one of two shapes: ``tensors`` (a
    mapping of tensors, as a module's) or ``optimizer`` (``{"state": {index: {name: tensor}}, "param_groups":
    [...]}``, as a ``torch.optim.Optimizer``'s once every parameter has its state)."""

    kind: str
    sd_type: type[Any]
    keys: tuple[Any, ...]
    """The state dict's keys (``optimizer``: those of its ``state``)."""
    inner: list[tuple[Any, ...]]
    """``optimizer``: the keys of each parameter's state."""
    start: int
    """The table index of its first tensor."""
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    specs: list[tuple[Path, str, tuple[int, ...]]]
    packed: bytes
    """msgpack of its tree (``optimizer``: of its ``state``)."""
    last: list[torch.Tensor]
    """The tensors it last matched."""

    def matches(self, tensors: list[Any]) -> bool:
        """Whether ``tensors`` are plain tensors of the dtypes and shapes seen that need no detach (C-level loops
        only; where they live is the stager's business). The very tensor objects seen last time match at once
        (an optimizer's moments are the same objects from step to step; nothing changes a tensor's dtype or shape
        in place but ``set_`` and ``resize_``)."""
        if len(tensors) != len(self.dtypes):
            return False
        if all(map(operator.is_, tensors, self.last)):
            return True
        if tensors and not (
            set(map(type, tensors)) == {torch.Tensor}
            and list(map(_DTYPE, tensors)) == self.dtypes
            and list(map(_SHAPE, tensors)) == self.shapes
            and not any(map(_GRAD, tensors))
        ):
            return False
        self.last = tensors
        return True


def _plain_tensors(values: list[Any]) -> bool:
    """Whether every one of ``values`` is a plain tensor (no subclass, no DTensor) that needs no detach."""
    return all(type(v) is torch.Tensor and not v.requires_grad for v in values)


class StateWalker:
    """Flattens the same state capture after capture, like :func:`flatten`, with the same result byte for byte.

    A full walk costs a few microseconds per tensor in Python, which at a thousand tensors passes a millisecond
    on the training thread. Between two steps the big values keep their structure: a module's state dict names
    the same tensors, an optimizer's per-parameter state holds the same moments. For each top-level Stateful
    whose state dict has one of those shapes, the walker keeps the packed bytes of its tensor part and its table
    rows, and the next capture checks the new state dict against them with C-level loops over its tensors (type,
    dtype, shape) instead of walking it. Every other value, and one whose check fails, is walked in full.
    """

    def __init__(self) -> None:
        self._memos: dict[str, _Memo] = {}
        self._table: tuple[list[Any], Layout, tuple[TensorEntry, ...], int] | None = None

    def flatten(self, state: Mapping[str, Any]) -> FlatState:
        """:func:`flatten` of ``state`` (same arguments, result and errors)."""
        walk = _Flattener()
        parts = []
        for key, value in state.items():
            if type(key) is not str:
                raise TypeError(f"state keys must be str, got {key!r}")
            if not isinstance(value, torch.Tensor) and is_stateful(value):
                sd = value.state_dict()
                packed = self._reuse(key, sd, walk)
                if packed is None:
                    packed = self._walk(key, sd, walk)
                parts.append(msgpack.packb(key) + b"\x92" + msgpack.packb(STATEFUL) + packed)
            else:
                self._memos.pop(key, None)
                parts.append(
                    msgpack.packb(key)
                    + b"\x92"
                    + msgpack.packb(PLAIN)
                    + msgpack.packb(walk.value(value, (key,)))
                )
        if len(walk.tensors) > L.MAX_TENSORS:
            raise ValueError(f"the state holds {len(walk.tensors)} tensors, at most {L.MAX_TENSORS}")
        last = self._table
        if last is not None and walk.specs == last[0]:  # element by element, identical rows first: no hashing
            _, layout, entries, data_bytes = last
        else:
            layout, entries, data_bytes = _table(tuple(walk.specs))
            self._table = (walk.specs, layout, entries, data_bytes)
        if data_bytes > L.MAX_SNAPSHOT_BYTES:
            raise ValueError(f"the state's tensors take {data_bytes} bytes, at most {L.MAX_SNAPSHOT_BYTES}")
        meta = b"\x92" + msgpack.packb(FORMAT_VERSION) + _header(len(parts), 0x80, 0xDE) + b"".join(parts)
        if len(meta) > L.MAX_META_BYTES:
            raise ValueError(
                f"the state's non-tensor data packs to {len(meta)} B, at most {L.MAX_META_BYTES}"
            )
        return FlatState(list(entries), walk.tensors, meta, data_bytes, layout)

    def _reuse(self, key: str, sd: Any, walk: _Flattener) -> bytes | None:
        """The packed tree of ``sd`` from the memo of ``key``, its tensors added to ``walk``; None when ``sd`` no
        longer matches it."""
        memo = self._memos.get(key)
        if memo is None or memo.start != len(walk.tensors) or type(sd) is not memo.sd_type:
            return None
        if memo.kind == "tensors":
            if len(sd) != len(memo.keys) or tuple(sd) != memo.keys:
                return None
            tensors = list(sd.values())
        else:
            if tuple(sd) != _OPTIMIZER_KEYS:
                return None
            st = sd["state"]
            if type(st) is not dict or tuple(st) != memo.keys:
                return None
            inner = list(st.values())
            if inner and set(map(type, inner)) != {dict}:
                return None
            if list(map(tuple, inner)) != memo.inner:
                return None
            tensors = list(itertools.chain.from_iterable(map(dict.values, inner)))
        if not memo.matches(tensors):
            return None
        walk.tensors.extend(tensors)
        walk.specs.extend(memo.specs)
        if memo.kind == "tensors":
            return memo.packed
        groups = walk.value(sd["param_groups"], (key, "param_groups"))
        return _OPTIMIZER_HEAD + memo.packed + _GROUPS_KEY + msgpack.packb(groups)

    def _walk(self, key: str, sd: Any, walk: _Flattener) -> bytes:
        """Walk ``sd`` in full, remembering it when it has one of the memo's shapes; its packed tree."""
        self._memos.pop(key, None)
        start = len(walk.tensors)
        if type(sd) is dict and tuple(sd) == _OPTIMIZER_KEYS and type(sd["state"]) is dict:
            st = sd["state"]
            inner = list(st.values())
            state_tree = walk.value(st, (key, "state"))
            packed = msgpack.packb(state_tree)
            if all(type(d) is dict for d in inner) and _plain_tensors(
                list(itertools.chain.from_iterable(map(dict.values, inner)))
            ):
                self._remember("optimizer", key, sd, list(st), [tuple(d) for d in inner], start, walk, packed)
            groups = walk.value(sd["param_groups"], (key, "param_groups"))
            return _OPTIMIZER_HEAD + packed + _GROUPS_KEY + msgpack.packb(groups)
        packed = msgpack.packb(walk.value(sd, (key,)))
        if type(sd) in (dict, collections.OrderedDict) and _plain_tensors(list(sd.values())):
            self._remember("tensors", key, sd, list(sd), [], start, walk, packed)
        return packed

    def _remember(
        self,
        kind: str,
        key: str,
        sd: Any,
        keys: list[Any],
        inner: list[tuple[Any, ...]],
        start: int,
        walk: _Flattener,
        packed: bytes,
    ) -> None:
        tensors = walk.tensors[start:]
        self._memos[key] = _Memo(
            kind,
            type(sd),
            tuple(keys),
            inner,
            start,
            list(map(_DTYPE, tensors)),
            list(map(_SHAPE, tensors)),
            walk.specs[start:],
            packed,
            tensors,
        )
