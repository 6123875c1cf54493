"""Chunk codecs and checksums: what a :class:`~snapshotd.proto.messages.Chunk` payload may be encoded with.

A chunk is ``raw`` by default and goes out zero-copy. The other codecs (see DESIGN.md, "Codecs") pay only on
slow links, and the caller decides per stream with :func:`breakeven_rate`:

- ``lz4``: ``lz4.block`` over the bytes (for msgpack blobs; tensors gain nothing).
- ``shuffle-lz4``: byte-shuffle by the element size ``elem`` (byte 0 of every element, then byte 1, ...), then
  lz4. The tail that is not a whole element stays in place, after the shuffled planes.
- ``delta-lz4``: XOR with the same chunk of a *base* snapshot that the receiver holds, byte-shuffle when
  ``elem > 1``, then lz4. Most bytes of a tensor do not change in one optimizer step, so the XOR is mostly
  zeros in the high byte planes.

Every transform is vectorised with numpy; ``lz4.block`` and numpy release the GIL, so codecs may run on worker
threads. Checksums (xxh3-64) always cover the decoded bytes. Nothing here trusts a payload: decoding raises
:class:`~snapshotd.proto.errors.CodecError` and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import lz4.block
import numpy as np
import xxhash

from . import limits as L
from .errors import ChecksumMismatch, CodecError
from .fields import CODECS, Buffer

__all__ = [
    "RunningChecksum",
    "blob_digest",
    "breakeven_rate",
    "checksum",
    "compress_chunk",
    "decompress_chunk",
    "verify",
]

_LZ4_MODE = "default"
"""lz4's default mode (acceleration 1). On shuffled step deltas the faster modes lose about as much in ratio as
they gain in speed, so the link rate at which compression pays does not move, and ``high_compression`` gains a
point or two of ratio for many times the time."""


_PLANE_LOOP_MAX_ELEM = 16


def checksum(buf: Buffer) -> int:
    """xxh3-64 of the bytes of ``buf`` (a C-contiguous buffer), as an unsigned int."""
    return xxhash.xxh3_64_intdigest(buf)


class RunningChecksum:
    """:func:`checksum` of bytes fed in pieces, each while it is still in the CPU's caches: ``update`` them in
    order, then ``value()`` is the checksum of their concatenation."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, piece: Buffer) -> None:
        self._h.update(piece)

    def value(self) -> int:
        return self._h.intdigest()  # type: ignore[no-any-return]


def mismatch(nbytes: int, actual: int, expected: int) -> ChecksumMismatch:
    """The error for ``nbytes`` bytes whose checksum is ``actual`` where ``expected`` was announced."""
    return ChecksumMismatch(f"xxh3-64 of {nbytes} bytes is {actual:#018x}, expected {expected:#018x}")


def blob_digest(table: Buffer, meta: Buffer) -> int:
    """xxh3-64 of a snapshot's tensor table and meta blob together (the table's length first, so that no byte
    can move from one blob to the other unnoticed): what :class:`~snapshotd.proto.StreamBegin` carries as
    ``digest``."""
    h = xxhash.xxh3_64()
    h.update(memoryview(table).nbytes.to_bytes(8, "little"))
    h.update(table)
    h.update(meta)
    return h.intdigest()


def verify(buf: Buffer, expected: int) -> None:
    """Check that ``buf`` hashes to ``expected``.

    Raises:
        ChecksumMismatch: it does not.
    """
    actual = checksum(buf)
    if actual != expected:
        raise mismatch(memoryview(buf).nbytes, actual, expected)


