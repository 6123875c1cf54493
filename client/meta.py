"""The snapshot format both directions share: what a rank's snapshot is, and the names that describe it.

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

:mod:`.state` writes snapshots (flatten and copy); :mod:`.load` reads them back into a live state.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from ..proto.manifest import DTYPE_SIZES

__all__ = [
    "ALIGN", "DTYPE_NAMES", "ELIDED", "EXT_DTENSOR", "EXT_NDARRAY", "EXT_NPSCALAR", "EXT_ODICT", "EXT_SIZE",
    "EXT_TENSOR", "EXT_TUPLE", "FORMAT_VERSION", "INT_MAX", "INT_MIN", "KEY_TYPES", "Layout", "MAX_DEPTH",
    "MAX_ELEMENT", "PLAIN", "Path", "READ_VERSIONS", "SCALAR_TYPES", "STATEFUL", "TORCH_DTYPES", "check_buffer",
    "dtensor_type", "is_stateful", "plain_dtype", "where",
]  # fmt: skip

ALIGN = 64
"""Every tensor's offset in the data buffer is a multiple of this."""
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
