"""The message catalogue: every message type and its header fields.

Every message is a ZeroMQ multipart message. Frame 0 is a msgpack map with ``v`` (the protocol version),
``type`` and ``job`` plus the message's header fields; each further frame is a raw payload (a chunk of tensor
bytes, an encoded tensor table, a msgpack blob of non-tensor state). :mod:`.wire` encodes and decodes them.

Three conversations use these messages:

- ipc, a training rank and its node's sidecar: :class:`RegisterRank`, :class:`RankRegistered`,
  :class:`UnregisterRank`, :class:`Announce`, :class:`SlotUpdate`, :class:`RestoreRequest`, :class:`RestoreProgress`,
  :class:`RestoreFetch`, :class:`RestoreFetched`, :class:`RestoreReply`, and :class:`SeatRequest`,
  :class:`SeatReply`, :class:`PeerLostReport`, :class:`PeerLostReply` (also sidecar to coordinator).
- data plane, sidecar to sidecar: :class:`StreamBegin`, :class:`StreamAccept`, :class:`Chunk`,
  :class:`ChunkAck`, :class:`StreamAbort`, :class:`PullManifest`, :class:`PullRequest`, :class:`TicketRequest`,
  :class:`Ticket` (the bytes a ticket admits to go over a holder's bulk port instead: :mod:`.bulk`).
- control plane, sidecar to coordinator: :class:`RegisterSidecar`, :class:`SidecarRegistered`,
  :class:`Heartbeat`, :class:`HeartbeatReply`, :class:`PlanRequest`, :class:`PlanReply`,
  :class:`StatusRequest`, :class:`StatusReply`, :class:`MemberQuery`, :class:`MemberReply`, :class:`Drain`,
  :class:`DrainReply`; and from
  ``snapshotd export``: :class:`HoldersQuery`, :class:`HoldersReply`.

Any side may answer with :class:`Error`. A header field with a default may be left out of a header; every other
field must be there. A rank numbers its ipc requests that await an answer (:class:`RegisterRank`,
:class:`RestoreRequest`, :class:`SeatRequest`: ``request_id``), and the answer, reply or :class:`Error`, carries
the number back, so that the rank pairs them whatever else the sidecar sends meanwhile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from . import limits as L
from .errors import ErrorCode
from .fields import (
    ADDR,
    CODECS,
    JOB,
    NAME,
    NBYTES,
    PID,
    RANK,
    REQUEST_ID,
    SECONDS,
    SLOT,
    STEP,
    STEP_OR_NONE,
    TEXT,
    WORLD,
)
from .records import Assignment, HeldSeat, InventoryItem, RankInfo, RankPlan, ReplicateTask, Watermark
from .schema import Bool, Bytes, Enum, Float, Frame, Int, ListOf, Record, Str, spec_field

__all__ = [
    "MESSAGE_TYPES",
    "Announce",
    "Chunk",
    "ChunkAck",
    "Error",
    "Heartbeat",
    "HeartbeatReply",
    "HoldersQuery",
    "HoldersReply",
    "MemberQuery",
    "MemberReply",
    "Message",
    "PeerLostReport",
    "PeerLostReply",
    "Drain",
    "DrainReply",
    "PlanReply",
    "PlanRequest",
    "PullManifest",
    "PullRequest",
    "RankRegistered",
    "RegisterRank",
    "RegisterSidecar",
    "RestoreFetch",
    "RestoreFetched",
    "RestoreProgress",
    "RestoreReply",
    "RestoreRequest",
    "SeatReply",
    "SeatRequest",
    "SidecarRegistered",
    "SlotUpdate",
    "Ticket",
    "TicketRequest",
    "StatusReply",
    "StatusRequest",
    "StreamAbort",
    "StreamAccept",
    "StreamBegin",
    "UnregisterRank",
]


def _payload(max_len: int) -> Any:
    """A payload frame field (not part of the header) of at most ``max_len`` bytes, empty by default."""
    return dataclasses.field(default=b"", metadata={"spec": Frame(max_len)})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every message. ``job`` is empty for messages that concern no single job."""

    TYPE: ClassVar[str] = ""
    job: str = spec_field(JOB, default="")


