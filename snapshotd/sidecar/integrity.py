"""End-to-end integrity of a copy: the seal every holder keeps beside a snapshot's bytes.

A snapshot's bytes are cut into blocks of ``block_bytes`` (the announcing sidecar's chunk size). Each block's
xxh3-64 is taken once, by the rank's own sidecar, right after the rank announced the slot (in a worker thread,
or by the stream to a buddy for a block it reaches first). The digest of the
tensor table and meta blob is taken when the rank announces them. Every other holder gets the seal with the
bytes (the checksum of each :class:`~snapshotd.proto.Chunk`, the ``digest`` of a
:class:`~snapshotd.proto.StreamBegin`), checks the bytes against it on arrival, and keeps it unchanged: no
holder ever computes a checksum of bytes it received. Before any byte leaves a holder (a pull it serves) or is
loaded (a restore, from the rank's own slot, a replica on the node, or a pull), it is checked against the seal
again, so bytes that change at rest, in flight or in shared memory after their checksum was taken are caught;
a copy that fails is dropped and never served again.
"""

from __future__ import annotations

import dataclasses

from snapshotd.proto import blob_digest, checksum

__all__ = ["CorruptCopy", "Seal"]


class CorruptCopy(Exception):
    """A held copy failed its seal: its bytes or blobs are not the ones announced."""

    def __init__(self, what: str, block: int | None = None) -> None:
        self.block = block
        where = "its tensor table or meta blob" if block is None else f"block {block}"
        super().__init__(f"{what}: {where} failed its end-to-end checksum")


@dataclasses.dataclass(slots=True)
class Seal:
    """The checksums of one copy: the blobs' digest and each block's xxh3-64 (filled in once, see the module
    docstring)."""

    block_bytes: int
    digest: int
    sums: dict[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def announced(cls, block_bytes: int, table: bytes, meta: bytes) -> Seal:
        """The seal of a slot a rank just announced: its blobs' digest; block sums come as blocks are read."""
        return cls(block_bytes, blob_digest(table, meta))

    def blocks(self, nbytes: int) -> range:
        return range(-(-nbytes // self.block_bytes))

    def block_sum(self, index: int, view: memoryview) -> int:
        """The checksum of block ``index`` (whose bytes are ``view``): the one kept, else taken now and kept."""
        value = self.sums.get(index)
        if value is None:
            value = self.sums[index] = checksum(view)
        return value

    def keep(self, index: int, value: int) -> None:
        """Keep ``value`` as block ``index``'s checksum (taken as its bytes were read) unless one is kept already."""
        self.sums.setdefault(index, value)

    def whole(self, nbytes: int) -> bool:
        """Whether it holds the checksum of every block of a copy of ``nbytes``."""
        return len(self.sums) >= len(self.blocks(nbytes))

    def fill(self, data: memoryview) -> None:
        """Take the checksum of every block of ``data`` that has none yet (from a worker thread: the event loop
        and push lanes may take some of the same meanwhile; the first one kept stays)."""
        size = self.block_bytes
        for index in self.blocks(data.nbytes):
            if index not in self.sums:
                self.sums.setdefault(index, checksum(data[index * size : (index + 1) * size]))

    def check_blobs(self, table: bytes | memoryview, meta: bytes | memoryview, what: str) -> None:
        """Raises CorruptCopy: ``table`` and ``meta`` are not the blobs this seal was made for."""
        if blob_digest(table, meta) != self.digest:
            raise CorruptCopy(what)

    def check_block(self, index: int, view: memoryview, what: str) -> int:
        """Check block ``index`` against its kept checksum (taking it now if none is kept); returns the checksum.

        Raises:
            CorruptCopy: the bytes differ from the ones the checksum was taken of.
        """
        expected = self.sums.get(index)
        actual = checksum(view)
        if expected is None:
            self.sums[index] = actual
        elif actual != expected:
            raise CorruptCopy(what, index)
        return actual

    def check(self, data: memoryview, table: bytes | memoryview, meta: bytes | memoryview, what: str) -> None:
        """Check a whole copy: blobs, then every block of ``data``.

        Raises:
            CorruptCopy: naming the first block (or the blobs) that failed.
        """
        self.check_blobs(table, meta, what)
        size = self.block_bytes
        for index in self.blocks(data.nbytes):
            self.check_block(index, data[index * size : (index + 1) * size], what)
