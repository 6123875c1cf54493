"""Typed messages and their wire form.

Every message is a ZeroMQ multipart message. Frame 0 is a msgpack map with ``v`` (the protocol version),
``type`` and ``job`` plus the message's header fields; each further frame is a raw payload (a chunk of tensor
bytes, an encoded tensor table, a msgpack blob of non-tensor state). :func:`encode` and :func:`decode` never copy a
payload frame: memoryviews go in and memoryviews come out, so a 4 MiB chunk costs the same to encode as a 16-byte
one.

Three conversations use these messages:

- ipc, a training rank and its node's sidecar: :class:`RegisterRank`, :class:`RankRegistered`,
  :class:`Announce`, :class:`SlotUpdate`, :class:`RestoreRequest`, :class:`RestoreReply`.
- data plane, sidecar to sidecar: :class:`StreamBegin`, :class:`StreamAccept`, :class:`Chunk`,
  :class:`ChunkAck`, :class:`StreamAbort`, :class:`PullManifest`, :class:`PullRequest`.
- control plane, sidecar to coordinator: :class:`RegisterSidecar`, :class:`SidecarRegistered`,
  :class:`Heartbeat`, :class:`HeartbeatReply`, :class:`PlanRequest`, :class:`PlanReply`,
  :class:`StatusRequest`, :class:`StatusReply`, :class:`MemberQuery`, :class:`MemberReply`.

Any side may answer with :class:`Error`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack

from . import limits as L
from .errors import LimitExceeded, MalformedMessage, ProtocolError, UnknownMessageType, UnsupportedVersion
from .schema import Bool, Enum, Float, Int, ListOf, Record, Spec, Str, spec_field

PROTOCOL_VERSION = L.PROTOCOL_VERSION

Buffer = bytes | bytearray | memoryview

CODECS = ("raw", "lz4", "shuffle-lz4", "delta-lz4")

_JOB = Str(L.MAX_NAME_LEN)
_NAME = Str(L.MAX_NAME_LEN)
_ADDR = Str(L.MAX_ADDRESS_LEN)
_TEXT = Str(L.MAX_TEXT_LEN)
_RANK = Int(0, L.MAX_RANKS - 1)
_WORLD = Int(1, L.MAX_RANKS)
_STEP = Int(0, L.MAX_STEP)
_STEP_OR_NONE = Int(-1, L.MAX_STEP)  # -1: no such step
_SLOT = Int(0, L.MAX_SLOTS - 1)
_NBYTES = Int(0, L.MAX_SNAPSHOT_BYTES)
_COUNT = Int(0, L.MAX_LIST_ITEMS)
_SECONDS = Float(0.0, 1e9)


class Frame(Spec):
    """A payload frame (not part of the header): any buffer up to ``max_len`` bytes."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def check(self, value: Any, name: str) -> memoryview:
        view = value if isinstance(value, memoryview) else memoryview(value)
        if view.nbytes > self.max_len:
            raise LimitExceeded(f"frame {name!r}: {view.nbytes} bytes, at most {self.max_len}")
        return view


def _frame(max_len: int) -> Any:
    return dataclasses.field(default=b"", metadata={"spec": Frame(max_len)})


# --------------------------------------------------------------------------------------------- nested records


@dataclasses.dataclass(frozen=True, slots=True)
class RankInfo:
    """A training rank that registered with a sidecar."""

    job: str = spec_field(_JOB)
    rank: int = spec_field(_RANK)
    world_size: int = spec_field(_WORLD)
    pid: int = spec_field(Int(0, 1 << 31))
    alive: bool = spec_field(Bool())


@dataclasses.dataclass(frozen=True, slots=True)
class InventoryItem:
    """A snapshot ``(job, rank, step)`` that a sidecar holds complete.

    ``local`` is true for the rank's own shared-memory slot on its own node (a cache that durability does not
    count), false for a buddy copy.
    """

    job: str = spec_field(_JOB)
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    local: bool = spec_field(Bool())


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """Where the sidecar of ``rank``'s node streams that rank's snapshots: the buddies' data addresses."""

    job: str = spec_field(_JOB)
    rank: int = spec_field(_RANK)
    buddies: tuple[str, ...] = spec_field(ListOf(_ADDR, 64))


