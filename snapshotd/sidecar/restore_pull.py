"""A restore's step pulled through the sidecars from the live holders the plan names.

The pull is striped across all holders (:func:`~.pull.pull_snapshot`), each chunk checked against the checksum its
holder carries before it lands in slot 0 of the rank's arena or, where the restoring process named live tensors
that match, straight into them (:mod:`.restore_local`). The rank is told how it goes (:class:`.PullProgress`).
"""

from __future__ import annotations

from snapshotd.proto import RestoreRequest, StreamBegin

from .local import LocalRank, SlotState
from .node import NodeState
from .peers import PeerLink
from .placement import Lander, arena_sink
from .pull import pull_snapshot
from .restore_local import Brought, direct_sink, empty_slot
from .restore_progress import PullProgress

__all__ = ["pull_through_sidecars"]


async def pull_through_sidecars(
    state: NodeState,
    lr: LocalRank,
    step: int,
    manifest: StreamBegin,
    links: list[PeerLink],
    req: RestoreRequest,
    progress: PullProgress,
) -> Brought:
    """Pull ``step`` of ``lr``, as ``manifest`` describes it, from the holders behind ``links`` into slot 0 of
    ``lr``, or straight into the tensors ``req`` names. A slot that lacks the bytes written directly is not valid; a pull
    that fails leaves the slot empty.

    Raises:
        PullFailed, PeerError, ProtocolError: the holders could not give the snapshot.
        PlacementError: writing into the rank's tensors failed.
        RankGone: ``lr`` unregistered meanwhile.
    """
    index = 0
    direct = False

    def allocate(m: StreamBegin) -> Lander:
        nonlocal direct
        progress.begin(m.data_bytes)
        empty_slot(state, lr, m.data_bytes)
        lr.slots[index].pins += 1
        slot = lr.arena.slot(index)[: m.data_bytes]
        sink = direct_sink(lr, req, m.table, slot)
        direct = sink is not None
        return sink.land if sink is not None else arena_sink(slot)

    try:
        manifest, seal, pulled = await pull_snapshot(
            links,
            job=lr.job,
            rank=lr.rank,
            step=step,
            allocate=allocate,
            on_progress=progress.landed,
            manifest=manifest,
            paths=state.paths,
        )
    except BaseException:
        lr.set_slot(index, SlotState())
        raise
    lr.set_slot(
        index,
        SlotState(
            step=step,
            valid=not direct,
            table=bytes(manifest.table),
            meta=bytes(manifest.meta),
            data_bytes=manifest.data_bytes,
            seal=seal,
        ),
    )
    state.counters.pulled(pulled)
    return Brought(index, pulled, direct)
