"""Fetching a complete snapshot from its holders: :func:`pull_snapshot`, striped across all of them.

A pull fetches ``(job, rank, step)`` from several holders at once, chunks striped across them, checks every chunk
and the blobs against the seal the holders carry, and returns that seal for the new copy (a restore's pull through
the sidecars, a re-replication, an export).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence

from snapshotd.proto import ChecksumMismatch, Chunk, ErrorCode, PullManifest, PullRequest, StreamBegin, codec

from .integrity import Seal
from .paths import PeerPaths
from .peers import PeerError, PeerLink, PeerTimeout
from .placement import Lander, PlacementError

__all__ = ["CorruptEverywhere", "PullFailed", "describe_snapshot", "pull_snapshot"]

log = logging.getLogger(__name__)

PULL_RANGE_BYTES = 64 << 20  # payload asked for in one pull request (a whole number of chunks, at least one)


class PullFailed(RuntimeError):
    """No holder could deliver the snapshot."""


class CorruptEverywhere(PullFailed):
    """Some chunk of the snapshot failed its end-to-end check from every holder that sent it."""


async def describe_snapshot(
    links: Sequence[PeerLink], *, job: str, rank: int, step: int, paths: PeerPaths | None = None
) -> StreamBegin:
    """The manifest of ``(job, rank, step)`` from the first of ``links`` (its holders) that describes it with blobs
    that pass their digest. ``paths``: where a holder that did not answer in time is reported (:mod:`.paths`).

    Raises:
        PullFailed: no holder could.
    """
    what = f"job {job!r} rank {rank} step {step}"
    if not links:
        raise PullFailed(f"no live holder of {what}")
    errors: list[str] = []
    for link in links:
        with link.subscribe(job, rank, step) as replies:
            try:
                await link.send(PullManifest(job=job, rank=rank, step=step))
                reply = await link.receive(replies, StreamBegin)
                assert isinstance(reply, StreamBegin)
                if paths is not None:
                    paths.succeeded(link.addr)
                if codec.blob_digest(reply.table, reply.meta) != reply.digest:
                    raise PeerError(f"{link.addr} described {what} with blobs that fail their digest")
                return reply
            except PeerError as exc:
                if paths is not None and isinstance(exc, PeerTimeout):
                    paths.failed(link.addr, str(exc))
                errors.append(str(exc))
    raise PullFailed(f"no holder could describe {what}: {'; '.join(errors)}")


async def pull_snapshot(
    links: Sequence[PeerLink],
    *,
    job: str,
    rank: int,
    step: int,
    allocate: Callable[[StreamBegin], Lander],
    on_progress: Callable[[int], None] | None = None,
    manifest: StreamBegin | None = None,
    paths: PeerPaths | None = None,
) -> tuple[StreamBegin, Seal, int]:
    """Fetch the complete snapshot ``(job, rank, step)`` from ``links`` (its holders), striped across all of them.

    ``manifest``: the snapshot's description, when :func:`describe_snapshot` already got it (else it is asked
    for here). ``allocate(manifest)`` returns where the chunks go (a :data:`~.placement.Lander`, e.g.
    :func:`~.placement.arena_sink` of a buffer of at least ``manifest.data_bytes``). The manifest's blobs are
    checked against its digest, and every chunk against the checksum its holder carries, before it lands. A
    holder that fails, goes silent, sends a chunk that fails its check or finds its own copy corrupt has its
    chunks reassigned to the others. Returns the manifest, the copy's seal (the carried checksums, for the new
    holder to keep) and the number of payload bytes received. ``paths``: where each holder's path is reported
    (one that timed out is broken, one that delivered works; see :mod:`.paths`).

    Raises:
        CorruptEverywhere: a chunk failed its check from every holder that sent it.
        PullFailed: no holder described the snapshot, or every holder failed before all chunks arrived.
        PlacementError: the lander could not write (the pull stops at once: no holder can help).
    """
    if manifest is None:
        manifest = await describe_snapshot(links, job=job, rank=rank, step=step, paths=paths)
    what = f"job {job!r} rank {rank} step {step}"
    errors: list[str] = []
    seal = Seal(manifest.chunk_bytes, manifest.digest)
    land = allocate(manifest)
    nchunks = manifest.nchunks
    per_range = max(1, PULL_RANGE_BYTES // manifest.chunk_bytes)
    pending = collections.deque(range(i, min(i + per_range, nchunks)) for i in range(0, nchunks, per_range))
    received = 0
    alive = list(links)
    corrupt_from: dict[int, list[str]] = {}  # chunk -> the holders it failed its check from

    async def worker(link: PeerLink) -> None:
        nonlocal received
        landed = 0  # chunks this holder delivered: only those tell that its path works
        with link.subscribe(job, rank, step) as replies:
            while pending:
                todo = pending.popleft()
                missing = set(todo)
                try:
                    await link.send(
                        PullRequest(job=job, rank=rank, step=step, first=todo.start, count=len(todo))
                    )
                    while missing:
                        msg = await link.receive(replies, Chunk)
                        assert isinstance(msg, Chunk)
                        if msg.index not in missing:
                            continue
                        start = msg.index * manifest.chunk_bytes
                        end = min(start + manifest.chunk_bytes, manifest.data_bytes)
                        if msg.raw_len != end - start:
                            raise PeerError(f"{link.addr} sent chunk {msg.index} of the wrong size")
                        chunk = codec.decompress_chunk(msg.codec, msg.payload, msg.raw_len, elem=msg.elem)
                        try:
                            codec.verify(chunk, msg.checksum)
                        except ChecksumMismatch:
                            corrupt_from.setdefault(msg.index, []).append(link.addr)
                            raise
                        land(start, chunk)
                        seal.sums[msg.index] = msg.checksum
                        missing.discard(msg.index)
                        landed += 1
                        received += msg.payload.nbytes
                        if on_progress is not None:
                            on_progress(msg.raw_len)
                except PlacementError:
                    raise
                except Exception as exc:
                    if paths is not None and isinstance(exc, PeerTimeout):
                        paths.failed(link.addr, str(exc))
                    # it dropped its own copy
                    if isinstance(exc, PeerError) and exc.code == ErrorCode.CORRUPT:
                        for i in missing:
                            corrupt_from.setdefault(i, []).append(link.addr)
                    pending.extend(range(i, i + 1) for i in sorted(missing))
                    alive.remove(link)
                    errors.append(f"{link.addr}: {exc}")
                    log.warning("pull of %s from %s failed: %s", what, link.addr, exc)
                    return
            if paths is not None and landed:
                paths.succeeded(link.addr)

    while pending and alive:  # a holder that failed late may have put chunks back after the others finished
        try:
            async with asyncio.TaskGroup() as tg:
                for link in list(alive):
                    tg.create_task(worker(link))
        except* PlacementError as group:
            raise group.exceptions[0] from None
    if pending:
        everywhere = {link.addr for link in links}
        bad = sorted(i for todo in pending for i in todo if everywhere <= set(corrupt_from.get(i, ())))
        if bad:
            raise CorruptEverywhere(
                f"chunk {bad[0]} of {what} failed its end-to-end checksum from every holder that sent it "
                f"({', '.join(corrupt_from[bad[0]])}); no good copy is left: {'; '.join(errors)}"
            )
        raise PullFailed(f"pull of {what} failed: {'; '.join(errors)}")
    return manifest, seal, received
