"""The ipc conversation: a training rank and its node's sidecar (see :mod:`.messages`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from . import limits as L
from .compound import ListOf
from .fields import (
    ADDR,
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
from .message import Message, payload
from .schema import Bool, Enum, Int, spec_field

__all__ = [
    "Announce",
    "RankRegistered",
    "RegisterRank",
    "RestoreFetch",
    "RestoreFetched",
    "RestoreProgress",
    "RestoreReply",
    "RestoreRequest",
    "SlotUpdate",
    "UnregisterRank",
]


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
    table: memoryview | bytes = payload(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = payload(L.MAX_META_BYTES)


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
    table: memoryview | bytes = payload(L.MAX_TABLE_BYTES)
    targets: memoryview | bytes = payload(8 * L.MAX_TENSORS)


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
    table: memoryview | bytes = payload(L.MAX_TABLE_BYTES)
    tokens: memoryview | bytes = payload(64 * 16)


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
    sums: memoryview | bytes = payload(8 * (L.MAX_SNAPSHOT_BYTES // L.MIN_CHUNK_BYTES))


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
    table: memoryview | bytes = payload(L.MAX_TABLE_BYTES)
    meta: memoryview | bytes = payload(L.MAX_META_BYTES)
