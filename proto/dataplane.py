"""The data-plane conversation: sidecar to sidecar (see :mod:`.messages`); the bulk port's own framing is
:mod:`.bulk`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from . import limits as L
from .compound import ListOf
from .fields import (
    CODECS,
    NAME,
    NBYTES,
    RANK,
    SECONDS,
    STEP,
    STEP_OR_NONE,
    TEXT,
)
from .message import Message, payload
from .schema import Bool, Bytes, Enum, Int, spec_field

__all__ = [
    "Chunk",
    "ChunkAck",
    "PullManifest",
    "PullRequest",
    "StreamAbort",
    "StreamAccept",
    "StreamBegin",
    "Ticket",
    "TicketRequest",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamBegin(Message):
    """Offer (or, answering a :class:`PullManifest`, describe) the snapshot ``(job, rank, step)``.

    ``window``: the sender's credit (unacknowledged chunks it keeps in flight); 0 asks for an ack per chunk.
    ``upload``: the sender would push the chunks over the receiver's bulk port (:mod:`.bulk`) rather than send
    them as :class:`Chunk` messages; the receiver's :class:`StreamAccept` says whether it may.
    ``digest``: :func:`~snapshotd.proto.codec.blob_digest` of ``table`` and ``meta``, taken when the rank
    announced the snapshot and carried unchanged by every holder since. ``chunk_bytes`` is the snapshot's block
    size: each :class:`Chunk`'s ``checksum`` covers one block, in streams and pulls alike. ``stream``: a number
    the sender draws for this stream (0: none), so that a receiver told twice of one stream keeps what arrived.
    """

    TYPE: ClassVar[str] = "stream_begin"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "meta")
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    src_node: str = spec_field(NAME)
    data_bytes: int = spec_field(NBYTES)
    chunk_bytes: int = spec_field(Int(L.MIN_CHUNK_BYTES, L.MAX_CHUNK_BYTES))
    window: int = spec_field(Int(0, 1024), default=0)
    digest: int = spec_field(Int(0, (1 << 64) - 1))
    stream: int = spec_field(Int(0, (1 << 62) - 1), default=0)
    upload: bool = spec_field(Bool(), default=False)
    table: memoryview | bytes = payload(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = payload(L.MAX_META_BYTES)

    @property
    def nchunks(self) -> int:
        return -(-self.data_bytes // self.chunk_bytes)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamAccept(Message):
    """The receiver took the stream; ``bases`` are the steps of this rank it holds complete (delta bases).

    Answering a begin that asked to ``upload``: a nonzero ``upload_port`` is the receiver's bulk port on the host of
    its data address, where the sender pushes the chunks presenting ``upload_token`` (:mod:`.bulk`); 0 means
    send them as :class:`Chunk` messages.
    """

    TYPE: ClassVar[str] = "stream_accept"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    bases: tuple[int, ...] = spec_field(ListOf(STEP, 64))
    upload_port: int = spec_field(Int(0, 65535), default=0)
    upload_token: bytes = spec_field(Bytes(16), default=b"")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Chunk(Message):
    """Chunk ``index`` of ``(job, rank, step)``: ``raw_len`` bytes at ``index * chunk_bytes`` once decoded.

    ``checksum`` is xxh3-64 of the decoded bytes, taken once where the bytes were first read (the sidecar of the
    rank that announced them) and carried unchanged by every holder since: no relay computes it again.
    ``base_step`` names the delta base (``delta-lz4`` only).
    """

    TYPE: ClassVar[str] = "chunk"
    FRAMES: ClassVar[tuple[str, ...]] = ("payload",)
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    index: int = spec_field(Int(0, L.MAX_SNAPSHOT_BYTES))
    codec: str = spec_field(Enum(CODECS), default="raw")
    raw_len: int = spec_field(Int(0, L.MAX_CHUNK_BYTES))
    checksum: int = spec_field(Int(0, (1 << 64) - 1))
    base_step: int = spec_field(STEP_OR_NONE, default=-1)
    elem: int = spec_field(Int(1, 16), default=1)
    payload: memoryview | bytes = payload(L.MAX_CHUNK_BYTES)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChunkAck(Message):
    """``count`` chunks, the last being ``index``, are in and verified; ``complete`` when the snapshot is.

    A receiver acknowledges every few chunks (a quarter of the sender's window, see :class:`StreamBegin`), and
    always the last chunk and the one that completes the snapshot.
    """

    TYPE: ClassVar[str] = "chunk_ack"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    index: int = spec_field(Int(0, L.MAX_SNAPSHOT_BYTES))
    complete: bool = spec_field(Bool(), default=False)
    count: int = spec_field(Int(1, 1024), default=1)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamAbort(Message):
    """The sender gives up on ``(job, rank, step)``; the receiver frees what it had of it."""

    TYPE: ClassVar[str] = "stream_abort"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    reason: str = spec_field(TEXT, default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PullManifest(Message):
    """Ask a holder to describe its complete copy of ``(job, rank, step)``; it answers with a StreamBegin."""

    TYPE: ClassVar[str] = "pull_manifest"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PullRequest(Message):
    """Ask a holder for chunks ``first .. first + count - 1`` of its complete ``(job, rank, step)``."""

    TYPE: ClassVar[str] = "pull_request"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    first: int = spec_field(Int(0, L.MAX_SNAPSHOT_BYTES))
    count: int = spec_field(Int(1, 4096))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TicketRequest(Message):
    """Ask a holder to serve its complete copy of ``(job, rank, step)`` over its bulk port (:mod:`.bulk`), to
    whoever presents the :class:`Ticket` it answers with (an Error: ``not_found``, or ``unexpected`` from a
    holder that serves no bulk port)."""

    TYPE: ClassVar[str] = "ticket_request"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ticket(Message):
    """A holder's answer to :class:`TicketRequest`: connect to ``port`` on the host of its data address and
    present ``token`` within ``expires_s`` seconds; the connection is then served the copy's chunks, the copy
    pinned until it closes. One connection per ticket."""

    TYPE: ClassVar[str] = "ticket"
    FRAMES: ClassVar[tuple[str, ...]] = ("token",)
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    port: int = spec_field(Int(1, 65535))
    expires_s: float = spec_field(SECONDS)
    token: memoryview | bytes = payload(16)
