"""Gathering one complete step from the sidecars: which live nodes hold it, and each rank's snapshot from them.

The exporter is a client of the job's daemons and stops nothing: it asks the coordinator which live nodes hold
the step of each rank (:class:`~snapshotd.proto.HoldersQuery`; by default the newest durable step D, or the
recoverable step G while no step is durable, as after a node's loss until re-replication), pulls the
snapshots it needs from those holders as a restoring sidecar does (:func:`~snapshotd.sidecar.pull.pull_snapshot`:
every chunk checked against the seal its holder carries, the table and meta against their digest), and merges
each into an :class:`~snapshotd.export.assembly.Assembly`.

Rank 0's snapshot is always pulled, then only the ranks still needed: the keepers of replicated tensors first,
and every rank when the state holds DTensors. Up to ``parallel`` pulls run at once, each snapshot decoded and
merged (in a worker thread) as it arrives and then dropped: the exporter holds the checkpoint, plus at most
``parallel`` snapshots.

Sidecars drop a step's copies once D has moved past it. If that happens while exporting (a pull finds no holder
left) and no step was named, the export starts again at the newer D, up to :data:`ATTEMPTS` times.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import torch

from snapshotd.proto import (
    Error,
    ErrorCode,
    HoldersQuery,
    HoldersReply,
    StreamBegin,
    decode,
    decode_table,
    encode,
)
from snapshotd.proto.limits import MAX_PLAN_RANKS
from snapshotd.sidecar.node import Counters
from snapshotd.sidecar.peers import PeerLinks
from snapshotd.sidecar.placement import Lander, arena_sink
from snapshotd.sidecar.pull import PullFailed, pull_snapshot
from snapshotd.sidecar.tasks import TaskTree
from snapshotd.transport import Network, Role, Security, open_network

from .assembly import Assembly, Snapshot
from .result import Exported, ExportError

__all__ = ["ATTEMPTS", "Exporter", "attempts", "gather"]

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Exports of a newer durable step tried when the one being exported is collected meanwhile."""


