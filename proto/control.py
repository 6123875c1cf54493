"""The control-plane conversation: sidecar to coordinator, and ``snapshotd status`` / ``export`` to the
coordinator; and :class:`Error`, which any side may answer with (see :mod:`.messages`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from . import limits as L
from .compound import ListOf, Record
from .errors import ErrorCode
from .fields import (
    ADDR,
    NAME,
    RANK,
    REQUEST_ID,
    SECONDS,
    STEP_OR_NONE,
    TEXT,
    WORLD,
)
from .message import Message, payload
from .records import (
    Assignment,
    HeldSeat,
    InventoryItem,
    PathTrouble,
    RankInfo,
    RankPlan,
    ReplicateTask,
    Watermark,
)
from .schema import Bool, Enum, Float, Int, Str, spec_field

__all__ = [
    "Drain",
    "DrainReply",
    "Error",
    "Heartbeat",
    "HeartbeatReply",
    "HoldersQuery",
    "HoldersReply",
    "MemberQuery",
    "MemberReply",
    "PeerLostReply",
    "PeerLostReport",
    "PlanReply",
    "PlanRequest",
    "RegisterSidecar",
    "SeatReply",
    "SeatRequest",
    "SidecarRegistered",
    "StatusReply",
    "StatusRequest",
]


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
    unreachable: tuple[PathTrouble, ...] = spec_field(
        ListOf(Record(PathTrouble), L.MAX_LIST_ITEMS), factory=tuple
    )
    """In every heartbeat: the peers this sidecar cannot move snapshots to or from now. The coordinator places no
    buddy across a broken pair of nodes while another can be placed (see :mod:`snapshotd.coordinator.paths`)."""


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
    body: memoryview | bytes = payload(L.MAX_META_BYTES)


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
    until it answers ``given`` or ``timeout_s`` seconds have passed. In a sidecar's ask, ``timeout_s`` is how long
    that ask waits for its answer: the coordinator holds it a little less at most (0: as long as it holds any
    ask). ``held``: the first rank of the seat the
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
    it stops once the reply counts nothing ``remaining``. Sent again until then. ``timeout_s`` is how long the
    sidecar waits for this one's answer: the coordinator holds it a little less at most, answering as soon as the
    count changes (0: as long as it holds any ask)."""

    TYPE: ClassVar[str] = "drain"
    node: str = spec_field(NAME)
    incarnation: str = spec_field(NAME)
    timeout_s: float = spec_field(SECONDS, default=0.0)


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
