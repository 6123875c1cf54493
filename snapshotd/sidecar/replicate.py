"""Re-replication: copying a snapshot that lost a holder to this node, when the coordinator asks.

After a node's death some snapshots have fewer copies than ``1 + replicas``; the coordinator names a live node
for each (a :class:`~snapshotd.proto.ReplicateTask` in its heartbeat reply), and that node pulls the copy from
the holders left into its buddy store, where it counts like a streamed one.
"""

from __future__ import annotations

import logging

from snapshotd.logs import fields
from snapshotd.proto import ReplicateTask, StreamBegin

from .node import NodeState
from .peers import PeerLinks
from .placement import Lander
from .pull import pull_snapshot
from .store import StoredSnapshot

__all__ = ["ReplicateService"]

log = logging.getLogger(__name__)


class ReplicateService:
    """Runs the coordinator's re-replication tasks (see the module docstring)."""

    def __init__(self, state: NodeState, links: PeerLinks) -> None:
        self.state = state
        self.links = links
        self._running: set[tuple[str, int, int]] = set()

    async def replicate(self, task: ReplicateTask) -> None:
        """Pull ``(job, rank, step)`` into the buddy store, unless it is held or already arriving here.

        Raises:
            PullFailed, PeerError, ProtocolError, MemoryLimitReached: nothing was kept (a partial copy is dropped).
        """
        store = self.state.store
        key = (task.job, task.rank, task.step)
        if key in self._running or store.holds(*key):
            return  # held, or arriving by a stream right now: a pull would only fight it
        self._running.add(key)
        pinned: list[StoredSnapshot] = []
        try:
            links = [self.links.get(a) for a in task.sources if a != self.state.data_addr]

            def allocate(m: StreamBegin) -> Lander:
                snap = store.begin(
                    task.job,
                    task.rank,
                    task.step,
                    src_node=m.src_node,
                    data_bytes=m.data_bytes,
                    chunk_bytes=m.chunk_bytes,
                    table=m.table,
                    meta=m.meta,
                    digest=m.digest,
                )
                snap.pins += 1  # arriving by a pull, not a stream: never aborted as an idle stream
                pinned.append(snap)
                return snap.data.land

            try:
                _, seal, pulled = await pull_snapshot(
                    links,
                    job=task.job,
                    rank=task.rank,
                    step=task.step,
                    allocate=allocate,
                    paths=self.state.paths,
                )
            except BaseException:
                store.abort(*key)
                raise
            store.mark_complete(*key, seal)
            self.state.counters.pulled(pulled)
            log.info(
                "re-replicated %s rank %d step %d (%d B)",
                task.job,
                task.rank,
                task.step,
                pulled,
                extra=fields(task.job, task.rank, task.step, "replicated"),
            )
        finally:
            for snap in pinned:
                snap.pins -= 1
            self._running.discard(key)
