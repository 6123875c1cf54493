"""The buddy store: snapshots that other nodes streamed to this sidecar, held in host memory.

A snapshot's memory is reserved from its manifest when its stream begins; its chunks are held as they arrive
(:class:`~.chunks.SnapshotBuffer`: a raw chunk is kept in the buffer ZeroMQ received it into, a decoded one in a
buffer from a pool). It becomes *complete* only when every chunk is in and its checksum verified; only complete
snapshots are reported, served or used as delta bases. Each copy keeps the seal it arrived with
(:class:`~.integrity.Seal`: the announced blobs' digest and every chunk's carried checksum); a copy found corrupt
is discarded (:meth:`SnapshotStore.discard`). Memory is bounded by ``memory_limit``: a new snapshot that
does not fit is refused with :class:`MemoryLimitReached` (the sender then skips that step); nothing complete is
ever evicted to make room.
Retention follows the coordinator's watermark (:meth:`SnapshotStore.drop_unneeded`): steps below the durable step D
and the steps it names unusable go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from snapshotd.proto import ProtocolError, codec

from .chunks import BufferPool, SnapshotBuffer
from .copies import BuddyStore, Key, MemoryLimitReached, StoredSnapshot, UnknownSnapshot
from .integrity import Seal

__all__ = ["BuddyStore", "MemoryLimitReached", "SnapshotStore", "StoredSnapshot", "UnknownSnapshot"]


log = logging.getLogger(__name__)


class SnapshotStore:
    """In-memory buddy copies, keyed by ``(job, rank, step)``. Not thread-safe: the sidecar's loop owns it.

    Args:
        memory_limit: bytes the copies may take (spare buffers included).
        on_change: called whenever the set of complete copies changes (one completes, a complete one goes).
        idle_after: seconds after which a stream that brings nothing gives its reservation up to a new one that
            would not fit otherwise (its sender gave up on it by then).
    """

    def __init__(
        self, memory_limit: int, on_change: Callable[[], None] = lambda: None, idle_after: float = 20.0
    ) -> None:
        self.memory_limit = memory_limit
        self.idle_after = idle_after
        self.on_change = on_change
        self._snaps: dict[Key, StoredSnapshot] = {}
        self.spares = BufferPool()
        """Chunk buffers of dropped snapshots, reused; counted against the limit."""
        self.used_bytes = 0  # snapshots held (spares are counted against the limit separately)

    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def spare_bytes(self) -> int:
        """Bytes of pooled chunk buffers."""
        return self.spares.nbytes

    def __iter__(self) -> Iterator[StoredSnapshot]:
        return iter(list(self._snaps.values()))

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
    ) -> StoredSnapshot:
        """Reserve memory for a snapshot about to arrive, whose blobs ``digest`` seals. A previous incomplete copy
        of the same key is replaced, unless it is this very ``stream`` (a nonzero number its sender drew) begun
        again, when it stays as it is; a complete one stays and is returned.

        Raises:
            ProtocolError: ``table`` and ``meta`` fail ``digest``.
            MemoryLimitReached: the snapshot would not fit under the memory limit, even after giving up the
                reservations of streams idle for ``idle_after`` seconds.
        """
        seal = Seal(chunk_bytes, digest)
        if codec.blob_digest(table, meta) != digest:
            raise ProtocolError(
                f"the tensor table and meta of job {job!r} rank {rank} step {step} fail their digest"
            )
        key = (job, rank, step)
        old = self._snaps.get(key)
        if old is not None:
            if old.complete or (stream and old.stream == stream):
                return old
            self._remove(key)
        need = data_bytes + len(table) + len(meta)
        self.spares.shed(self.used_bytes + self.spares.nbytes + need - self.memory_limit)
        if self.used_bytes + self.spares.nbytes + need > self.memory_limit:
            self.abort_idle(time.monotonic() - self.idle_after)
        if self.used_bytes + self.spares.nbytes + need > self.memory_limit:
            raise MemoryLimitReached(
                f"memory limit {self.memory_limit} B reached: holding {self.used_bytes} B, "
                f"snapshot of job {job!r} rank {rank} step {step} needs {need} B more"
            )
        data = SnapshotBuffer(data_bytes, chunk_bytes, self.spares.take)
        snap = StoredSnapshot(
            job,
            rank,
            step,
            src_node,
            bytes(table),
            bytes(meta),
            data,
            seal,
            np.zeros(data.nchunks, dtype=bool),
            data.nchunks,
            stream=stream,
        )
        self._snaps[key] = snap
        self.used_bytes += need
        self.spares.cap = max(self.spares.cap, 2 * data_bytes)
        if data.nchunks == 0:
            self._complete(snap)
        return snap

    def get(self, job: str, rank: int, step: int, *, complete: bool = True) -> StoredSnapshot:
        snap = self._snaps.get((job, rank, step))
        if snap is None or (complete and not snap.complete):
            state = "not complete" if snap is not None else "not held"
            raise UnknownSnapshot(f"snapshot of job {job!r} rank {rank} step {step} is {state} here")
        return snap

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
    ) -> bool:
        """Decode, verify and hold one chunk. Returns True when this chunk completed the snapshot.

        A ``raw`` payload of at least :data:`~.chunks.ADOPT_MIN_BYTES` is kept as is, not copied: the caller must
        never modify its bytes afterwards (a received ZeroMQ frame never is).

        Raises:
            UnknownSnapshot: no stream for this key (never begun, aborted, or dropped).
            ProtocolError: bad index or length, a codec failure, a missing delta base, or a checksum mismatch;
                the chunk is not marked received, so a retry can still complete the snapshot.
        """
        snap = self.get(job, rank, step, complete=False)
        if snap.complete:
            return False
        snap.touched = time.monotonic()
        if not 0 <= index < snap.nchunks:
            raise ProtocolError(f"chunk {index} is outside 0..{snap.nchunks - 1}")
        start, end = snap.data.chunk_range(index)
        if raw_len != end - start:
            raise ProtocolError(f"chunk {index} is {raw_len} B, expected {end - start} B")
        if codec_name == "raw":
            # checks the length; a view of the payload
            chunk = codec.decompress_chunk("raw", payload, raw_len)
            codec.verify(chunk, checksum)
            snap.data.land(start, chunk)  # kept as it is when large enough (see SnapshotBuffer.land)
        else:
            base = None
            if codec_name == "delta-lz4":
                try:
                    base_snap = self.get(job, rank, base_step)
                except UnknownSnapshot as exc:
                    raise ProtocolError(f"delta base step {base_step} is not held: {exc}") from exc
                if base_snap.data_bytes < end:
                    raise ProtocolError(f"delta base step {base_step} is too short for chunk {index}")
                base = base_snap.data.view(start, end)
            out = snap.data.writable(index)
            codec.decompress_chunk(codec_name, payload, raw_len, base=base, elem=elem, out=out)
            codec.verify(out, checksum)
        return self._arrived(snap, index, checksum)

    def prepare_push(self, job: str, rank: int, step: int) -> list[memoryview]:
        """Take every chunk buffer of an arriving snapshot now, for a push (:mod:`snapshotd.proto.bulk`) whose
        threads write the chunks straight into them; each chunk then counts once :meth:`landed` says so. Until
        the snapshot is complete its buffers never go back to the pool (a thread may still be writing).

        Raises:
            UnknownSnapshot: no stream for this key.
        """
        snap = self.get(job, rank, step, complete=False)
        snap.writing = True
        return snap.data.prepare()

    def landed(self, job: str, rank: int, step: int, index: int, checksum: int) -> bool:
        """Chunk ``index`` of a push is in its buffer and verified against ``checksum``: hold it. Returns True when
        it completed the snapshot.

        Raises:
            UnknownSnapshot: no stream for this key (aborted or dropped meanwhile).
        """
        snap = self.get(job, rank, step, complete=False)
        if snap.complete:
            return False
        snap.touched = time.monotonic()
        return self._arrived(snap, index, checksum)

    def _arrived(self, snap: StoredSnapshot, index: int, checksum: int) -> bool:
        snap.seal.sums[index] = checksum
        if not snap.received[index]:
            snap.received[index] = True
            snap.missing -= 1
        if snap.missing == 0:
            snap.writing = False
            self._complete(snap)
            return True
        return False

    def mark_complete(self, job: str, rank: int, step: int, seal: Seal) -> None:
        """Declare a snapshot whose every byte a pull (re-replication) landed and checked against ``seal``
        complete."""
        snap = self.get(job, rank, step, complete=False)
        if not snap.complete:
            snap.seal = seal
            snap.received[:] = True
            snap.missing = 0
            self._complete(snap)

    def abort(self, job: str, rank: int, step: int) -> None:
        """Drop an incomplete snapshot (a complete one stays)."""
        snap = self._snaps.get((job, rank, step))
        if snap is not None and not snap.complete:
            self._remove((job, rank, step))

    def abort_idle(self, before: float) -> list[Key]:
        """Abort every incomplete, unpinned copy whose stream brought nothing since ``before``
        (time.monotonic()): its sender gave up without a word, and its reservation would block real snapshots
        (:meth:`begin` calls this when a new copy would not fit). Returns their keys."""
        idle = [k for k, s in self._snaps.items() if not s.complete and s.pins == 0 and s.touched < before]
        for key in idle:
            log.warning(
                "the stream of %s rank %d step %d brought nothing for %.0f s: its reservation goes to a "
                "new one",
                key[0],
                key[1],
                key[2],
                time.monotonic() - self._snaps[key].touched,
            )
            self._remove(key)
        return idle

    def discard(self, snap: StoredSnapshot) -> None:
        """Drop ``snap``, a copy found corrupt, complete or not, pinned or not: it is never served or reported
        again (a newer copy of the same key that took its place stays). Its buffers are not reused (a pull being
        served may still be reading them)."""
        key = (snap.job, snap.rank, snap.step)
        if self._snaps.get(key) is snap:
            snap.exported = True
            self._remove(key)

    def holds(self, job: str, rank: int, step: int) -> bool:
        """Whether any copy, complete or still arriving, of ``(job, rank, step)`` is here."""
        return (job, rank, step) in self._snaps

    def steps(self, job: str, rank: int) -> list[int]:
        """Complete steps held for ``(job, rank)``, oldest first."""
        return sorted(s.step for s in self._snaps.values() if s.job == job and s.rank == rank and s.complete)

    def drop_unneeded(self, job: str, durable: int, unusable: frozenset[int] = frozenset()) -> int:
        """Drop every unpinned snapshot of ``job`` older than ``durable``, and every complete one at a step in
        ``unusable`` (no restore can use it; see :class:`~snapshotd.proto.Watermark`). A stream of an unusable
        step still arriving completes first, so that its sender sees it taken. Returns the bytes freed."""
        if durable < 0 and not unusable:  # every heartbeat reply asks: nothing to look for
            return 0
        freed = 0
        for key, snap in list(self._snaps.items()):
            if (
                key[0] == job
                and snap.pins == 0
                and (key[2] < durable or (key[2] in unusable and snap.complete))
            ):
                freed += self._remove(key)
        return freed

    def complete_keys(self) -> list[Key]:
        return [k for k, s in self._snaps.items() if s.complete]

    def _complete(self, snap: StoredSnapshot) -> None:
        snap.complete = True
        self.on_change()
        log.debug(
            "snapshot %s rank %d step %d complete (%d B)", snap.job, snap.rank, snap.step, snap.data_bytes
        )

    def _remove(self, key: Key) -> int:
        """Forget a snapshot. Its owned chunk buffers become spares (counted against the limit) up to the cap."""
        snap = self._snaps.pop(key)
        freed = snap.data_bytes + len(snap.table) + len(snap.meta)
        self.used_bytes -= freed
        owned = snap.data.release()
        if not (snap.exported or snap.writing):
            self.spares.give(owned)
        if snap.complete:
            self.on_change()
        return freed