def compress_chunk(
    codec: str, data: Buffer, *, base: Buffer | None = None, elem: int = 1
) -> tuple[str, Buffer]:
    """Encode one chunk with ``codec``, falling back to ``raw`` when that does not make it smaller.

    Args:
        codec: one of :data:`~snapshotd.proto.fields.CODECS`.
        data: the chunk's bytes (C-contiguous). Read only; it must not change until this returns.
        base: ``delta-lz4`` only: the same chunk of the base snapshot, exactly as long as ``data``.
        elem: element size in bytes for the byte-shuffle (4 for fp32, 2 for bf16); ignored by ``raw``/``lz4``.

    Returns:
        ``(codec_used, payload)``. For ``raw`` (asked for, or the fallback) the payload is ``data`` itself, not
        a copy, so it lives as long as the caller keeps ``data`` unchanged; otherwise a new ``bytes``.

    Raises:
        ValueError: unknown codec, ``elem < 1``, or a missing or wrong-sized ``base`` for ``delta-lz4``.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if elem < 1:
        raise ValueError(f"elem must be >= 1, got {elem}")
    if codec == "raw":
        return "raw", data
    src = _u8(data)
    work = src
    if codec == "shuffle-lz4" and elem > 1:
        work = _shuffle(src, elem, np.empty_like(src))
    elif codec == "delta-lz4":
        if base is None:
            raise ValueError("delta-lz4 needs a base buffer")
        base_arr = _u8(base)
        if base_arr.nbytes != src.nbytes:
            raise ValueError(f"delta base is {base_arr.nbytes} bytes, data is {src.nbytes}")
        work = np.bitwise_xor(src, base_arr)
        if elem > 1:
            work = _shuffle(work, elem, np.empty_like(work))
    payload = lz4.block.compress(work, store_size=False, mode=_LZ4_MODE)
    if len(payload) >= src.nbytes:
        return "raw", data
    return codec, payload


def decompress_chunk(
    codec: str,
    payload: Buffer,
    raw_len: int,
    *,
    base: Buffer | None = None,
    elem: int = 1,
    out: Buffer | None = None,
) -> memoryview:
    """Decode one chunk: the inverse of :func:`compress_chunk`. Trusts nothing about ``payload``.

    Args:
        codec: the codec the chunk's header names.
        payload: the encoded bytes.
        raw_len: the decoded length the header promises (at most ``MAX_CHUNK_BYTES``).
        base: ``delta-lz4`` only: the receiver's copy of the base chunk, ``raw_len`` bytes.
        elem: the element size the sender shuffled by.
        out: a writable buffer of exactly ``raw_len`` bytes to decode into (it may be ``base`` itself).

    Returns:
        A byte-format memoryview of the decoded bytes: over ``out`` when given; else, for ``raw``, over
        ``payload`` itself (no copy), and a new buffer for the other codecs.

    Raises:
        CodecError: unknown codec, ``elem < 1``, a bad ``raw_len`` or ``out``, a missing or wrong-sized base,
            a corrupt lz4 block, or a block that does not decode to ``raw_len`` bytes. Nothing else.
    """
    try:
        return _decompress(codec, payload, raw_len, base, elem, out)
    except CodecError:
        raise
    except Exception as exc:  # lz4.block.LZ4BlockError, BufferError, numpy's errors ... from odd inputs
        raise CodecError(f"{codec!r} payload cannot be decoded: {exc}") from exc


def breakeven_rate(ratio: float, compress_Bps: float, decompress_Bps: float) -> float:
    """The link rate (bytes/s) below which a codec delivers a chunk sooner than sending it raw.

    A chunk of ``n`` bytes takes ``n/rate`` raw and ``n/enc + n/dec + ratio*n/rate`` encoded (compression and
    decompression not overlapped with the wire: the conservative case), so the codec pays when
    ``rate < (1 - ratio) / (1/enc + 1/dec)``.

    Args:
        ratio: compressed bytes over raw bytes.
        compress_Bps: compression throughput in raw bytes per second.
        decompress_Bps: decompression throughput in raw bytes per second.

    Returns:
        The break-even rate in bytes per second; 0 when ``ratio >= 1`` (the codec never pays).

    Raises:
        ValueError: a negative or NaN argument, or a zero throughput.
    """
    if not (ratio >= 0 and compress_Bps > 0 and decompress_Bps > 0):
        raise ValueError(
            f"bad codec figures: ratio={ratio}, compress={compress_Bps}, decompress={decompress_Bps}"
        )
    if ratio >= 1:
        return 0.0
    cost = 1 / compress_Bps + 1 / decompress_Bps
    return math.inf if cost == 0 else (1 - ratio) / cost


# ------------------------------------------------------------------------------------------------ internals


def _u8(buf: Any) -> np.ndarray:
    """A flat uint8 array over ``buf``'s bytes, without a copy (read-only if ``buf`` is)."""
    return np.frombuffer(buf, dtype=np.uint8)


