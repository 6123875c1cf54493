"""The records nested in messages: each a frozen dataclass sent as a msgpack list of its fields in order."""

from __future__ import annotations

import dataclasses

from . import limits as L
from .compound import ListOf
from .fields import ADDR, JOB, PID, RANK, STEP, STEP_OR_NONE, TEXT, WORLD
from .schema import Bool, Enum, Int, spec_field

__all__ = [
    "PLAN_STATUSES",
    "Assignment",
    "HeldSeat",
    "InventoryItem",
    "PathTrouble",
    "RankInfo",
    "RankPlan",
    "RankPlanFields",
    "ReplicateTask",
    "Watermark",
]

PLAN_STATUSES = ("ready", "fresh", "none")
"""What one rank's plan may say (see :class:`~snapshotd.proto.PlanReply`); ``wait`` is never one rank's alone."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankInfo:
    """A training rank that registered with a sidecar."""

    job: str = spec_field(JOB)
    rank: int = spec_field(RANK)
    world_size: int = spec_field(WORLD)
    pid: int = spec_field(PID)
    alive: bool = spec_field(Bool())


@dataclasses.dataclass(frozen=True, slots=True)
class HeldSeat:
    """A seat a sidecar's node was given (see :mod:`snapshotd.coordinator.seats`): ranks ``first`` up to
    ``first + per_node - 1`` of ``job`` (of ``world_size`` ranks), given at ``granted`` (the coordinator's wall
    clock, microseconds since the epoch: of two nodes claiming one seat, the later grant holds it)."""

    job: str = spec_field(JOB)
    first: int = spec_field(RANK)
    per_node: int = spec_field(Int(1, L.MAX_PLAN_RANKS))
    world_size: int = spec_field(WORLD)
    granted: int = spec_field(Int(0, 1 << 62))


@dataclasses.dataclass(frozen=True, slots=True)
class PathTrouble:
    """A peer this sidecar cannot move snapshots to or from now (see :mod:`snapshotd.sidecar.paths`): its data
    address, and why, for people (``unreachable: ...``: a connection to it fails; ``slow: ...``: it connects,
    but no stream to it completed within the peer timeout)."""

    addr: str = spec_field(ADDR)
    reason: str = spec_field(TEXT)


@dataclasses.dataclass(frozen=True, slots=True)
class InventoryItem:
    """A snapshot ``(job, rank, step)`` that a sidecar holds complete.

    ``local`` is true for the rank's own shared-memory slot on its own node (a cache that durability does not
    count), false for a buddy copy.
    """

    job: str = spec_field(JOB)
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    local: bool = spec_field(Bool())


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """Where the sidecar of ``rank``'s node streams that rank's snapshots: the buddies' data addresses."""

    job: str = spec_field(JOB)
    rank: int = spec_field(RANK)
    buddies: tuple[str, ...] = spec_field(ListOf(ADDR, 64))


@dataclasses.dataclass(frozen=True, slots=True)
class Watermark:
    """A job's recoverable step G and its newest durable step D (-1: none yet).

    ``unusable``: steps above D that some rank holds but that no restore can use, the oldest first (none by
    default): another rank holds a newer step without this one, or the step is *stale*, held when a plan round
    froze at an older step, so a copy of it may come from the run that failed (see
    :meth:`snapshotd.coordinator.jobs.Job.unusable`). A sidecar frees its copies of them at once, local and
    buddy; a buddy copy still arriving once it is complete.
    """

    job: str = spec_field(JOB)
    recoverable: int = spec_field(STEP_OR_NONE)
    durable: int = spec_field(STEP_OR_NONE)
    unusable: tuple[int, ...] = spec_field(ListOf(STEP, L.MAX_UNUSABLE_STEPS), default=())


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicateTask:
    """Ask a sidecar to pull ``(job, rank, step)`` from ``sources`` and keep it as a buddy copy."""

    job: str = spec_field(JOB)
    rank: int = spec_field(RANK)
    step: int = spec_field(STEP)
    sources: tuple[str, ...] = spec_field(ListOf(ADDR, 64))


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank's recovery plan (see :class:`~snapshotd.proto.PlanReply` for what each ``status`` means).

    ``step`` is -1 for ``none``; ``local``: the asking node holds the snapshot; ``sources``: the data addresses
    of the other live nodes holding it; ``reason``: why, for ``fresh`` and ``none`` ("" for ``ready``).
    """

    rank: int = spec_field(RANK)
    status: str = spec_field(Enum(PLAN_STATUSES))
    step: int = spec_field(STEP_OR_NONE)
    local: bool = spec_field(Bool())
    sources: tuple[str, ...] = spec_field(ListOf(ADDR, 64))
    reason: str = spec_field(TEXT)


RankPlanFields = tuple[int, str, int, bool, tuple[str, ...], str]
"""A :class:`RankPlan`'s fields in order (its sources a tuple): what
:class:`~snapshotd.proto.wire.PlanReplyPacker` packs without building records."""
