"""Moving one snapshot between two sidecars: the sender's stream and the puller's striped fetch.

A stream (:func:`send_snapshot`) offers ``(job, rank, step)`` with a StreamBegin, then sends chunks under
credit-based flow control (at most ``window`` unacknowledged) and the node's :class:`Pacer`, each chunk one
block of the slot's :class:`~.integrity.Seal` in one multipart message whose payload frame is a zero-copy view of
shared memory (or a compressed copy when a codec pays, see :class:`CodecPolicy`). It returns when the buddy
acknowledged every chunk, i.e. holds the snapshot complete. A pull (:func:`pull_snapshot`) fetches a complete
snapshot from several holders at once, chunks striped across them, checks every chunk and the blobs against the
seal the holders carry, and returns that seal for the new copy.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from snapshotd.proto import (
    ChecksumMismatch,
    Chunk,
    ChunkAck,
    ErrorCode,
    PullManifest,
    PullRequest,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    codec,
)

from .integrity import Seal
from .pacer import Pacer
from .peers import PeerError, PeerLink
from .placement import Lander, PlacementError
from .push import Lanes, PushFailed

__all__ = [
    "CodecPolicy",
    "CorruptEverywhere",
    "PullFailed",
    "SendResult",
    "describe_snapshot",
    "pull_snapshot",
    "send_snapshot",
]

log = logging.getLogger(__name__)

PULL_RANGE_BYTES = 64 << 20  # payload asked for in one pull request (a whole number of chunks, at least one)


class PullFailed(RuntimeError):
    """No holder could deliver the snapshot."""


class CorruptEverywhere(PullFailed):
    """Some chunk of the snapshot failed its end-to-end check from every holder that sent it."""


class CodecPolicy:
    """Chooses how each chunk to one buddy goes, from continuous measurements: ``"raw"``, ``"delta"``
    (delta-lz4), or ``"probe"`` (raw, after a sample of it was compressed to measure the codec).

    Delta pays when the link rate (a fixed ``--max-rate``, or the throughput of unpaced streams to this buddy,
    whichever is lower) is below :func:`codec.breakeven_rate` for the measured ratio and compression speed (CPU
    seconds of the compressing thread). Every chunk sent as a delta updates the measurements. So that they stay
    current while chunks go raw, the first chunk and every ``PROBE_EVERY``-th after it that would go raw is a
    probe: a ``PROBE_BYTES`` sample of it, at a place that moves from probe to probe, is compressed and timed, and
    the chunk goes raw. A sample costs a sixteenth of compressing a 4 MiB chunk (the default), and where delta
    never pays (a fast link) nothing compressed reaches the buddy, whose decoding would cost CPU too.
    """

    PROBE_EVERY = 32
    PROBE_BYTES = 256 << 10
    ALPHA = 0.2

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.wire_Bps = math.inf
        self.ratio: float | None = None
        self.enc_Bps: float | None = None
        self._count = 0
        self._probes = 0

    def choose(self, pacer_rate: float) -> str:
        """How the next chunk goes (see the class docstring)."""
        if self.mode != "auto":
            return "delta" if self.mode == "delta-lz4" else "raw"
        self._count += 1
        if self.ratio is None:
            return "probe"
        if self._delta_pays(pacer_rate):
            return "delta"
        return "probe" if self._count % self.PROBE_EVERY == 0 else "raw"

    def raw_stream(self, pacer_rate: float) -> bool:
        """Whether a whole stream goes raw (a push, :mod:`.push`): no chunk of it would go as a delta now. Its
        chunks still probe in ``auto`` mode, so that the next stream sees what delta would save."""
        if self.mode != "auto":
            return self.mode == "raw"
        return self.ratio is None or not self._delta_pays(pacer_rate)

    def _delta_pays(self, pacer_rate: float) -> bool:
        assert self.ratio is not None and self.enc_Bps is not None
        rate = min(pacer_rate, self.wire_Bps)
        return rate < codec.breakeven_rate(self.ratio, self.enc_Bps, 2 * self.enc_Bps)

    def sample(self, nbytes: int) -> tuple[int, int]:
        """(start, end) of the next probe's sample in a chunk of ``nbytes``: ``PROBE_BYTES`` long (the whole of a
        smaller chunk), starting at a multiple of ``PROBE_BYTES`` (whole elements of any dtype) that cycles through
        the chunk's whole ``PROBE_BYTES`` windows from probe to probe."""
        places = max(1, nbytes // self.PROBE_BYTES)
        start = (self._probes % places) * self.PROBE_BYTES
        self._probes += 1
        return start, min(nbytes, start + self.PROBE_BYTES)

    def record_delta(self, raw: int, compressed: int, seconds: float) -> None:
        ratio = compressed / raw if raw else 1.0
        speed = raw / max(seconds, 1e-7)
        a = self.ALPHA
        self.ratio = ratio if self.ratio is None else (1 - a) * self.ratio + a * ratio
        self.enc_Bps = speed if self.enc_Bps is None else (1 - a) * self.enc_Bps + a * speed

    def record_stream(self, wire_bytes: int, seconds: float) -> None:
        if seconds > 0 and wire_bytes > (4 << 20):
            rate = wire_bytes / seconds
            self.wire_Bps = rate if math.isinf(self.wire_Bps) else 0.5 * self.wire_Bps + 0.5 * rate


@dataclasses.dataclass(slots=True)
class SendResult:
    data_bytes: int
    wire_bytes: int
    seconds: float
    delta_chunks: int


def _compress(data: memoryview, base: memoryview, elem: int) -> tuple[str, Any, float]:
    """``data`` as delta-lz4 against ``base`` (or raw, when that is not smaller): (codec, payload, the CPU seconds
    this thread spent on it; time it waited for the GIL or a core does not count)."""
    t0 = time.thread_time()
    used, payload = codec.compress_chunk("delta-lz4", data, base=base, elem=elem)
    return used, payload, time.thread_time() - t0


async def send_snapshot(
    link: PeerLink,
    *,
    job: str,
    rank: int,
    step: int,
    src_node: str,
    data: memoryview,
    table: bytes,
    meta: bytes,
    seal: Seal,
    window: int,
    pacer: Pacer,
    policy: CodecPolicy,
    base: tuple[int, memoryview] | None = None,
    elem: int = 1,
    lanes: int = 0,
) -> SendResult:
    """Stream one snapshot to one buddy and return when the buddy holds it complete.

    ``data`` must stay unmodified until this returns (the caller keeps the slot busy). Each chunk is one block of
    ``seal``, sent with the block's checksum (taken now if the seal lacks it, and kept: the streams of one slot to
    several buddies share the seal). ``base`` is the previous snapshot of this rank in the caller's memory (step,
    bytes), usable for delta-lz4 if the buddy holds it too. With ``lanes``, the stream offers to push its chunks
    raw over that many connections to the buddy's bulk port (:mod:`.push`), which the buddy may take or leave. On
    any failure or cancellation the buddy is told to abort, and the error propagates.

    Raises:
        PeerError: the buddy refused (memory limit, ...) or failed, or a push connection failed; PeerTimeout when
            it went silent.
    """
    nbytes = data.nbytes
    chunk_bytes = seal.block_bytes
    nchunks = -(-nbytes // chunk_bytes) if nbytes else 0
    t0 = time.perf_counter()
    wire = 0
    delta_chunks = 0
    with link.subscribe(job, rank, step) as replies, pacer.streaming((job, rank)):
        try:
            await link.send(
                StreamBegin(
                    job=job,
                    rank=rank,
                    step=step,
                    src_node=src_node,
                    data_bytes=nbytes,
                    chunk_bytes=chunk_bytes,
                    window=window,
                    digest=seal.digest,
                    table=table,
                    meta=meta,
                    stream=random.getrandbits(62) | 1,
                    upload=lanes > 0,
                )
            )
            accept = await link.receive(replies, StreamAccept)
            assert isinstance(accept, StreamAccept)
            base_ok = base is not None and base[0] in accept.bases and base[1].nbytes >= nbytes
            inflight = sent = 0
            complete = nchunks == 0
            if accept.upload_port and not complete:
                wire = await _push(
                    link,
                    replies,
                    accept,
                    lanes,
                    data=data,
                    seal=seal,
                    pacer=pacer,
                    policy=policy,
                    base=base if base_ok else None,
                    elem=elem,
                )
                complete = True
            acks_seen: set[int] = set()  # the last chunk of each ack taken (a duplicated ack is skipped)
            while not complete:
                while inflight < window and sent < nchunks:
                    start = sent * chunk_bytes
                    view = data[start : start + chunk_bytes]
                    name, payload, base_step = "raw", view, -1
                    how = policy.choose(pacer.cap) if base_ok else "raw"
                    if how == "delta":
                        assert base is not None
                        name, payload, secs = await asyncio.to_thread(
                            _compress, view, base[1][start : start + view.nbytes], elem
                        )
                        policy.record_delta(view.nbytes, len(payload), secs)  # type: ignore[arg-type]
                        if name == "delta-lz4":
                            base_step = base[0]
                            delta_chunks += 1
                    elif how == "probe":
                        assert base is not None
                        lo, hi = policy.sample(view.nbytes)
                        _, sample, secs = await asyncio.to_thread(
                            _compress, view[lo:hi], base[1][start + lo : start + hi], elem
                        )
                        policy.record_delta(hi - lo, len(sample), secs)
                    size = len(payload)  # type: ignore[arg-type]
                    await pacer.take(size)
                    await link.send(
                        Chunk(
                            job=job,
                            rank=rank,
                            step=step,
                            index=sent,
                            codec=name,
                            raw_len=view.nbytes,
                            checksum=seal.block_sum(sent, view),
                            base_step=base_step,
                            elem=elem,
                            payload=payload,  # type: ignore[arg-type]
                        )
                    )
                    wire += size
                    sent += 1
                    inflight += 1
                ack = await link.receive(replies, ChunkAck)
                assert isinstance(ack, ChunkAck)
                if ack.index in acks_seen and not ack.complete:  # the one that says complete always counts
                    continue
                acks_seen.add(ack.index)
                inflight -= min(ack.count, inflight)
                complete = ack.complete
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"[:200]
            link.send_nowait(
                StreamAbort(job=job, rank=rank, step=step, reason=reason)
            )  # best effort: it may be gone
            raise
    seconds = time.perf_counter() - t0
    if math.isinf(pacer.rate):  # a paced stream's throughput is the pacer's choice, not the link's
        policy.record_stream(wire, seconds)
    pacer.observe_throughput(wire / seconds if seconds > 0 else math.inf)
    return SendResult(nbytes, wire, seconds, delta_chunks)


async def _push(
    link: PeerLink,
    replies: asyncio.Queue[Any],
    accept: StreamAccept,
    lanes: int,
    *,
    data: memoryview,
    seal: Seal,
    pacer: Pacer,
    policy: CodecPolicy,
    base: tuple[int, memoryview] | None,
    elem: int,
) -> int:
    """Push every chunk of ``data`` over the buddy's bulk port (the accept's port and token) and wait until the
    buddy holds the snapshot complete; the bytes sent. Chunks go raw; in ``auto`` mode some still probe the
    codec (a sample compressed and timed, see :class:`CodecPolicy`).

    Raises:
        PeerError: the buddy refused a chunk (its Error, which names why) or failed, or a connection failed.
    """
    host = urlsplit(link.addr).hostname
    if host is None:
        raise PeerError(f"{link.addr} names no host for its bulk port")
    nchunks = -(-data.nbytes // seal.block_bytes)
    pushing = Lanes(
        host,
        accept.upload_port,
        accept.upload_token,
        count=max(1, min(lanes, nchunks)),
        seal=seal,
        data=data,
        timeout=link.timeout,
    )
    wire = 0
    try:
        for index in range(nchunks):
            if pushing.failed:
                break
            start = index * seal.block_bytes
            view = data[start : start + seal.block_bytes]
            if base is not None and policy.choose(pacer.cap) == "probe":
                lo, hi = policy.sample(view.nbytes)
                _, sample, secs = await asyncio.to_thread(
                    _compress, view[lo:hi], base[1][start + lo : start + hi], elem
                )
                policy.record_delta(hi - lo, len(sample), secs)
            await pacer.take(view.nbytes)
            pushing.send(index)
            wire += view.nbytes
        try:
            await pushing.finish()
        except PushFailed as exc:  # the buddy may have said why on the data plane: its word names the cause
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(link.receive(replies, ChunkAck), timeout=1.0)
            raise PeerError(f"pushing to {link.addr} failed: {exc}") from exc
    finally:
        await pushing.stop()
    while True:
        ack = await link.receive(replies, ChunkAck)
        assert isinstance(ack, ChunkAck)
        if ack.complete:
            return wire


async def describe_snapshot(links: Sequence[PeerLink], *, job: str, rank: int, step: int) -> StreamBegin:
    """The manifest of ``(job, rank, step)`` from the first of ``links`` (its holders) that describes it with blobs
    that pass their digest.

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
                if codec.blob_digest(reply.table, reply.meta) != reply.digest:
                    raise PeerError(f"{link.addr} described {what} with blobs that fail their digest")
                return reply
            except PeerError as exc:
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
) -> tuple[StreamBegin, Seal, int]:
    """Fetch the complete snapshot ``(job, rank, step)`` from ``links`` (its holders), striped across all of them.

    ``manifest``: the snapshot's description, when :func:`describe_snapshot` already got it (else it is asked
    for here). ``allocate(manifest)`` returns where the chunks go (a :data:`~.placement.Lander`, e.g.
    :func:`~.placement.arena_sink` of a buffer of at least ``manifest.data_bytes``). The manifest's blobs are
    checked against its digest, and every chunk against the checksum its holder carries, before it lands. A
    holder that fails, goes silent, sends a chunk that fails its check or finds its own copy corrupt has its
    chunks reassigned to the others. Returns the manifest, the copy's seal (the carried checksums, for the new
    holder to keep) and the number of payload bytes received.

    Raises:
        CorruptEverywhere: a chunk failed its check from every holder that sent it.
        PullFailed: no holder described the snapshot, or every holder failed before all chunks arrived.
        PlacementError: the lander could not write (the pull stops at once: no holder can help).
    """
    if manifest is None:
        manifest = await describe_snapshot(links, job=job, rank=rank, step=step)
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
                        received += msg.payload.nbytes
                        if on_progress is not None:
                            on_progress(msg.raw_len)
                except PlacementError:
                    raise
                except Exception as exc:
                    if (
                        isinstance(exc, PeerError) and exc.code == ErrorCode.CORRUPT
                    ):  # it dropped its own copy
                        for i in missing:
                            corrupt_from.setdefault(i, []).append(link.addr)
                    pending.extend(range(i, i + 1) for i in sorted(missing))
                    alive.remove(link)
                    errors.append(f"{link.addr}: {exc}")
                    log.warning("pull of %s from %s failed: %s", what, link.addr, exc)
                    return

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
