"""What a buddy copy is (:class:`StoredSnapshot`), the errors about copies, and what the sidecar's services need of
the store that keeps them (:class:`BuddyStore`, the store seam; :class:`~.store.SnapshotStore` keeps them in this
process's memory)."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import numpy as np

from .chunks import SnapshotBuffer
from .integrity import Seal

__all__ = ["BuddyStore", "Key", "MemoryLimitReached", "StoredSnapshot", "UnknownSnapshot"]

Key = tuple[str, int, int]  # (job, rank, step)


class MemoryLimitReached(RuntimeError):
    """Accepting this snapshot would exceed ``--memory-limit``."""


class UnknownSnapshot(KeyError):
    """No such snapshot, or it is not complete (when completeness was required)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown snapshot"


@dataclasses.dataclass(slots=True)
class StoredSnapshot:
    """One rank's snapshot of one step: table and meta blobs, its bytes, and which chunks arrived."""

    job: str
    rank: int
    step: int
    src_node: str
    table: bytes
    meta: bytes
    data: SnapshotBuffer
    seal: Seal
    """The copy's end-to-end checksums, one block per chunk (:mod:`.integrity`)."""
    received: np.ndarray  # bool per chunk
    missing: int
    complete: bool = False
    pins: int = 0  # pulls in progress; a pinned snapshot is not dropped
    touched: float = dataclasses.field(default_factory=time.monotonic)
    """When the stream last brought a chunk (time.monotonic()): an incomplete copy idle too long is aborted."""
    exported: bool = False  # zero-copy views went to zmq: never give its buffers back to the pool
    writing: bool = False  # a push's threads may still write its buffers: never give them back to the pool
    stream: int = 0  # the number its sender drew for the stream bringing it (0: none, as a pulled copy)

    @property
    def data_bytes(self) -> int:
        return self.data.nbytes

    @property
    def nchunks(self) -> int:
        return self.data.nchunks


class BuddyStore(Protocol):
    """What the sidecar's services need of the copies a node keeps for other nodes' ranks (the store seam).

    Copies are keyed by ``(job, rank, step)``. A copy is *complete* once every chunk arrived and verified; only
    complete copies are served, reported or counted. The store never evicts a complete copy by itself: the
    owner drops them (:meth:`drop_unneeded`), and a copy that would pass the memory limit is refused at
    :meth:`begin`. :class:`SnapshotStore` keeps the copies in this process's memory.
    """

    used_bytes: int
    """Bytes held by copies (complete or arriving)."""
    memory_limit: int
    """Bytes the copies may take."""

    def begin(
        self,
        job: str,
        rank: int,
        step: int,
        *,
        src_node: str,
        data_bytes: int,
        chunk_bytes: int,
        table: bytes,
        meta: bytes,
        digest: int,
        stream: int = 0,
    ) -> StoredSnapshot: ...

    def get(self, job: str, rank: int, step: int, *, complete: bool = True) -> StoredSnapshot: ...

    def put_chunk(
        self,
        job: str,
        rank: int,
        step: int,
        index: int,
        *,
        codec_name: str,
        payload: memoryview,
        raw_len: int,
        checksum: int,
        base_step: int,
        elem: int,
    ) -> bool: ...

    def prepare_push(self, job: str, rank: int, step: int) -> list[memoryview]: ...

    def landed(self, job: str, rank: int, step: int, index: int, checksum: int) -> bool: ...

    def mark_complete(self, job: str, rank: int, step: int, seal: Seal) -> None: ...

    def abort(self, job: str, rank: int, step: int) -> None: ...

    def discard(self, snap: StoredSnapshot) -> None: ...

    def holds(self, job: str, rank: int, step: int) -> bool: ...

    def steps(self, job: str, rank: int) -> list[int]: ...

    def drop_unneeded(self, job: str, durable: int, unusable: frozenset[int] = frozenset()) -> int: ...

    def complete_keys(self) -> list[Key]: ...