def _shuffle(src: np.ndarray, elem: int, out: np.ndarray) -> np.ndarray:
    """Write byte plane ``k`` of the whole elements of ``src`` to ``out[k*m:(k+1)*m]``; copy the tail as is."""
    body = src.nbytes - src.nbytes % elem
    m = body // elem
    np.copyto(out[:body].reshape(elem, m), src[:body].reshape(m, elem).T)
    out[body:] = src[body:]
    return out


def _unshuffle(src: np.ndarray, elem: int, out: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_shuffle`."""
    body = src.nbytes - src.nbytes % elem
    m = body // elem
    dst = out[:body].reshape(m, elem)
    planes = src[:body].reshape(elem, m)
    if elem <= _PLANE_LOOP_MAX_ELEM:
        # One strided copy per byte plane: several times faster than the single transposed np.copyto below,
        # for which numpy picks a poor loop order.
        for k in range(elem):
            dst[:, k] = planes[k]
    else:  # a peer's odd element size must not buy a long Python loop
        np.copyto(dst, planes.T)
    out[body:] = src[body:]
    return out


def _decompress(
    codec: str, payload: Buffer, raw_len: int, base: Buffer | None, elem: int, out: Buffer | None
) -> memoryview:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    if type(elem) is not int or elem < 1:
        raise CodecError(f"bad element size {elem!r}")
    if type(raw_len) is not int or not 0 <= raw_len <= L.MAX_CHUNK_BYTES:
        raise CodecError(f"bad decoded length {raw_len!r}")
    dst: np.ndarray | None = None
    if out is not None:
        dst = _u8(out)
        if dst.nbytes != raw_len or not dst.flags.writeable:
            raise CodecError(f"out must be a writable buffer of {raw_len} bytes")
    base_arr: np.ndarray | None = None
    if codec == "delta-lz4":
        if base is None:
            raise CodecError("delta-lz4 chunk but no base buffer")
        base_arr = _u8(base)
        if base_arr.nbytes != raw_len:
            raise CodecError(f"delta base is {base_arr.nbytes} bytes, chunk is {raw_len}")

    if codec == "raw":
        src = _u8(payload)
        if src.nbytes != raw_len:
            raise CodecError(f"raw payload is {src.nbytes} bytes, header says {raw_len}")
        if dst is None:
            return memoryview(payload).cast("B")
        np.copyto(dst, src)
        return dst.data

    decoded = lz4.block.decompress(payload, uncompressed_size=raw_len)
    if len(decoded) != raw_len:
        raise CodecError(f"{codec} payload decodes to {len(decoded)} bytes, header says {raw_len}")
    src = _u8(decoded)
    if codec == "lz4" or (codec == "shuffle-lz4" and elem == 1):
        if dst is None:
            return memoryview(decoded)
        np.copyto(dst, src)
        return dst.data
    if dst is None:
        dst = np.empty(raw_len, dtype=np.uint8)
    if base_arr is None:  # shuffle-lz4
        _unshuffle(src, elem, dst)
    elif elem == 1:
        np.bitwise_xor(src, base_arr, out=dst)
    else:
        # Unshuffling straight into ``out`` would clobber ``base`` before the XOR reads it when they alias.
        planes = np.empty_like(dst) if np.may_share_memory(dst, base_arr) else dst
        _unshuffle(src, elem, planes)
        np.bitwise_xor(planes, base_arr, out=dst)
    return dst.data
