"""Writing a rank's snapshot: flatten its state into a tensor table, a data buffer and a msgpack blob.

The format is :mod:`snapshotd.snapshot_format`'s; :mod:`.load` reads a snapshot back into a live state.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
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

__all__ = [
    "FlatState",
    "TableCache",
    "Walk",
    "array_header",
    "check_key",
    "check_tensor",
    "finish",
    "flatten",
    "map_header",
    "top_part",
]


@dataclasses.dataclass(frozen=True, slots=True)
class FlatState:
    """One capture of a state: what to copy where, and the non-tensor rest.

    ``tensors`` alias the live state (detached where they require grad, so a parameter whose ``.data`` is replaced
    after :func:`flatten` is still read from the storage it had; a DTensor contributes its local shard), so their
    values are those at the time :func:`~.copies.copy_into` runs, not at the time of :func:`flatten`.
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
    owned: tuple[int, ...] = ()
    """Indices of ``tensors`` that nothing else holds (fresh copies, as :class:`~.rng.RNGState`'s generator
    states): their values cannot change after :func:`flatten`, so they may be copied whenever."""


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


def _all_ints(v: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every item of ``v`` is an int, not a subclass (one C-level pass: it may hold thousands)."""
    return operator.countOf(map(type, v), int) == len(v)


def _ints(v: list[Any]) -> bool:
    """Whether ``v`` holds only ints within 64 bits."""
    return not v or (_all_ints(v) and min(v) >= INT_MIN and max(v) <= INT_MAX)


class Walk:
    """One walk over a state: collects tensors and turns the rest into msgpack-ready values.

    It runs in ``capture()`` on the training thread, once per tensor and value of the state, so the common cases
    (plain scalars in dicts and lists, tensors) take the shortest path; key paths are built only where a value
    needs them (a tensor's, or an error's).
    """

    __slots__ = ("dtensor", "owned", "specs", "tensors")

    def __init__(self) -> None:
        self.dtensor = dtensor_type()
        self.tensors: list[torch.Tensor] = []
        self.specs: list[tuple[Path, str, tuple[int, ...]]] = []
        self.owned: list[int] = []
        """See :attr:`FlatState.owned`."""

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
            if not v or _all_ints(v):  # the state of Python's random module: packed as it is
                # msgpack takes exactly the 64-bit range: an int outside it is named by the walk below
                with contextlib.suppress(OverflowError):
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

    # Partial, _StridedShard (FSDP2 + TP): not one block
    if any(type(p) not in (Shard, Replicate) for p in placements):
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
    walk = Walk()
    parts = []
    for key, value in state.items():
        check_key(key)
        if not isinstance(value, torch.Tensor) and is_stateful(value):
            parts.append(top_part(key, STATEFUL, msgpack.packb(walk.value(value.state_dict(), (key,)))))
        else:
            parts.append(top_part(key, PLAIN, msgpack.packb(walk.value(value, (key,)))))
    return finish(walk, parts, None)[0]


def check_key(key: Any) -> None:
    """Raises TypeError: ``key`` is no top-level key of a state (not a str)."""
    if type(key) is not str:
        raise TypeError(f"state keys must be str, got {key!r}")


def top_part(key: str, kind: int, packed: bytes) -> bytes:
    """msgpack of one top-level entry of ``meta``: ``key`` and ``[kind, tree]``, the tree packed already."""
    return _top_head(key, kind) + packed


@functools.lru_cache(maxsize=1024)
def _top_head(key: str, kind: int) -> bytes:
    """What precedes a top-level entry's tree (the same few every capture: cached)."""
    return msgpack.packb(key) + b"\x92" + msgpack.packb(kind)  # type: ignore[no-any-return]


TableCache = tuple[list[Any], Layout, tuple[TensorEntry, ...], int]
"""A walk's table rows and the layout, table and data size made of them, to reuse while the rows are equal."""


def finish(walk: Walk, parts: list[bytes], last: TableCache | None) -> tuple[FlatState, TableCache]:
    """The FlatState of a finished walk whose top-level entries are ``parts``, and its table for the next one
    (``last``: the previous one's, reused while the rows are the same: compared element by element, identical
    rows first, no hashing).

    Raises:
        ValueError: the state is over the protocol's limits (tensor count, bytes, meta size).
    """
    if len(walk.tensors) > L.MAX_TENSORS:
        raise ValueError(f"the state holds {len(walk.tensors)} tensors, at most {L.MAX_TENSORS}")
    table = last if last is not None and walk.specs == last[0] else (walk.specs, *_table(tuple(walk.specs)))
    _, layout, entries, data_bytes = table
    if data_bytes > L.MAX_SNAPSHOT_BYTES:
        raise ValueError(f"the state's tensors take {data_bytes} bytes, at most {L.MAX_SNAPSHOT_BYTES}")
    meta = b"\x92" + msgpack.packb(FORMAT_VERSION) + map_header(len(parts)) + b"".join(parts)
    if len(meta) > L.MAX_META_BYTES:
        raise ValueError(f"the state's non-tensor data packs to {len(meta)} B, at most {L.MAX_META_BYTES}")
    return FlatState(list(entries), walk.tensors, meta, data_bytes, layout, tuple(walk.owned)), table


def map_header(n: int) -> bytes:
    """msgpack's header of a map of ``n`` entries (its packing is this, then each key and value packed)."""
    return _header(n, 0x80, 0xDE)


def array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items (its packing is this, then each item packed)."""
    return _header(n, 0x90, 0xDC)


def _header(n: int, fix: int, short: int) -> bytes:
    if n < 16:
        return bytes((fix | n,))
    if n < 1 << 16:
        return bytes((short,)) + n.to_bytes(2, "big")
    return bytes((short + 1,)) + n.to_bytes(4, "big")
