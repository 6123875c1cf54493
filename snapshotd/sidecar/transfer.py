"""Moving one snapshot to a buddy: the sender's stream (a pull, the other direction, is :mod:`.pull`).

A stream (:func:`send_snapshot`) offers ``(job, rank, step)`` with a StreamBegin, then sends chunks under
credit-based flow control (at most ``window`` unacknowledged) and the node's :class:`Pacer`, each chunk one
block of the slot's :class:`~.integrity.Seal` in one multipart message whose payload frame is a zero-copy view of
shared memory (or a compressed copy when a codec pays, see :class:`CodecPolicy`), or pushed over the buddy's bulk
port (:mod:`.push`). It returns when the buddy acknowledged every chunk, i.e. holds the snapshot complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import time
from typing import Any
from urllib.parse import urlsplit

from snapshotd.proto import (
    Chunk,
    ChunkAck,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    codec,
)

from .inflight import Flight
from .integrity import Seal
from .pacer import Pacer
from .peers import PeerError, PeerLink
from .push import PushFailed

__all__ = ["CodecPolicy", "SendResult", "send_snapshot"]

log = logging.getLogger(__name__)


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
    flight: Flight | None = None,
) -> SendResult:
    """Stream one snapshot to one buddy and return when the buddy holds it complete.

    ``data`` must stay unmodified until this returns (the caller keeps the slot busy). Each chunk is one block of
    ``seal``, sent with the block's checksum (taken now if the seal lacks it, and kept: the streams of one slot to
    several buddies share the seal). ``base`` is the previous snapshot of this rank in the caller's memory (step,
    bytes), usable for delta-lz4 if the buddy holds it too. With ``lanes``, the stream offers to push its chunks
    raw over that many connections to the buddy's bulk port (:mod:`.push`), which the buddy may take or leave.
    ``flight`` (if given) counts the chunks sent and not yet acknowledged as the stream goes (a pushed stream's
    are acknowledged together, when the buddy holds the snapshot complete). On
    any failure or cancellation the buddy is told to abort, and the error propagates.

    Raises:
        PeerError: the buddy refused (memory limit, ...) or failed, or a push connection failed; PeerTimeout when
            it went silent.
    """
    flight = Flight() if flight is None else flight
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
                    flight=flight,
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
                    flight.sent(size, view.nbytes)
                    wire += size
                    sent += 1
                    inflight += 1
                ack = await link.receive(replies, ChunkAck)
                assert isinstance(ack, ChunkAck)
                if ack.index in acks_seen and not ack.complete:  # the one that says complete always counts
                    continue
                acks_seen.add(ack.index)
                flight.acked(ack.count)
                inflight -= min(ack.count, inflight)
                complete = ack.complete
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"[:200]
            # best effort: it may be gone
            link.send_nowait(StreamAbort(job=job, rank=rank, step=step, reason=reason))
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
    flight: Flight,
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
    pushing = link.lanes.take(
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
            flight.sent(view.nbytes)
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
            flight.acked(nchunks)
            return wire
