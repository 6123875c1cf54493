"""A restore served from the copies this node holds, and the landing every source of a restore shares.

A step found on this node comes from the rank's own arena (a valid slot: nothing moves; :func:`own_slot_intact`
checks it) or from the copy this node holds for the rank as a buddy (:func:`from_replica`). Each is checked
against the copy's seal (:mod:`.integrity`) before it is served; one that fails is dropped (:func:`drop_corrupt`
says so) and the next source is tried.

Whatever the source, the step lands in slot 0 of the rank's arena, emptied and grown to fit by
:func:`empty_slot`, or, where the restoring process named live tensors that match, straight into them
(:func:`direct_sink`, :mod:`.placement`). A slot that lacks the bytes written directly is not a valid copy of the
step: it is never served or kept as the local fast path. Where it came from is a :class:`Brought`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from snapshotd import proto
from snapshotd.logs import fields
from snapshotd.proto import RestoreRequest
from snapshotd.shm import create_arena

from .integrity import CorruptCopy, Seal
from .local import LocalRank, SlotState
from .node import NodeState
from .placement import DirectSink, arena_sink
from .restore_progress import ProgressReports
from .store import UnknownSnapshot

__all__ = [
    "Brought",
    "RankGone",
    "check_registered",
    "direct_sink",
    "drop_corrupt",
    "empty_slot",
    "from_replica",
    "own_slot_intact",
]

log = logging.getLogger(__name__)


class Brought(NamedTuple):
    """Where a restore brought the step: ``slot``; ``pulled`` bytes over the network; ``direct``: some went
    straight into the rank's tensors (the slot then lacks them); ``by_rank``: the rank fetched them itself."""

    slot: int
    pulled: int
    direct: bool
    by_rank: bool = False


class RankGone(Exception):
    """The restoring rank unregistered (or another registration replaced it) while its restore was pending."""


def check_registered(state: NodeState, lr: LocalRank) -> None:
    """Raises RankGone: ``lr`` unregistered (or was replaced) since its restore began."""
    if state.rank(lr.job, lr.rank) is not lr:
        raise RankGone


def drop_corrupt(state: NodeState, exc: CorruptCopy, job: str, rank: int, step: int) -> None:
    """Count and log a copy of ``(job, rank, step)`` on this node that failed its seal; the caller drops it, and
    the step is taken from another holder."""
    state.counters.corrupt += 1
    log.error(
        "%s; the copy is dropped and the step is taken from another holder",
        exc,
        extra=fields(job, rank, step, "copy_corrupt"),
    )


async def own_slot_intact(state: NodeState, lr: LocalRank, index: int) -> bool:
    """Check the rank's own slot ``index`` against its seal (off the event loop); a slot that fails is dropped
    (False)."""
    s = lr.slots[index]
    assert s.seal is not None  # every valid slot has one
    what = f"the copy of job {lr.job!r} rank {lr.rank} step {s.step} in the rank's own shared memory"
    s.pins += 1
    try:
        await asyncio.to_thread(s.seal.check, lr.arena.slot(index)[: s.data_bytes], s.table, s.meta, what)
    except CorruptCopy as exc:
        drop_corrupt(state, exc, lr.job, lr.rank, s.step)
        if lr.slots[index] is s:
            lr.invalidate(index)
        return False
    finally:
        s.pins -= 1
    return True


def empty_slot(state: NodeState, lr: LocalRank, data_bytes: int) -> int:
    """Make slot 0 of ``lr`` ready to receive ``data_bytes`` (growing the arena if needed); its index.

    Raises:
        RankGone: ``lr`` unregistered meanwhile.
    """
    check_registered(state, lr)
    if data_bytes > lr.arena.slot_bytes:
        old = lr.arena
        lr.arena = create_arena(lr.job, lr.rank, -(-data_bytes // 4096) * 4096, old.slots, node=state.node)
        old.close(unlink=True)
    lr.clear_slots()
    return 0


def direct_sink(
    lr: LocalRank, req: RestoreRequest, table: bytes | memoryview, slot: memoryview
) -> DirectSink | None:
    """A sink into the restoring process's tensors, if it named any that match and the kernel lets us."""
    if not memoryview(req.targets).nbytes:
        return None
    live = proto.decode_table(req.table)
    sink = DirectSink(lr.pid, proto.decode_table(table, slot.nbytes), live, req.targets, slot)
    return sink if sink.direct_bytes and sink.probe() else None


def from_replica(
    state: NodeState, lr: LocalRank, step: int, req: RestoreRequest, progress: ProgressReports
) -> Brought | None:
    """Bring ``step`` of ``lr`` from this node's buddy store into slot 0, or straight into the tensors ``req``
    names; None when the store holds no copy of it, or its copy failed its seal (then discarded; what landed is
    left for the next source to overwrite).

    Raises:
        RankGone: ``lr`` unregistered meanwhile.
        PlacementError: writing into the rank's tensors failed.
    """
    store = state.store
    try:
        snap = store.get(lr.job, lr.rank, step)
    except UnknownSnapshot:
        return None
    progress.tell(step, "replica", 0, snap.data_bytes)
    index = empty_slot(state, lr, snap.data_bytes)
    slot = lr.arena.slot(index)[: snap.data_bytes]
    sink = direct_sink(lr, req, snap.table, slot)
    land = sink.land if sink is not None else arena_sink(slot)
    what = f"the replica of job {lr.job!r} rank {lr.rank} step {step} held on this node"
    try:
        snap.seal.check_blobs(snap.table, snap.meta, what)
        for block, (start, part) in enumerate(snap.data.parts()):
            snap.seal.check_block(block, part, what)
            land(start, part)
    except CorruptCopy as exc:
        drop_corrupt(state, exc, lr.job, lr.rank, step)
        store.discard(snap)
        return None
    seal = Seal(snap.seal.block_bytes, snap.seal.digest, dict(snap.seal.sums))
    lr.set_slot(
        index,
        SlotState(
            step=step,
            valid=sink is None,
            table=snap.table,
            meta=snap.meta,
            data_bytes=snap.data_bytes,
            seal=seal,
        ),
    )
    return Brought(index, 0, sink is not None)
