"""The tensor table of a snapshot: where each tensor's bytes lie in the rank's data buffer.

A snapshot of one rank is three things: this table, a msgpack blob of everything that is not a tensor (opaque
to the sidecar), and one flat data buffer holding every tensor's bytes at the offset the table gives. The table
changes only when a shape or dtype changes, so it travels only then.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import msgpack

from . import limits as L
from .errors import LimitExceeded, MalformedMessage

__all__ = [
    "DTYPE_SIZES",
    "CheckedTables",
    "TensorEntry",
    "decode_table",
    "encode_table",
    "match_entries",
    "table_data_bytes",
]

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
"""Element size in bytes of every dtype a snapshot may hold (torch's names, without the ``torch.`` prefix)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor: its key path in the state (e.g. ``model/layers.0.weight``), dtype, shape, and byte range."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def encode_table(entries: Sequence[TensorEntry]) -> bytes:
    """msgpack form of a table: a list of ``[path, dtype, shape, offset, nbytes]``."""
    return msgpack.packb([[e.path, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries])


def decode_table(buf: bytes | memoryview, data_bytes: int | None = None) -> list[TensorEntry]:
    """Parse and validate a table.

    Checks every entry's dtype, that ``nbytes`` equals the element count times the element size, and (when
    ``data_bytes`` is given) that every range lies inside the data buffer.

    Raises:
        ProtocolError: on any malformed or inconsistent entry.
    """
    if len(buf) > L.MAX_TABLE_BYTES:
        raise LimitExceeded(f"tensor table is {len(buf)} bytes, at most {L.MAX_TABLE_BYTES}")
    try:
        raw = msgpack.unpackb(
            buf,
            raw=False,
            max_array_len=L.MAX_TENSORS,
            max_map_len=0,
            max_str_len=L.MAX_TEXT_LEN,
            max_ext_len=0,
        )
    except Exception as exc:
        raise MalformedMessage(f"tensor table is not valid msgpack: {exc}") from exc
    if type(raw) is not list:
        raise MalformedMessage("tensor table is not a list")
    entries = []
    for i, item in enumerate(raw):
        if type(item) is not list or len(item) != 5:
            raise MalformedMessage(f"tensor table entry {i} is not [path, dtype, shape, offset, nbytes]")
        path, dtype, shape, offset, nbytes = item
        if type(path) is not str or type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise MalformedMessage(f"tensor table entry {i}: bad path or dtype {dtype!r}")
        if type(shape) is not list or len(shape) > L.MAX_TENSOR_NDIM:
            raise MalformedMessage(f"tensor table entry {i} ({path}): bad shape")
        numel = 1
        for d in shape:
            if type(d) is not int or not 0 <= d <= L.MAX_SNAPSHOT_BYTES:
                raise MalformedMessage(f"tensor table entry {i} ({path}): bad dimension {d!r}")
            numel *= d
        if (
            type(offset) is not int
            or type(nbytes) is not int
            or offset < 0
            or nbytes != numel * DTYPE_SIZES[dtype]
        ):
            raise MalformedMessage(f"tensor table entry {i} ({path}): bad offset or size")
        if data_bytes is not None and offset + nbytes > data_bytes:
            raise MalformedMessage(
                f"tensor table entry {i} ({path}) ends past the data buffer ({data_bytes} B)"
            )
        entries.append(TensorEntry(path, dtype, tuple(shape), offset, nbytes))
    return entries


def table_data_bytes(entries: Sequence[TensorEntry]) -> int:
    """The data buffer size a table needs: the end of its last byte range."""
    return max((e.offset + e.nbytes for e in entries), default=0)


def match_entries(snapshot: Sequence[TensorEntry], live: Sequence[TensorEntry]) -> dict[int, int]:
    """Pair each snapshot entry with the live entry of the same path, dtype and shape (index -> index).

    The rule by which a sidecar places a restored snapshot straight into a process's live tensors and by which
    that process knows which of its tensors now hold the snapshot's bytes: both sides call this.
    """
    by_path = {e.path: i for i, e in reversed(list(enumerate(live)))}
    out: dict[int, int] = {}
    for i, e in enumerate(snapshot):
        j = by_path.get(e.path)
        if j is not None and live[j].dtype == e.dtype and live[j].shape == e.shape:
            out[i] = j
    return out


def landing_segments(
    snapshot: Sequence[TensorEntry], live: Sequence[TensorEntry], targets: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Where a snapshot's data lands in a restoring process: ``(start, end, address)`` per snapshot entry with
    bytes, sorted by ``start``. ``address`` is the target (``targets[j]``, one per live entry) of the live entry
    :func:`match_entries` pairs the entry with, or 0 where there is none (the bytes go to the arena slot)."""
    direct = {i: targets[j] for i, j in match_entries(snapshot, live).items() if targets[j]}
    return sorted(
        (e.offset, e.offset + e.nbytes, direct.get(i, 0)) for i, e in enumerate(snapshot) if e.nbytes
    )


class CheckedTables:
    """Tables that passed :func:`decode_table`, remembered (the newest, up to ``max_bytes`` of them), so that the
    table a rank sends with every snapshot is validated once, not at every stream."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self._seen: collections.OrderedDict[tuple[bytes, int | None], None] = collections.OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes

    def check(self, buf: bytes | memoryview, data_bytes: int | None = None) -> None:
        """Validate ``buf`` as :func:`decode_table` does (same errors), at once when it passed before."""
        key = (bytes(buf), data_bytes)
        if key in self._seen:
            self._seen.move_to_end(key)
            return
        decode_table(buf, data_bytes)
        self._seen[key] = None
        self._bytes += len(key[0])
        while self._bytes > self._max_bytes:
            (old, _), _ = self._seen.popitem(last=False)
            self._bytes -= len(old)