# ipc: training rank <-> its sidecar


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRank(Message):
    """A training process joins: the sidecar (re)creates the rank's arena of ``slots`` x ``data_bytes``."""

    TYPE: ClassVar[str] = "register_rank"
    request_id: int = spec_field(REQUEST_ID, default=0)
    rank: int = spec_field(RANK)
    world_size: int = spec_field(WORLD)
    pid: int = spec_field(PID)
    data_bytes: int = spec_field(NBYTES)
    slots: int = spec_field(Int(1, L.MAX_SLOTS), default=2)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankRegistered(Message):
    """The arena file to map (owner-only, under /dev/shm) and its geometry; ``pid`` is the sidecar's."""

    TYPE: ClassVar[str] = "rank_registered"
    request_id: int = spec_field(REQUEST_ID, default=0)
    rank: int = spec_field(RANK)
    arena: str = spec_field(ADDR)
    slot_bytes: int = spec_field(NBYTES)
    slots: int = spec_field(Int(1, L.MAX_SLOTS))
    pid: int = spec_field(PID)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UnregisterRank(Message):
    """The training process closed its Snapshotter: the sidecar stops streaming for it and frees its arena."""

    TYPE: ClassVar[str] = "unregister_rank"
    rank: int = spec_field(RANK)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Announce(Message):
    """Slot ``slot`` now holds the state after ``step`` optimizer steps.

    ``table`` is the encoded tensor table, sent only when it changed (empty otherwise; ``table_id`` names the
    table in force). ``meta`` is the msgpack blob of non-tensor state. ``step_seconds`` is the rank's latest
    step time (0: unknown). For the pacer, ``steps`` are the durations of the steps since the previous announce,
    oldest first (the last is ``step_seconds``; at most 64), and ``steps_end`` the ``time.monotonic()`` at which
    the last of them ended (0: unknown); the sidecar is on the same host, so on the same clock. ``skipped``
    counts the rank's capture() calls skipped so far, for the sidecar's metrics.
    """

    TYPE: ClassVar[str] = "announce"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "meta")
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    slot: int = spec_field(SLOT)
    table_id: int = spec_field(Int(0, L.MAX_STEP))
    step_seconds: float = spec_field(SECONDS, default=0.0)
    skipped: int = spec_field(Int(0, 1 << 62), default=0)
    steps: tuple[float, ...] = spec_field(ListOf(SECONDS, L.MAX_ANNOUNCED_STEPS), factory=tuple)
    steps_end: float = spec_field(SECONDS, default=0.0)
    table: memoryview | bytes = _payload(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = _payload(L.MAX_META_BYTES)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlotUpdate(Message):
    """The slots the client may write into now, and the newest step of this rank complete on every buddy.

    ``seen_step`` is the newest step the sidecar had been announced when it wrote this update: a client ignores
    the update for any slot it announced (or is staging) with a newer step, since the update predates it.
    ``failed_step`` is a step that did not reach every buddy (``note`` says why); -1 when none failed.
    """

    TYPE: ClassVar[str] = "slot_update"
    rank: int = spec_field(RANK)
    free_slots: tuple[int, ...] = spec_field(ListOf(SLOT, L.MAX_SLOTS))
    seen_step: int = spec_field(STEP_OR_NONE, default=-1)
    durable_step: int = spec_field(STEP_OR_NONE)
    failed_step: int = spec_field(STEP_OR_NONE, default=-1)
    note: str = spec_field(TEXT, default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreRequest(Message):
    """A (re)started rank asks for the job's recoverable state; the sidecar answers within ``timeout_s``.

    ``table`` (the tensor table of the rank's live state) and ``targets`` (per entry, the address of that live
    CPU tensor's contiguous bytes in the requesting process as a little-endian uint64, 0 where it has none)
    let the sidecar write a pulled snapshot straight into the live tensors (see :func:`match_entries`); both
    empty: the arena only. ``progress``: the rank shows the restore's progress, so the sidecar sends it
    :class:`RestoreProgress` messages before its reply (a client that leaves the field out gets none).
    ``fetch``: the rank can fetch a pulled step from the holders itself (:class:`RestoreFetch`); a client that
    leaves the field out is never asked to.
    """

    TYPE: ClassVar[str] = "restore_request"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "targets")
    request_id: int = spec_field(REQUEST_ID, default=0)
    rank: int = spec_field(RANK)
    world_size: int = spec_field(WORLD)
    timeout_s: float = spec_field(SECONDS)
    progress: bool = spec_field(Bool(), default=False)
    fetch: bool = spec_field(Bool(), default=False)
    table: memoryview | bytes = _payload(L.MAX_TABLE_BYTES)
    targets: memoryview | bytes = _payload(8 * L.MAX_TENSORS)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreFetch(Message):
    """The sidecar asks a rank that restores with ``fetch`` to fetch the step it pulls, ``step``, itself: chunks
    of ``chunk_bytes`` (the last one shorter) of ``data_bytes``, striped across the holders' bulk ports
    ``holders`` (``host:port``), each with its :data:`~snapshotd.proto.bulk.TOKEN_BYTES`-byte ticket in
    ``tokens``, in order; every chunk checked against the checksum its holder sends. The bytes of each entry of
    ``table`` that :func:`match_entries` pairs with a target of the rank's request land in that target, the rest
    in slot ``slot`` of arena ``arena`` (``slots`` slots of ``slot_bytes``). The rank answers
    :class:`RestoreFetched` with the same ``fetch`` (a number the sidecar draws, so that an answer to an earlier,
    abandoned fetch is never taken for this one); the :class:`RestoreReply` follows it.
    """

    TYPE: ClassVar[str] = "restore_fetch"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "tokens")
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    fetch: int = spec_field(Int(1, (1 << 62) - 1))
    data_bytes: int = spec_field(NBYTES)
    chunk_bytes: int = spec_field(Int(L.MIN_CHUNK_BYTES, L.MAX_CHUNK_BYTES))
    arena: str = spec_field(ADDR)
    slot_bytes: int = spec_field(NBYTES)
    slots: int = spec_field(Int(1, L.MAX_SLOTS))
    slot: int = spec_field(SLOT)
    holders: tuple[str, ...] = spec_field(ListOf(ADDR, 64))
    table: memoryview | bytes = _payload(L.MAX_TABLE_BYTES)
    tokens: memoryview | bytes = _payload(64 * 16)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreFetched(Message):
    """A rank's answer to :class:`RestoreFetch` (its ``fetch``). ``ok``: every chunk is in place and passed its check; ``sums``
    holds each chunk's checksum as its holder carried it (little-endian uint64, in chunk order), ``fetched`` the
    snapshot's data bytes now in place, ``direct`` whether any went into a target rather than the slot. Else ``reason`` says why;
    the sidecar then pulls the step itself."""

    TYPE: ClassVar[str] = "restore_fetched"
    FRAMES: ClassVar[tuple[str, ...]] = ("sums",)
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    fetch: int = spec_field(Int(1, (1 << 62) - 1))
    ok: bool = spec_field(Bool())
    direct: bool = spec_field(Bool(), default=False)
    fetched: int = spec_field(NBYTES, default=0)
    reason: str = spec_field(TEXT, default="")
    sums: memoryview | bytes = _payload(8 * (L.MAX_SNAPSHOT_BYTES // L.MIN_CHUNK_BYTES))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreProgress(Message):
    """How the restore of ``(job, rank, step)`` goes, for a rank that asked with ``progress``: sent once the
    source is known (``done_bytes`` 0, ``total_bytes`` the snapshot's data bytes), then at most every 0.2 s while
    bytes arrive; the :class:`RestoreReply` ends it. ``source`` is as in the reply; ``sources`` are the data
    addresses of the holders a ``pull`` fetches from (empty otherwise). Informational: the client never acts on
    it beyond showing it.
    """

    TYPE: ClassVar[str] = "restore_progress"
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    done_bytes: int = spec_field(NBYTES)
    total_bytes: int = spec_field(NBYTES)
    source: str = spec_field(Enum(("local", "replica", "pull")))
    sources: tuple[str, ...] = spec_field(ListOf(ADDR, 64), factory=tuple)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreReply(Message):
    """Where the rank's state for ``step`` lies: slot ``slot`` of arena ``arena`` (``source`` says how it got there).

    ``source``: ``fresh`` when the job has no snapshot at all (step 0, nothing to load); ``local`` from the rank's
    own slot; ``replica`` from a copy this node already held for another node (e.g. re-replicated after a node
    loss); ``pull`` fetched from other nodes' sidecars now. The arena may be a new one (sized for the snapshot);
    the client maps it and uses it from then on. ``direct``: the bytes of every entry that
    :func:`match_entries` pairs with a request target were written into that target instead of the slot.
    ``fetched``: the rank read the pulled bytes from the holders itself (:class:`RestoreFetch`).
    """

    TYPE: ClassVar[str] = "restore_reply"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "meta")
    request_id: int = spec_field(REQUEST_ID, default=0)
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    source: str = spec_field(Enum(("fresh", "local", "replica", "pull")))
    arena: str = spec_field(ADDR, default="")
    slot_bytes: int = spec_field(NBYTES, default=0)
    slot: int = spec_field(SLOT, default=0)
    bytes_pulled: int = spec_field(NBYTES, default=0)
    seconds: float = spec_field(SECONDS, default=0.0)
    direct: bool = spec_field(Bool(), default=False)
    fetched: bool = spec_field(Bool(), default=False)
    table: memoryview | bytes = _payload(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = _payload(L.MAX_META_BYTES)


# data plane: sidecar <-> sidecar


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
    table: memoryview | bytes = _payload(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = _payload(L.MAX_META_BYTES)

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
    payload: memoryview | bytes = _payload(L.MAX_CHUNK_BYTES)


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
    token: memoryview | bytes = _payload(16)


# control plane: sidecar <-> coordinator


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RegisterSidecar(Message):
    """A sidecar joins. A new ``incarnation`` under a known ``node`` name means that node's old data is gone."""

    TYPE: ClassVar[str] = "register_sidecar"
    node: str = spec_field(NAME)
    rack: str = spec_field(NAME, default="")
    data_addr: str = spec_field(ADDR)
    incarnation: str = spec_field(NAME)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SidecarRegistered(Message):
    TYPE: ClassVar[str] = "sidecar_registered"
    heartbeat_interval: float = spec_field(Float(0.01, 3600.0))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """A sidecar's liveness and counters; with ``changed``, also its local ranks and full inventory.

    A heartbeat with ``changed`` false carries no ranks or inventory: the coordinator keeps the last ones it got
    from this incarnation. After a coordinator restart the reply says ``known=False`` and the sidecar registers
    again and sends everything.
    """

    TYPE: ClassVar[str] = "heartbeat"
    node: str = spec_field(NAME)
    incarnation: str = spec_field(NAME)
    changed: bool = spec_field(Bool(), default=True)
    ranks: tuple[RankInfo, ...] = spec_field(ListOf(Record(RankInfo), L.MAX_LIST_ITEMS), factory=tuple)
    inventory: tuple[InventoryItem, ...] = spec_field(
        ListOf(Record(InventoryItem), L.MAX_LIST_ITEMS), factory=tuple
    )
    bytes_out: int = spec_field(Int(0, 1 << 62), default=0)
    bytes_in: int = spec_field(Int(0, 1 << 62), default=0)
    stored_bytes: int = spec_field(Int(0, 1 << 62), default=0)
    seq: int = spec_field(Int(0, 1 << 62), default=0)
    """The sidecar's count of heartbeats sent; the reply echoes it, so a late reply is never taken for a newer
    heartbeat's."""
    pace_Bps: int = spec_field(Int(0, 1 << 62), default=0)
    """The pacer's outgoing rate limit, bytes/s (0: unpaced)."""
    step_budget_ppm: int = spec_field(Int(0, 1_000_000), default=0)
    """The pacer's step-time budget, parts per million (0: none told)."""
    step_slowdown_ppm: int = spec_field(Int(-1_000_000, 1 << 40), default=0)
    """The slowdown of the local ranks' steps the pacer measures now, parts per million."""
    seats: tuple[HeldSeat, ...] = spec_field(ListOf(Record(HeldSeat), L.MAX_LIST_ITEMS), factory=tuple)
    """With ``changed``: the seats this node was given (so that a restarted coordinator knows who holds each)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatReply(Message):
    """Placement, watermarks and re-replication work for the sidecar. ``known`` false: register again.

    ``heartbeat_interval``, when not 0, is the interval the sidecar heartbeats at from now on (the coordinator
    stretches it as the fleet grows); 0 (the default) keeps the one it has.
    """

    TYPE: ClassVar[str] = "heartbeat_reply"
    known: bool = spec_field(Bool(), default=True)
    assignments: tuple[Assignment, ...] = spec_field(
        ListOf(Record(Assignment), L.MAX_LIST_ITEMS), factory=tuple
    )
    watermarks: tuple[Watermark, ...] = spec_field(ListOf(Record(Watermark), L.MAX_LIST_ITEMS), factory=tuple)
    tasks: tuple[ReplicateTask, ...] = spec_field(ListOf(Record(ReplicateTask), 4096), factory=tuple)
    heartbeat_interval: float = spec_field(Float(0.0, 3600.0), default=0.0)
    seq: int = spec_field(Int(0, 1 << 62), default=0)
    """The ``seq`` of the heartbeat answered."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest(Message):
    """Ranks of ``job`` (on sidecar ``node``) are restoring and need the job-wide recovery step.

    ``rank`` and ``ranks`` (none by default) are every rank of the node asking at once, each at most once: a
    sidecar asks for all its restoring ranks in one request and gets one reply, so that the coordinator's load
    grows with the number of sidecars, not ranks.

    ``attempt`` (0: none) names the rank calls the request asks for: the sidecar draws a new one when a call joins
    and sends the same one again when it repeats the request (no reply in time, or a ``wait``). A rank the current
    round answered under the same ``attempt`` gets that answer again (its reply was lost or late); a rank that
    asks again after its answer under another attempt (or none) has restarted: it opens a new round.
    """

    TYPE: ClassVar[str] = "plan_request"
    rank: int = spec_field(RANK)
    world_size: int = spec_field(WORLD)
    node: str = spec_field(NAME)
    ranks: tuple[int, ...] = spec_field(ListOf(RANK, L.MAX_PLAN_RANKS - 1), default=())
    attempt: int = spec_field(Int(0, 1 << 62), default=0)

    @property
    def all_ranks(self) -> tuple[int, ...]:
        """``rank``, then ``ranks``."""
        return (self.rank, *self.ranks)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PlanReply(Message):
    """The answer to a :class:`PlanRequest`: the recovery plan of its ``rank``, and in ``plans`` of its ``ranks``.

    ``status``: ``ready`` (restore ``step`` from ``sources``; ``local`` if the asking node holds it),
    ``wait`` (not every rank is accounted for yet; ask again), ``fresh`` (the job has no snapshot: start at 0),
    ``none`` (snapshots exist but no step is complete for every rank: ``reason`` says why). ``wait`` always
    covers the whole request (a round decides every rank at once) and then ``plans`` is empty; otherwise
    ``plans`` holds one entry per rank of the request's ``ranks``, in its order.
    """

    TYPE: ClassVar[str] = "plan_reply"
    rank: int = spec_field(RANK)
    status: str = spec_field(Enum(("ready", "wait", "fresh", "none")))
    step: int = spec_field(STEP_OR_NONE, default=-1)
    local: bool = spec_field(Bool(), default=False)
    sources: tuple[str, ...] = spec_field(ListOf(ADDR, 64), factory=tuple)
    reason: str = spec_field(TEXT, default="")
    plans: tuple[RankPlan, ...] = spec_field(ListOf(Record(RankPlan), L.MAX_PLAN_RANKS - 1), default=())

    @classmethod
    def of(cls, job: str, plans: Sequence[RankPlan]) -> PlanReply:
        """The reply carrying ``plans`` (at least one): the first in the top-level fields, the others in ``plans``;
        the inverse of :meth:`answers`."""
        first = plans[0]
        return cls(
            job=job,
            rank=first.rank,
            status=first.status,
            step=first.step,
            local=first.local,
            sources=first.sources,
            reason=first.reason,
            plans=tuple(plans[1:]),
        )

    def answers(self) -> tuple[RankPlan, ...]:
        """Every rank's plan: ``rank``'s from the top-level fields, then ``plans`` (not for ``wait``)."""
        first = RankPlan(self.rank, self.status, self.step, self.local, self.sources, self.reason)
        return (first, *self.plans)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status_request"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(Message):
    """The coordinator's view as a msgpack document in ``body`` (see ``snapshotd status --json``)."""

    TYPE: ClassVar[str] = "status_reply"
    FRAMES: ClassVar[tuple[str, ...]] = ("body",)
    body: memoryview | bytes = _payload(L.MAX_META_BYTES)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemberQuery(Message):
    """Whether ``host`` (the IPv4 address a data-plane connection came from) is a member: the host of the data
    address of a live sidecar registered with the coordinator (one coordinator serves one job). Asked by
    sidecars in ``members`` mode."""

    TYPE: ClassVar[str] = "member_query"
    host: str = spec_field(ADDR)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemberReply(Message):
    """The answer to a :class:`MemberQuery`: ``node`` is a live member on ``host`` (empty when ``member`` is false)."""

    TYPE: ClassVar[str] = "member_reply"
    host: str = spec_field(ADDR)
    member: bool = spec_field(Bool())
    node: str = spec_field(NAME, default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HoldersQuery(Message):
    """Which live nodes hold step ``step`` of ``job`` (-1: its newest durable step D, or G while there is none)
    complete, for ranks ``first``
    up to ``first + count - 1`` (those below the world size): asked by ``snapshotd export``."""

    TYPE: ClassVar[str] = "holders_query"
    step: int = spec_field(STEP_OR_NONE, default=-1)
    first: int = spec_field(RANK, default=0)
    count: int = spec_field(Int(1, L.MAX_PLAN_RANKS), default=L.MAX_PLAN_RANKS)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HoldersReply(Message):
    """The answer to a :class:`HoldersQuery`: the step answered (-1 when the query asked for D and there is none),
    the job's world size and watermarks, and per rank from ``first`` on the data addresses of the live nodes
    holding the step complete (buddy copies first; empty: no live node holds it)."""

    TYPE: ClassVar[str] = "holders_reply"
    step: int = spec_field(STEP_OR_NONE)
    world_size: int = spec_field(Int(0, L.MAX_RANKS))
    recoverable: int = spec_field(STEP_OR_NONE)
    durable: int = spec_field(STEP_OR_NONE)
    first: int = spec_field(RANK, default=0)
    sources: tuple[tuple[str, ...], ...] = spec_field(ListOf(ListOf(ADDR, 64), L.MAX_PLAN_RANKS), default=())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SeatRequest(Message):
    """Which seat of ``job`` sidecar ``node`` has: the block of ``per_node`` ranks its processes run, of a job of
    ``world_size`` ranks placed by snapshotd (live mode with ``nodes=``; see :mod:`snapshotd.coordinator.seats`).

    A rank asks its sidecar (ipc, ``node`` left empty: the sidecar names itself), which asks the coordinator
    until it answers ``given`` or ``timeout_s`` seconds have passed. ``held``: the first rank of the seat the
    sidecar was given in this job before (-1: none), so that a restarted coordinator gives it the same one;
    ``held_granted``: when it was given (:attr:`SeatReply.granted`)."""

    TYPE: ClassVar[str] = "seat_request"
    request_id: int = spec_field(REQUEST_ID, default=0)
    world_size: int = spec_field(WORLD)
    per_node: int = spec_field(Int(1, L.MAX_PLAN_RANKS))
    node: str = spec_field(Str(L.MAX_NAME_LEN), default="")
    timeout_s: float = spec_field(SECONDS, default=0.0)
    held: int = spec_field(Int(-1, L.MAX_RANKS - 1), default=-1)
    held_granted: int = spec_field(Int(0, 1 << 62), default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SeatReply(Message):
    """The answer to a :class:`SeatRequest`: ``given`` (the node runs ranks ``first`` up to ``first + per_node -
    1``), ``wait`` (every seat is held by a live node: ``reason`` says so; ask again) or ``taken`` (the seat the
    node had, its ``held``, was given to another live node after this one was declared dead: its processes must
    not join the job; final). ``granted``, with ``given``: when the seat was given to the node (the
    coordinator's wall clock, microseconds since the epoch; see :class:`~snapshotd.proto.HeldSeat`)."""

    TYPE: ClassVar[str] = "seat_reply"
    request_id: int = spec_field(REQUEST_ID, default=0)
    status: str = spec_field(Enum(("given", "wait", "taken")))
    first: int = spec_field(RANK, default=0)
    reason: str = spec_field(TEXT, default="")
    granted: int = spec_field(Int(0, 1 << 62), default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerLostReport(Message):
    """Live mode: rank ``rank`` of ``job`` saw a collective fail because a peer's connection closed (its process
    or node is gone). A rank tells its sidecar (ipc, ``node`` left empty: the sidecar names itself), which tells
    the coordinator; the coordinator then probes the job's other nodes at once instead of waiting for their
    heartbeats to stop (see :mod:`snapshotd.coordinator.probes`)."""

    TYPE: ClassVar[str] = "peer_lost_report"
    rank: int = spec_field(RANK)
    node: str = spec_field(Str(L.MAX_NAME_LEN), default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerLostReply(Message):
    """The coordinator's answer to a :class:`PeerLostReport`: ``probed`` nodes of the job are being probed (0: none
    live besides the sender, or all were probed moments ago)."""

    TYPE: ClassVar[str] = "peer_lost_reply"
    probed: int = spec_field(Int(0, L.MAX_RANKS), default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Drain(Message):
    """Sidecar ``node`` (``incarnation``) is stopping: it leaves placement at once (no new copy goes to it; what
    it holds counts as a source, not a copy, and is placed elsewhere, pulled from it while it still serves), and
    it stops once the reply counts nothing ``remaining``. Sent again until then: every one is answered with the
    count of the moment."""

    TYPE: ClassVar[str] = "drain"
    node: str = spec_field(NAME)
    incarnation: str = spec_field(NAME)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DrainReply(Message):
    """The coordinator's answer to a :class:`Drain`: of the snapshots at a job's G that the node holds while fewer
    than ``1 + replicas`` nodes that stay hold them, ``remaining`` can get another copy elsewhere (one is being
    placed), and ``unplaceable`` cannot and are held by no node that stays (every other node left, or shares the
    failure domain of the rank's home): those are lost when the node stops."""

    TYPE: ClassVar[str] = "drain_reply"
    remaining: int = spec_field(Int(0, 1 << 40), default=0)
    unplaceable: int = spec_field(Int(0, 1 << 40), default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Error(Message):
    """A refusal: ``code`` says why for programs (see :class:`ErrorCode`), ``message`` for people.

    ``rank`` and ``step`` name the rank and step refused (-1: none in particular).
    """

    TYPE: ClassVar[str] = "error"
    request_id: int = spec_field(REQUEST_ID, default=0)
    code: ErrorCode = spec_field(Enum.of(ErrorCode))
    message: str = spec_field(TEXT, default="")
    rank: int = spec_field(Int(-1, L.MAX_RANKS), default=-1)
    step: int = spec_field(STEP_OR_NONE, default=-1)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        RegisterRank,
        RankRegistered,
        UnregisterRank,
        Announce,
        SlotUpdate,
        RestoreRequest,
        RestoreProgress,
        RestoreReply,
        RestoreFetch,
        RestoreFetched,
        StreamBegin,
        StreamAccept,
        Chunk,
        ChunkAck,
        StreamAbort,
        PullManifest,
        PullRequest,
        TicketRequest,
        Ticket,
        RegisterSidecar,
        SidecarRegistered,
        Heartbeat,
        HeartbeatReply,
        PlanRequest,
        PlanReply,
        StatusRequest,
        StatusReply,
        MemberQuery,
        MemberReply,
        HoldersQuery,
        HoldersReply,
        SeatRequest,
        SeatReply,
        PeerLostReport,
        PeerLostReply,
        Drain,
        DrainReply,
        Error,
    )
}