class Exporter:
    """One export's connections: to the coordinator and, as they are needed, to the holders' data planes."""

    def __init__(
        self, network: Network, links: PeerLinks, coordinator: str, job: str, timeout: float, parallel: int
    ) -> None:
        self.network = network
        self.links = links
        self.coordinator = coordinator
        self.control = network.connect(coordinator, Role.COORDINATOR)
        self.job = job
        self.timeout = timeout
        self.parallel = parallel
        self.pulled_bytes = 0

    async def ask(self, step: int, first: int = 0) -> HoldersReply:
        while self.control.recv_nowait() is not None:  # a reply to an earlier request that timed out
            pass
        query = HoldersQuery(job=self.job, step=step, first=first, count=MAX_PLAN_RANKS)
        try:
            async with asyncio.timeout(self.timeout):
                await self.control.send(encode(query))
                reply = decode(await self.control.recv(copy=True))
        except TimeoutError:
            why = f" ({self.control.failure})" if self.control.failure else ""
            raise ExportError(
                f"no answer from the coordinator at {self.coordinator} within {self.timeout:g} s{why}"
            ) from None
        if isinstance(reply, Error):
            raise ExportError(
                reply.message
                if reply.code == ErrorCode.NOT_FOUND
                else f"the coordinator refused: {reply.code}: {reply.message}"
            )
        if not isinstance(reply, HoldersReply):
            raise ExportError(
                f"the coordinator answered {reply.TYPE!r} to a holders query (an older coordinator?)"
            )
        return reply

    async def holders(self, step: int) -> tuple[int, int, list[tuple[str, ...]]]:
        """The step to export (``step``; for -1, D, or G while there is none), the world size and each rank's
        holders.

        Raises:
            ExportError: the job is unknown, has no complete step, or some rank's step is held by no live node.
        """
        reply = await self.ask(step)
        if reply.step < 0 or reply.world_size == 0:
            raise ExportError(f"job {self.job!r} has no complete step yet: no step is held for every rank")
        sources = list(reply.sources)
        while len(sources) < reply.world_size:
            more = await self.ask(reply.step, first=len(sources))
            if not more.sources or more.step != reply.step:
                raise ExportError(f"job {self.job!r} changed while its holders were listed; try again")
            sources += more.sources
        missing = [r for r, s in enumerate(sources) if not s]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            )
            raise ExportError(
                f"step {reply.step} of job {self.job!r} is not held for rank(s) {shown} (newest "
                f"durable step: {_step(reply.durable)}, recoverable: {_step(reply.recoverable)})"
            )
        return reply.step, reply.world_size, sources

    async def pull(self, rank: int, step: int, sources: tuple[str, ...]) -> Snapshot:
        """Rank ``rank``'s snapshot of ``step`` from its holders, every chunk checked against their seal.

        Raises:
            PullFailed: no holder could deliver it (CorruptEverywhere: some chunk was bad from every holder).
        """
        buf: list[torch.Tensor] = []

        def allocate(manifest: StreamBegin) -> Lander:
            data = torch.empty(manifest.data_bytes, dtype=torch.uint8)
            buf.append(data)
            return arena_sink(memoryview(data.numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer

        links = [self.links.get(addr) for addr in sources]
        manifest, _, _ = await pull_snapshot(links, job=self.job, rank=rank, step=step, allocate=allocate)
        try:
            entries = decode_table(manifest.table, manifest.data_bytes)
        except ValueError as exc:
            raise ExportError(
                f"job {self.job!r} step {step}: the tensor table of rank {rank} is bad: {exc}"
            ) from exc
        self.pulled_bytes += manifest.data_bytes
        return Snapshot(rank, entries, bytes(manifest.meta), buf[0])

    async def collect(
        self, step: int, world_size: int, sources: list[tuple[str, ...]]
    ) -> tuple[dict[str, Any], list[int]]:
        """The checkpoint's state dict for ``step`` and the ranks pulled for it."""
        assembly = Assembly(self.job, step)
        first = await self.pull(0, step, sources[0])
        await asyncio.to_thread(assembly.first, first)
        del first
        pulled = [0]
        if assembly.pending:
            keepers = [r for r in assembly.keepers() if 0 < r < world_size]
            others = [r for r in range(1, world_size) if r not in keepers]
            todo = collections.deque(keepers + others)
            gate = asyncio.Semaphore(self.parallel)

            async def one(rank: int) -> None:
                async with gate:
                    if not assembly.pending:
                        return
                    snap = await self.pull(rank, step, sources[rank])
                    pulled.append(rank)
                    await asyncio.to_thread(assembly.add, snap)

            try:
                async with asyncio.TaskGroup() as tg:
                    while todo:
                        tg.create_task(one(todo.popleft()))
            except BaseExceptionGroup as eg:
                raise _first(eg) from None
        assembly.check_complete()
        return assembly.state, pulled


async def gather(
    coordinator: str, job: str, step: int | None, secret: str | None, timeout: float, parallel: int
) -> tuple[dict[str, Any], Exported]:
    """The checkpoint's state dict of ``step`` of ``job`` (None: D, and the newer D when that one is collected
    meanwhile) and what was gathered (its ``out`` left empty), over connections opened and closed here."""
    network = open_network(coordinator, Security(secret))
    tasks = TaskTree(Counters())
    links = PeerLinks(network, timeout=timeout, source=None, tasks=tasks)
    exporter: Exporter | None = None
    try:
        async with asyncio.TaskGroup() as group:  # the peer links' readers run in it
            tasks.attach(group)
            try:
                exporter = Exporter(network, links, coordinator, job, timeout, parallel)
                return await attempts(exporter, step)
            finally:
                tasks.cancel_all()
    except BaseExceptionGroup as eg:
        raise _first(eg) from None
    finally:
        links.close()
        if exporter is not None:
            exporter.control.close()
        network.close()


async def attempts(exporter: Exporter, step: int | None) -> tuple[dict[str, Any], Exported]:
    """Export ``step``, or D and the newer D when the one being exported is collected meanwhile."""
    for attempt in range(ATTEMPTS):
        exporter.pulled_bytes = 0  # of this attempt's step only
        at, world_size, sources = await exporter.holders(-1 if step is None else step)
        try:
            state, pulled = await exporter.collect(at, world_size, sources)
        except PullFailed as failure:
            if step is None and attempt + 1 < ATTEMPTS:
                newer = (await exporter.ask(-1)).step
                if newer > at:
                    log.info(
                        "step %d of job %s was collected while exporting it (%s); exporting step %d",
                        at,
                        exporter.job,
                        failure,
                        newer,
                    )
                    continue
            raise ExportError(f"job {exporter.job!r} step {at}: {failure}") from None
        return state, Exported(exporter.job, at, world_size, sorted(pulled), exporter.pulled_bytes, "")
    raise AssertionError("unreachable")


def _first(eg: BaseExceptionGroup) -> BaseException:
    """The exception of a task group's failure to raise: an ExportError, else a failed pull, else the first."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(eg)
    return next((e for kind in (ExportError, PullFailed) for e in leaves if isinstance(e, kind)), leaves[0])


def _step(step: int) -> str:
    return "none" if step < 0 else str(step)