@dataclasses.dataclass(frozen=True, slots=True)
class Watermark:
    """A job's recoverable step G and its newest durable step D (-1: none yet).

    ``unusable``: steps above D that some rank holds but that no restore can use, the oldest first: another rank
    holds a newer step without this one, or the step is *stale*, held when a plan round froze at an older step, so
    a copy of it may come from the run that failed (see :meth:`snapshotd.coordinator.jobs.Job.unusable`). A
    sidecar frees its copies of them at once, local and buddy; a buddy copy still arriving once it is complete.
    """

    job: str = spec_field(_JOB)
    recoverable: int = spec_field(_STEP_OR_NONE)
    durable: int = spec_field(_STEP_OR_NONE)
    unusable: tuple[int, ...] = spec_field(ListOf(_STEP, L.MAX_UNUSABLE_STEPS), default=(), added=True)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicateTask:
    """Ask a sidecar to pull ``(job, rank, step)`` from ``sources`` and keep it as a buddy copy."""

    job: str = spec_field(_JOB)
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    sources: tuple[str, ...] = spec_field(ListOf(_ADDR, 64))


# ------------------------------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every message. ``job`` is empty for messages that concern no single job."""

    TYPE: ClassVar[str] = ""
    job: str = spec_field(_JOB, default="")


