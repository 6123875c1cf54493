"""The snapshot format: what a rank's snapshot is, the names that describe it, and its decoding. The client writes
and reads snapshots in it (``snapshotd.client``), and ``snapshotd export`` reads them.

A snapshot of one rank is a :class:`~snapshotd.proto.manifest.TensorEntry` table, one flat byte buffer holding
every tensor at the offset its entry gives (:data:`ALIGN`-byte aligned), and ``meta``: msgpack of the whole
structure with each tensor replaced by a placeholder. Nothing is ever pickled.

``meta`` is ``[FORMAT_VERSION, {key: [kind, tree]}]``, where ``kind`` says whether the live value was Stateful
(:data:`STATEFUL`: ``tree`` is its ``state_dict()``) or a plain value (:data:`PLAIN`). Inside ``tree``, dict
(keys: str, int, float, bool, None, bytes), list, str, int (64-bit), float (float64, NaN and inf included), bool,
None and bytes are msgpack's own; the rest are ext types, so that types survive exactly: 1 a tensor placeholder
(its table index, 4 bytes big-endian), 2 the same for a DTensor's local shard followed, from format 2 on, by msgpack
of its place in the global tensor, ``[global shape, global offset]`` (``nil`` when it has none: a ``Partial``
placement), 3 tuple, 4 ``torch.Size``, 5 ``OrderedDict`` (each packing its items), 6 NumPy array ``[dtype.str,
shape, C-order bytes]``, 7 NumPy scalar ``[dtype.str, bytes]``.

Format versions: 2 (written now) differs from 1 only in that DTensor placeholders carry their global layout, which
an export to a DCP checkpoint needs; a restore reads both (see :data:`READ_VERSIONS`).

:mod:`snapshotd.client.state` writes snapshots; :mod:`snapshotd.client.load` loads them into a live state, and
:mod:`snapshotd.export` into a DCP checkpoint, both decoding ``meta`` with :func:`decode_meta`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from snapshotd.proto import limits as L
from snapshotd.proto.manifest import DTYPE_SIZES, TensorEntry

__all__ = [
    "ALIGN",
    "DDP_KEY",
    "DTYPE_NAMES",
    "ELIDED",
    "EXT_DTENSOR",
    "EXT_NDARRAY",
    "EXT_NPSCALAR",
    "EXT_ODICT",
    "EXT_SIZE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "FORMAT_VERSION",
    "INT_MAX",
    "INT_MIN",
    "KEY_TYPES",
    "Layout",
    "MAX_DEPTH",
    "MAX_ELEMENT",
    "PLAIN",
    "Path",
    "READ_VERSIONS",
    "SCALAR_TYPES",
    "STATEFUL",
    "TORCH_DTYPES",
    "check_buffer",
    "TensorRef",
    "check_table",
    "decode_meta",
    "dtensor_type",
    "is_stateful",
    "plain_dtype",
    "where",
]

ALIGN = 64
"""Every tensor's offset in the data buffer is a multiple of this."""
DDP_KEY = "\0snapshotd.ddp_buckets"
"""The state key under which snapshots carry DDP's gradient bucket layouts (:mod:`snapshotd.client.ddp`; it cannot
clash with a user's key)."""
ELIDED = "\0snapshotd.elided"
"""The key of the marker dict that stands in a snapshot for a tensor another rank of its replica group kept:
``{ELIDED: [keeper, dtype, shape]}`` (see :mod:`snapshotd.client.replicas`)."""

FORMAT_VERSION = 2
"""The format :mod:`.state` writes."""
READ_VERSIONS = (1, 2)
"""The formats :mod:`.load` reads: 1 lacks the global layout of DTensor shards (see the module docstring)."""
MAX_DEPTH = 32
"""Deepest nesting of containers in a state (deeper is almost surely a reference cycle). It also bounds the
recursion of decoding nested ext types, each level of which takes ~40 KiB of C stack inside msgpack."""

STATEFUL, PLAIN = 0, 1
"""The kinds of a top-level value: Stateful (its state dict is snapshotted) or plain."""
EXT_TENSOR, EXT_DTENSOR, EXT_TUPLE, EXT_SIZE, EXT_ODICT, EXT_NDARRAY, EXT_NPSCALAR = range(1, 8)
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
KEY_TYPES = (str, int, float, bool, type(None), bytes)
SCALAR_TYPES = frozenset({str, float, bool, type(None), bytes})
DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, n): n for n in DTYPE_SIZES if hasattr(torch, n)}
TORCH_DTYPES: dict[str, torch.dtype] = {n: d for d, n in DTYPE_NAMES.items()}
MAX_ELEMENT = max(DTYPE_SIZES.values())

Path = tuple[Any, ...]
Layout = tuple[tuple[Path, str, tuple[int, ...]], ...]
"""``(key path, dtype name, shape)`` of every tensor of a capture, in order: equal layouts mean equal tables."""


def where(keys: Path) -> str:
    """``keys`` as the user would write the value's place: ``state['optim']['state'][0]``."""
    return "state" + "".join(f"[{k!r}]" for k in keys)


def dtensor_type() -> Any:
    """DTensor's class if ``torch.distributed.tensor`` is loaded (no DTensor can exist before), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def plain_dtype(dt: np.dtype) -> bool:
    """Whether NumPy values of ``dt`` are plain bytes (no objects, fields or subarrays)."""
    return not dt.hasobject and dt.fields is None and dt.subdtype is None and dt.itemsize > 0


def check_buffer(buf: torch.Tensor, need: int, name: str) -> None:
    """Raise ValueError unless ``buf`` is a contiguous 1-D uint8 tensor of at least ``need`` bytes, starting at a
    multiple of :data:`MAX_ELEMENT` bytes of its storage (so that every entry's typed view is aligned)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D uint8 tensor, got {buf.dtype} {list(buf.shape)}")
    if buf.numel() < need:
        raise ValueError(f"{name} holds {buf.numel()} bytes, the table needs {need}")
    if buf.storage_offset() % MAX_ELEMENT:
        raise ValueError(f"{name} must start at a multiple of {MAX_ELEMENT} bytes of its storage")


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
        self.placed = self.unplaced = (
            0  # DTensor placeholders with and without the global layout (format 2, 1)
        )

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
        raise ValueError(
            f"snapshot meta of format {version!r}: this build reads formats {list(READ_VERSIONS)} "
            "(the snapshot was taken by a newer snapshotd?)"
        )
    if decoder.placed if version == 1 else decoder.unplaced:
        raise ValueError(f"malformed snapshot meta: a DTensor placeholder of another format than {version}")
    top: dict[Any, Any] = decoded[1]
    if any(type(v) is not list or len(v) != 2 or v[0] not in (STATEFUL, PLAIN) for v in top.values()):
        raise ValueError("malformed snapshot meta: a top-level value is not [kind, tree]")
    return version, top
