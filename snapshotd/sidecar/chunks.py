"""A buddy copy's bytes, held chunk by chunk where they arrived (:class:`SnapshotBuffer`), and the pool of chunk
buffers that dropped copies leave for new ones (:class:`BufferPool`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["ADOPT_MIN_BYTES", "BufferPool", "SnapshotBuffer"]

ADOPT_MIN_BYTES = 64 << 10
"""Smaller chunks are copied, not adopted: ZeroMQ packs small messages into shared receive batches, and keeping
one such message alive would keep its whole batch."""


class SnapshotBuffer:
    """The ``nbytes`` bytes of one snapshot as chunks of ``chunk_bytes`` (the last one shorter).

    A buddy copy is written once per training step and read almost never (by a restore or a pull), so a chunk
    that arrives whole, in a buffer nobody writes again (a raw payload ZeroMQ received), is *adopted*: kept as that
    view, which holds its frame alive, instead of being copied into a preallocated buffer: on two cores that copy
    was a large part of the loopback stream's gap to a raw socket. Every other write (a decoded chunk, a small
    one, bytes at another offset) goes into a buffer of the chunk's size that this snapshot owns, taken from
    ``take`` (the store's pool). Reading one chunk's bytes is a zero-copy view; reading across chunks is a joined
    copy.
    """

    __slots__ = ("_chunks", "_owned", "_take", "chunk_bytes", "nbytes")

    def __init__(self, nbytes: int, chunk_bytes: int, take: Callable[[int], np.ndarray]) -> None:
        if nbytes < 0 or chunk_bytes < 1:
            raise ValueError(f"bad geometry: {nbytes} B in chunks of {chunk_bytes} B")
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes
        self._chunks: list[memoryview | None] = [None] * -(-nbytes // chunk_bytes)
        self._owned: dict[int, np.ndarray] = {}
        self._take = take

    @property
    def nchunks(self) -> int:
        return len(self._chunks)

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.nbytes)

    def adopt(self, index: int, view: memoryview) -> None:
        """Hold ``view`` as chunk ``index`` without copying it. The caller must never modify its bytes again.

        Raises:
            ValueError: ``view`` is not exactly the chunk's length.
        """
        start, end = self.chunk_range(index)
        view = memoryview(view).cast("B")
        if view.nbytes != end - start:
            raise ValueError(f"chunk {index} is {end - start} B, got {view.nbytes} B")
        self._owned.pop(index, None)
        self._chunks[index] = view

    def writable(self, index: int) -> memoryview:
        """Chunk ``index`` in a buffer this snapshot owns, to write into; it keeps the bytes the chunk held."""
        buf = self._owned.get(index)
        if buf is None:
            start, end = self.chunk_range(index)
            buf = self._take(end - start)
            old = self._chunks[index]
            if old is not None:
                buf[:] = old
            self._owned[index] = buf
            self._chunks[index] = buf.data
        return buf.data

    def prepare(self) -> list[memoryview]:
        """Every chunk in a buffer this snapshot owns, taken now: the views to write the chunks into, in order
        (from other threads too: nothing else takes or reads a chunk until it is written)."""
        return [self.writable(index) for index in range(self.nchunks)]

    def land(self, start: int, data: memoryview) -> None:
        """Write ``data`` at byte ``start`` (a :data:`~.placement.Lander`): a whole chunk of at least
        :data:`ADOPT_MIN_BYTES` is adopted (landers are handed buffers their caller never writes again), anything
        else is copied into owned chunks."""
        data = memoryview(data).cast("B")
        end = start + data.nbytes
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"bytes {start}..{end} are outside the snapshot's {self.nbytes}")
        index = start // self.chunk_bytes
        if data.nbytes >= ADOPT_MIN_BYTES and (start, end) == self.chunk_range(index):
            self.adopt(index, data)
            return
        pos = start
        while pos < end:
            index = pos // self.chunk_bytes
            lo, hi = self.chunk_range(index)
            take = min(hi, end) - pos
            self.writable(index)[pos - lo : pos - lo + take] = data[pos - start : pos - start + take]
            pos += take

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)``: a view when they lie in one chunk, a joined copy when they span several.

        Raises:
            ValueError: the range is outside the snapshot, or covers a chunk never written.
        """
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"bytes {start}..{end} are outside the snapshot's {self.nbytes}")
        if start == end:
            return memoryview(b"")
        first, last = start // self.chunk_bytes, (end - 1) // self.chunk_bytes
        if first == last:
            lo = first * self.chunk_bytes
            return self._chunk(first)[start - lo : end - lo]
        out = np.empty(end - start, dtype=np.uint8)
        for index in range(first, last + 1):
            lo, hi = self.chunk_range(index)
            a, b = max(lo, start), min(hi, end)
            out[a - start : b - start] = self._chunk(index)[a - lo : b - lo]
        return out.data

    def parts(self) -> Iterator[tuple[int, memoryview]]:
        """``(start, bytes)`` of every chunk in order, uncopied.

        Raises:
            ValueError: a chunk was never written.
        """
        for index in range(self.nchunks):
            yield index * self.chunk_bytes, self._chunk(index)

    def tobytes(self) -> bytes:
        return b"".join(part for _, part in self.parts())

    def release(self) -> list[np.ndarray]:
        """Hand over the owned chunk buffers, once, for the pool. Views already taken still read the same bytes
        until a new owner writes them, so the caller must not reuse a buffer while one may be read."""
        owned = list(self._owned.values())
        self._owned.clear()
        return owned

    def _chunk(self, index: int) -> memoryview:
        chunk = self._chunks[index]
        if chunk is None:
            raise ValueError(f"chunk {index} of this snapshot was never written")
        return chunk


class BufferPool:
    """Chunk buffers of dropped snapshots, by size, reused for the chunks of new ones: a fresh buffer costs the
    kernel zeroing every page on first touch. It keeps at most :attr:`cap` bytes (the store sets it to twice the
    largest snapshot seen), which the store counts against its memory limit."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self.nbytes = 0
        self.cap = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``: a pooled one if one has that size, else a new one."""
        pooled = self._free.get(nbytes)
        if not pooled:
            return np.empty(nbytes, dtype=np.uint8)
        self.nbytes -= nbytes
        buf = pooled.pop()
        if not pooled:
            del self._free[nbytes]
        return buf

    def give(self, buffers: list[np.ndarray]) -> None:
        """Keep ``buffers`` for reuse, as far as :attr:`cap` allows (the caller writes them no more)."""
        for buf in buffers:
            if self.nbytes + buf.nbytes > self.cap:
                break
            self._free.setdefault(buf.nbytes, []).append(buf)
            self.nbytes += buf.nbytes

    def shed(self, excess: int) -> None:
        """Free pooled buffers until ``excess`` bytes are gone, or none is left."""
        while excess > 0 and self._free:
            size, pooled = next(iter(self._free.items()))
            pooled.pop()
            if not pooled:
                del self._free[size]
            self.nbytes -= size
            excess -= size