# ipc: training rank <-> its sidecar


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRank(Message):
    """A training process joins: the sidecar (re)creates the rank's arena of ``slots`` x ``data_bytes``."""

    TYPE: ClassVar[str] = "register_rank"
    rank: int = spec_field(_RANK)
    world_size: int = spec_field(_WORLD)
    pid: int = spec_field(Int(0, 1 << 31))
    data_bytes: int = spec_field(_NBYTES)
    slots: int = spec_field(Int(1, L.MAX_SLOTS), default=2)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankRegistered(Message):
    """The arena file to map (owner-only, under /dev/shm) and its geometry; ``pid`` is the sidecar's."""

    TYPE: ClassVar[str] = "rank_registered"
    rank: int = spec_field(_RANK)
    arena: str = spec_field(_ADDR)
    slot_bytes: int = spec_field(_NBYTES)
    slots: int = spec_field(Int(1, L.MAX_SLOTS))
    pid: int = spec_field(Int(0, 1 << 31), default=0, added=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UnregisterRank(Message):
    """The training process closed its Snapshotter: the sidecar stops streaming for it and frees its arena."""

    TYPE: ClassVar[str] = "unregister_rank"
    rank: int = spec_field(_RANK)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Announce(Message):
    """Slot ``slot`` now holds the state after ``step`` optimizer steps.

    ``table`` is the encoded tensor table, sent only when it changed (empty otherwise; ``table_id`` names the
    table in force). ``meta`` is the msgpack blob of non-tensor state. ``step_seconds`` is the rank's latest
    step time, for the pacer (0: unknown).
    """

    TYPE: ClassVar[str] = "announce"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "meta")
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    slot: int = spec_field(_SLOT)
    table_id: int = spec_field(Int(0, L.MAX_STEP))
    step_seconds: float = spec_field(_SECONDS, default=0.0)
    table: memoryview | bytes = _frame(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = _frame(L.MAX_META_BYTES)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlotUpdate(Message):
    """The slots the client may write into now, and the newest step of this rank complete on every buddy.

    ``seen_step`` is the newest step the sidecar had been announced when it wrote this update: a client ignores
    the update for any slot it announced (or is staging) with a newer step, since the update predates it.
    ``failed_step`` is a step that did not reach every buddy (``note`` says why); -1 when none failed.
    """

    TYPE: ClassVar[str] = "slot_update"
    rank: int = spec_field(_RANK)
    free_slots: tuple[int, ...] = spec_field(ListOf(_SLOT, L.MAX_SLOTS))
    seen_step: int = spec_field(_STEP_OR_NONE, default=-1)
    durable_step: int = spec_field(_STEP_OR_NONE)
    failed_step: int = spec_field(_STEP_OR_NONE, default=-1)
    note: str = spec_field(_TEXT, default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreRequest(Message):
    """A (re)started rank asks for the job's recoverable state; the sidecar answers within ``timeout_s``.

    ``table`` (the tensor table of the rank's live state) and ``targets`` (per entry, the address of that live
    CPU tensor's contiguous bytes in the requesting process as a little-endian uint64, 0 where it has none)
    let the sidecar write a pulled snapshot straight into the live tensors (see :func:`match_entries`); both
    empty: the arena only.
    """

    TYPE: ClassVar[str] = "restore_request"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "targets")
    rank: int = spec_field(_RANK)
    world_size: int = spec_field(_WORLD)
    timeout_s: float = spec_field(_SECONDS)
    table: memoryview | bytes = _frame(L.MAX_TABLE_BYTES)
    targets: memoryview | bytes = _frame(8 * L.MAX_TENSORS)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreReply(Message):
    """Where the rank's state for ``step`` lies: slot ``slot`` of arena ``arena`` (``source`` says how it got there).

    ``source``: ``fresh`` when the job has no snapshot at all (step 0, nothing to load); ``local`` from the rank's
    own slot; ``replica`` from a copy this node already held for another node (e.g. re-replicated after a node
    loss); ``pull`` fetched from other nodes' sidecars now. The arena may be a new one (sized for the snapshot);
    the client maps it and uses it from then on. ``direct``: the bytes of every entry that
    :func:`match_entries` pairs with a request target were written into that target instead of the slot.
    """

    TYPE: ClassVar[str] = "restore_reply"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "meta")
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    source: str = spec_field(Enum(("fresh", "local", "replica", "pull")))
    arena: str = spec_field(_ADDR, default="")
    slot_bytes: int = spec_field(_NBYTES, default=0)
    slot: int = spec_field(_SLOT, default=0)
    bytes_pulled: int = spec_field(_NBYTES, default=0)
    seconds: float = spec_field(_SECONDS, default=0.0)
    direct: bool = spec_field(Bool(), default=False, added=True)
    table: memoryview | bytes = _frame(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = _frame(L.MAX_META_BYTES)


# data plane: sidecar <-> sidecar


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamBegin(Message):
    """Offer (or, answering a :class:`PullManifest`, describe) the snapshot ``(job, rank, step)``.

    ``window``: the sender's credit (unacknowledged chunks it keeps in flight); 0 asks for an ack per chunk.
    """

    TYPE: ClassVar[str] = "stream_begin"
    FRAMES: ClassVar[tuple[str, ...]] = ("table", "meta")
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    src_node: str = spec_field(_NAME)
    data_bytes: int = spec_field(_NBYTES)
    chunk_bytes: int = spec_field(Int(1, L.MAX_CHUNK_BYTES))
    window: int = spec_field(Int(0, 1024), default=0, added=True)
    table: memoryview | bytes = _frame(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = _frame(L.MAX_META_BYTES)

    @property
    def nchunks(self) -> int:
        return -(-self.data_bytes // self.chunk_bytes)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamAccept(Message):
    """The receiver took the stream; ``bases`` are the steps of this rank it holds complete (delta bases)."""

    TYPE: ClassVar[str] = "stream_accept"
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    bases: tuple[int, ...] = spec_field(ListOf(_STEP, 64))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Chunk(Message):
    """Chunk ``index`` of ``(job, rank, step)``: ``raw_len`` bytes at ``index * chunk_bytes`` once decoded.

    ``checksum`` is xxh3-64 of the decoded bytes; ``base_step`` names the delta base (``delta-lz4`` only).
    """

    TYPE: ClassVar[str] = "chunk"
    FRAMES: ClassVar[tuple[str, ...]] = ("payload",)
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    index: int = spec_field(Int(0, L.MAX_SNAPSHOT_BYTES))
    codec: str = spec_field(Enum(CODECS), default="raw")
    raw_len: int = spec_field(Int(0, L.MAX_CHUNK_BYTES))
    checksum: int = spec_field(Int(0, (1 << 64) - 1))
    base_step: int = spec_field(_STEP_OR_NONE, default=-1)
    elem: int = spec_field(Int(1, 16), default=1)
    payload: memoryview | bytes = _frame(L.MAX_CHUNK_BYTES)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChunkAck(Message):
    """``count`` chunks, the last being ``index``, are in and verified; ``complete`` when the snapshot is.

    A receiver acknowledges every few chunks (a quarter of the sender's window, see :class:`StreamBegin`), and
    always the last chunk and the one that completes the snapshot.
    """

    TYPE: ClassVar[str] = "chunk_ack"
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    index: int = spec_field(Int(0, L.MAX_SNAPSHOT_BYTES))
    complete: bool = spec_field(Bool(), default=False)
    count: int = spec_field(Int(1, 1024), default=1, added=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamAbort(Message):
    """The sender gives up on ``(job, rank, step)``; the receiver frees what it had of it."""

    TYPE: ClassVar[str] = "stream_abort"
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    reason: str = spec_field(_TEXT, default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PullManifest(Message):
    """Ask a holder to describe its complete copy of ``(job, rank, step)``; it answers with a StreamBegin."""

    TYPE: ClassVar[str] = "pull_manifest"
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PullRequest(Message):
    """Ask a holder for chunks ``first .. first + count - 1`` of its complete ``(job, rank, step)``."""

    TYPE: ClassVar[str] = "pull_request"
    rank: int = spec_field(_RANK)
    step: int = spec_field(_STEP)
    first: int = spec_field(Int(0, L.MAX_SNAPSHOT_BYTES))
    count: int = spec_field(Int(1, 4096))


# control plane: sidecar <-> coordinator


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RegisterSidecar(Message):
    """A sidecar joins. A new ``incarnation`` under a known ``node`` name means that node's old data is gone."""

    TYPE: ClassVar[str] = "register_sidecar"
    node: str = spec_field(_NAME)
    rack: str = spec_field(_NAME, default="")
    data_addr: str = spec_field(_ADDR)
    incarnation: str = spec_field(_NAME)


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
    node: str = spec_field(_NAME)
    incarnation: str = spec_field(_NAME)
    changed: bool = spec_field(Bool(), default=True)
    ranks: tuple[RankInfo, ...] = spec_field(ListOf(Record(RankInfo), L.MAX_LIST_ITEMS), factory=tuple)
    inventory: tuple[InventoryItem, ...] = spec_field(
        ListOf(Record(InventoryItem), L.MAX_LIST_ITEMS), factory=tuple
    )
    bytes_out: int = spec_field(Int(0, 1 << 62), default=0)
    bytes_in: int = spec_field(Int(0, 1 << 62), default=0)
    stored_bytes: int = spec_field(Int(0, 1 << 62), default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatReply(Message):
    """Placement, watermarks and re-replication work for the sidecar. ``known`` false: register again.

    ``heartbeat_interval``, when not 0, is the interval the sidecar heartbeats at from now on (the coordinator
    stretches it as the fleet grows); 0 keeps the one it has. Added after the first release: left out of the
    header while 0.
    """

    TYPE: ClassVar[str] = "heartbeat_reply"
    known: bool = spec_field(Bool(), default=True)
    assignments: tuple[Assignment, ...] = spec_field(ListOf(Record(Assignment), L.MAX_LIST_ITEMS), factory=tuple)
    watermarks: tuple[Watermark, ...] = spec_field(ListOf(Record(Watermark), L.MAX_LIST_ITEMS), factory=tuple)
    tasks: tuple[ReplicateTask, ...] = spec_field(ListOf(Record(ReplicateTask), 4096), factory=tuple)
    heartbeat_interval: float = spec_field(Float(0.0, 3600.0), default=0.0, added=True)


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank's recovery plan inside a :class:`PlanReply` (see its ``status`` for the meanings)."""

    rank: int = spec_field(_RANK)
    status: str = spec_field(Enum(("ready", "fresh", "none")))
    step: int = spec_field(_STEP_OR_NONE)
    local: bool = spec_field(Bool())
    sources: tuple[str, ...] = spec_field(ListOf(_ADDR, 64))
    reason: str = spec_field(_TEXT)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest(Message):
    """Ranks of ``job`` (on sidecar ``node``) are restoring and need the job-wide recovery step.

    ``rank`` and ``ranks`` (added after the first release: left out of the header while empty) are every rank
    of the node asking at once, each at most once: a sidecar asks for all its restoring ranks in one request
    and gets one reply, so that the coordinator's load grows with the number of sidecars, not ranks.
    """

    TYPE: ClassVar[str] = "plan_request"
    rank: int = spec_field(_RANK)
    world_size: int = spec_field(_WORLD)
    node: str = spec_field(_NAME)
    ranks: tuple[int, ...] = spec_field(ListOf(_RANK, L.MAX_PLAN_RANKS - 1), default=(), added=True)

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
    ``plans`` holds one entry per rank of the request's ``ranks``, in its order (added after the first release:
    left out of the header while empty).
    """

    TYPE: ClassVar[str] = "plan_reply"
    rank: int = spec_field(_RANK)
    status: str = spec_field(Enum(("ready", "wait", "fresh", "none")))
    step: int = spec_field(_STEP_OR_NONE, default=-1)
    local: bool = spec_field(Bool(), default=False)
    sources: tuple[str, ...] = spec_field(ListOf(_ADDR, 64), factory=tuple)
    reason: str = spec_field(_TEXT, default="")
    plans: tuple[RankPlan, ...] = spec_field(ListOf(Record(RankPlan), L.MAX_PLAN_RANKS - 1), default=(), added=True)

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
    body: memoryview | bytes = _frame(L.MAX_META_BYTES)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemberQuery(Message):
    """Whether ``host`` (the IPv4 address a data-plane connection came from) is a member: the host of the data
    address of a live sidecar registered with the coordinator (one coordinator serves one job). Asked by
    sidecars in ``members`` mode."""

    TYPE: ClassVar[str] = "member_query"
    host: str = spec_field(_ADDR)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemberReply(Message):
    """The answer to a :class:`MemberQuery`: ``node`` is a live member on ``host`` (empty when ``member`` is false)."""

    TYPE: ClassVar[str] = "member_reply"
    host: str = spec_field(_ADDR)
    member: bool = spec_field(Bool())
    node: str = spec_field(Str(L.MAX_NAME_LEN), default="")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Error(Message):
    """A refusal. ``code`` is machine-readable (e.g. ``memory_limit``, ``not_found``, ``bad_message``)."""

    TYPE: ClassVar[str] = "error"
    code: str = spec_field(_NAME)
    message: str = spec_field(_TEXT, default="")
    rank: int = spec_field(Int(-1, L.MAX_RANKS), default=-1)
    step: int = spec_field(_STEP_OR_NONE, default=-1)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        RegisterRank, RankRegistered, UnregisterRank, Announce, SlotUpdate, RestoreRequest, RestoreReply,
        StreamBegin, StreamAccept, Chunk, ChunkAck, StreamAbort, PullManifest, PullRequest,
        RegisterSidecar, SidecarRegistered, Heartbeat, HeartbeatReply, PlanRequest, PlanReply,
        StatusRequest, StatusReply, MemberQuery, MemberReply, Error,
    )
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    """How one message type sits on the wire, computed once per type."""

    header: tuple[tuple[str, Spec], ...]  # header fields in field order
    frames: tuple[tuple[str, Frame], ...]  # payload frames in order
    allowed: frozenset[str]  # keys a header may carry
    required: frozenset[str]  # header fields without a default
    added: dict[str, Any]  # fields added later -> the default that leaves them out of the header


def _layout(cls: type[Message]) -> _Layout:
    header: list[tuple[str, Spec]] = []
    frames: list[tuple[str, Frame]] = []
    required: set[str] = set()
    added: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata["spec"]
        (frames if isinstance(spec, Frame) else header).append((f.name, spec))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.add(f.name)
        if f.metadata.get("added"):
            added[f.name] = f.default
    names = {name for name, _ in header}
    return _Layout(tuple(header), tuple(frames), frozenset(names | {"v", "type"}), frozenset(required & names), added)


def omitted(cls: type[Message], name: str, value: Any) -> bool:
    """Whether :func:`encode` leaves field ``name`` holding ``value`` out of a ``cls`` header (see ``spec_field``)."""
    added = _LAYOUTS[cls.TYPE].added
    return name in added and type(value) is type(added[name]) and value == added[name]


_LAYOUTS = {name: _layout(cls) for name, cls in MESSAGE_TYPES.items()}
_ABSENT: Any = object()


def encode(msg: Message) -> list[Buffer]:
    """The frames of ``msg``: a msgpack header, then each payload frame as given (never copied).

    Raises:
        ProtocolError: a field violates its spec (we never send what we would refuse to receive).
    """
    layout = _LAYOUTS[msg.TYPE]
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    for name, spec in layout.header:
        value = getattr(msg, name)
        if name in layout.added and omitted(type(msg), name, value):
            continue
        dumped = spec.dump(value)
        spec.check(dumped, f"{msg.TYPE}.{name}")
        header[name] = dumped
    out: list[Buffer] = [msgpack.packb(header, use_bin_type=True)]
    for name, fspec in layout.frames:
        value = getattr(msg, name)
        fspec.check(value, name)
        out.append(value)
    if len(out[0]) > L.MAX_HEADER_BYTES:
        raise LimitExceeded(f"{msg.TYPE} header is {len(out[0])} bytes, at most {L.MAX_HEADER_BYTES}")
    return out


def _as_view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is None:
        buf = frame
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
    except TypeError as exc:
        raise MalformedMessage(f"frame of type {type(frame).__name__} is not a buffer") from exc
    if not view.c_contiguous:
        raise MalformedMessage("frame is not a contiguous buffer")
    if view.ndim != 1 or view.itemsize != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise MalformedMessage(f"frame cannot be read as bytes: {exc}") from exc
    return view


def decode(frames: Sequence[Any]) -> Message:
    """Parse and validate one multipart message.

    Args:
        frames: bytes, memoryviews or ``zmq.Frame`` objects; payload frames come back as memoryviews of them.

    Raises:
        ProtocolError: and nothing else, for any input.
    """
    if not isinstance(frames, Sequence) or len(frames) == 0:
        raise MalformedMessage("a message needs at least a header frame")
    head = _as_view(frames[0])
    if head.nbytes > L.MAX_HEADER_BYTES:
        raise LimitExceeded(f"header frame is {head.nbytes} bytes, at most {L.MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=L.MAX_TEXT_LEN * 4,
            max_bin_len=L.MAX_HEADER_BYTES,
            max_array_len=L.MAX_LIST_ITEMS,
            max_map_len=1024,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError, TypeError ...)
        raise MalformedMessage(f"header is not a valid msgpack map: {exc}") from exc
    if type(header) is not dict:
        raise MalformedMessage(f"header is a msgpack {type(header).__name__}, not a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise UnsupportedVersion(f"protocol version {version!r}; this build speaks {PROTOCOL_VERSION}")
    mtype = header.get("type")
    if type(mtype) is not str or mtype not in MESSAGE_TYPES:
        raise UnknownMessageType(f"unknown message type {mtype!r}")
    cls = MESSAGE_TYPES[mtype]
    layout = _LAYOUTS[mtype]
    if len(frames) != 1 + len(layout.frames):
        raise MalformedMessage(f"{mtype} has {len(layout.frames)} payload frames, got {len(frames) - 1}")
    if not header.keys() <= layout.allowed:
        unknown = header.keys() - layout.allowed
        raise MalformedMessage(f"{mtype}: unknown header fields {sorted(map(str, unknown))[:5]}")
    kwargs: dict[str, Any] = {}
    for name, spec in layout.header:
        value = header.get(name, _ABSENT)
        if value is not _ABSENT:
            kwargs[name] = spec.check(value, name)
        elif name in layout.required:
            raise MalformedMessage(f"{mtype}: missing field {name!r}")
    for (name, fspec), frame in zip(layout.frames, frames[1:], strict=True):
        kwargs[name] = fspec.check(_as_view(frame), name)
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except Exception as exc:  # defensive: a dataclass should never refuse validated values
        raise MalformedMessage(f"{mtype}: {exc}") from exc


__all__ = [
    "CODECS",
    "PROTOCOL_VERSION",
    "Announce",
    "Assignment",
    "Chunk",
    "ChunkAck",
    "Error",
    "Heartbeat",
    "HeartbeatReply",
    "InventoryItem",
    "MESSAGE_TYPES",
    "MemberQuery",
    "MemberReply",
    "Message",
    "PlanReply",
    "PlanRequest",
    "PullManifest",
    "PullRequest",
    "RankInfo",
    "RankPlan",
    "RankRegistered",
    "RegisterRank",
    "RegisterSidecar",
    "ReplicateTask",
    "RestoreReply",
    "RestoreRequest",
    "SidecarRegistered",
    "SlotUpdate",
    "StatusReply",
    "StatusRequest",
    "StreamAbort",
    "StreamAccept",
    "StreamBegin",
    "UnregisterRank",
    "Watermark",
    "decode",
    "encode",
    "omitted",
]
