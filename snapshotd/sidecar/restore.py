"""Restores: bringing a local rank's recoverable step back to its (restarted) process.

The rank asks; this sidecar asks the coordinator for the plan (every rank of the job gets the same step G), then
finds ``(job, rank, G)``, in this order: a valid slot of the rank's own arena (the process crashed, the node
lived: nothing moves), a copy this node holds for the rank as a buddy (a replica: copied into the arena), or the
live holders the plan names (a pull striped across all of them). Every byte and both blobs are checked against
the copy's seal (:mod:`.integrity`) before the reply lets the rank load them; a local copy that fails is dropped
and the next source is tried. Where the restoring process named its live tensors, pulled or replica bytes go
straight into them (:mod:`.placement`); the rest goes through the arena. The reply says which and where.

A pull is fetched by the rank itself where it can (it asked with ``fetch``, this sidecar serves a bulk port, and
a holder gives a ticket): the holders' bulk ports (:mod:`.bulk`) send the chunks straight into the rank's tensors
and slot, each checked by the rank against its carried checksum (:class:`~snapshotd.proto.RestoreFetch`), which
saves this sidecar's copy of every byte. A fetch that fails is followed by a pull through the sidecars; one
not answered by the restore's deadline fails the restore.

A rank that asks with ``progress`` is told how it goes (:class:`~snapshotd.proto.RestoreProgress`): once the
source is known, then at most every :data:`PROGRESS_INTERVAL` seconds while a pull brings bytes. The sidecar
itself logs one line per restore.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import NamedTuple
from urllib.parse import urlsplit

import numpy as np

from snapshotd import proto
from snapshotd.logs import fields
from snapshotd.proto import (
    Error,
    ErrorCode,
    PlanRequest,
    ProtocolError,
    RestoreFetch,
    RestoreFetched,
    RestoreProgress,
    RestoreReply,
    RestoreRequest,
    StreamBegin,
    Ticket,
    TicketRequest,
)
from snapshotd.proto.bulk import TOKEN_BYTES
from snapshotd.shm import create_arena
from snapshotd.units import format_bytes, format_rate

from .config import SidecarConfig
from .control import CoordinatorClient, CoordinatorUnavailable
from .integrity import CorruptCopy, Seal
from .local import LocalRank, SlotState
from .node import NodeState
from .outbox import Outbox
from .peers import PeerError, PeerLink, PeerLinks
from .placement import DirectSink, Lander, PlacementError, arena_sink
from .pull import CorruptEverywhere, PullFailed, describe_snapshot, pull_snapshot
from .store import UnknownSnapshot
from .stream import RankNotify

__all__ = ["PROGRESS_INTERVAL", "RestoreService"]

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.2
"""Least seconds between two RestoreProgress messages of one pull."""

FETCH_CHECK_INTERVAL = 1.0
"""Seconds between two looks at whether a rank fetching its pull is still alive."""


class _Brought(NamedTuple):
    """Where a restore brought the step: ``slot``; ``pulled`` bytes over the network; ``direct``: some went
    straight into the rank's tensors (the slot then lacks them); ``by_rank``: the rank fetched them itself."""

    slot: int
    pulled: int
    direct: bool
    by_rank: bool = False


class _RankGone(Exception):
    """The restoring rank unregistered (or another registration replaced it) while its restore was pending."""


class RestoreService:
    """Runs the restore requests of local ranks (see the module docstring).

    Args:
        state, cfg: the node's state and configuration.
        control: the coordinator client (plans).
        links: connections to the other sidecars (pulls).
        outbox: the ipc endpoint's replies.
        notify: hands a rank its slots once its restore is decided.
    """

    def __init__(
        self,
        state: NodeState,
        cfg: SidecarConfig,
        control: CoordinatorClient,
        links: PeerLinks,
        outbox: Outbox,
        notify: RankNotify,
    ) -> None:
        self.state = state
        self.cfg = cfg
        self.control = control
        self.links = links
        self.outbox = outbox
        self.notify = notify
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}
        """The restore running for each rank (job, rank): the task of :meth:`restore`."""
        self._fetching: dict[tuple[str, int], tuple[int, asyncio.Future[RestoreFetched]]] = {}
        """The ranks fetching their pulls (job, rank): the number of the fetch asked, and its answer to come."""

    def fetched(self, msg: RestoreFetched) -> None:
        """A rank answered the :class:`RestoreFetch` of its restore. An answer no restore waits for (the restore
        was abandoned, or timed out, while the rank fetched) is logged and dropped: it is not an error the rank
        could act on, and an Error reply would reach whatever request the rank waits on now."""
        fetch, fut = self._fetching.get((msg.job, msg.rank), (-1, None))
        if fut is None or fut.done() or fetch != msg.fetch:
            log.info(
                "rank %d of job %s answered a fetch of step %d that no restore waits for",
                msg.rank,
                msg.job,
                msg.step,
                extra=fields(msg.job, msg.rank, msg.step, "fetch_unexpected"),
            )
            return
        fut.set_result(msg)

    async def restore(self, ident: bytes, req: RestoreRequest) -> None:
        """Answer ``req`` with a RestoreReply or an Error, whatever happens (an unexpected failure is answered
        ``internal``), unless :meth:`abandon` cancels it; the rank's slots are handed back either way (once
        abandoned, by the restore that follows). A rank that
        unregisters while its restore is pending is answered ``not_registered``, and nothing made for it is left
        behind. Run as a task of its own, given to :meth:`track` as it is made."""
        key, task = (req.job, req.rank), asyncio.current_task()
        lr = self.state.rank(req.job, req.rank)
        if lr is None:
            if self._pending.get(key) is task:
                del self._pending[key]
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    request_id=req.request_id,
                    code=ErrorCode.NOT_REGISTERED,
                    rank=req.rank,
                    message="register the rank before restoring",
                ),
            )
            return
        lr.awaiting_restore = True
        try:
            await self._restore(ident, req, lr)
        except _RankGone:
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    request_id=req.request_id,
                    code=ErrorCode.NOT_REGISTERED,
                    rank=req.rank,
                    message="the rank unregistered while its restore was pending",
                ),
            )
        except Exception as exc:
            self.state.counters.errors += 1
            log.exception(
                "restore of %s rank %d failed",
                req.job,
                req.rank,
                extra=fields(req.job, req.rank, event="restore_failed"),
            )
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    request_id=req.request_id,
                    code=ErrorCode.INTERNAL,
                    rank=req.rank,
                    message=f"{type(exc).__name__}: {exc}",
                ),
            )
        finally:
            if self.state.rank(lr.job, lr.rank) is not lr:  # dropped meanwhile: its arena belongs to nobody
                lr.arena.close(unlink=True)
            elif self._pending.get(key) is task:  # else abandoned: the new registration's restore decides
                lr.awaiting_restore = False
                self.notify(lr, "", -1)
            if self._pending.get(key) is task:
                del self._pending[key]

    def track(self, job: str, rank: int, task: asyncio.Task[None]) -> None:
        """``task`` runs :meth:`restore` for ``rank`` of ``job`` (recorded as the task is made, before it runs, so
        that a registration handled next abandons it); a restore of the rank still pending is abandoned."""
        self.abandon(job, rank)
        self._pending[(job, rank)] = task

    def abandon(self, job: str, rank: int) -> None:
        """The rank registered again (its restarted process, or the same one about to ask anew): cancel the restore
        its previous registration asked for, unanswered (its asker no longer waits; an answer could reach the
        process's next request), so that nothing of it writes into the rank's slots or into a process that did
        not ask. Its plan request, if out, is given up (:class:`~.control.CoordinatorClient`); the rank's next
        restore asks again (the coordinator's round still counts the rank's ask, unanswered, while it waits)."""
        task = self._pending.pop((job, rank), None)
        if task is not None:
            log.info(
                "rank %d of job %s registered again: its pending restore is abandoned",
                rank,
                job,
                extra=fields(job, rank, event="restore_abandoned"),
            )
            task.cancel()

    def _check_registered(self, lr: LocalRank) -> None:
        """Raises _RankGone: ``lr`` unregistered (or was replaced) since its restore began."""
        if self.state.rank(lr.job, lr.rank) is not lr:
            raise _RankGone

    async def _restore(self, ident: bytes, req: RestoreRequest, lr: LocalRank) -> None:
        t0 = time.monotonic()
        try:
            plan = await self.control.plan(
                PlanRequest(job=req.job, rank=req.rank, world_size=req.world_size, node=self.state.node),
                t0 + req.timeout_s,
            )
        except (CoordinatorUnavailable, ProtocolError) as exc:
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    request_id=req.request_id,
                    code=ErrorCode.PLAN_TIMEOUT,
                    rank=req.rank,
                    message=str(exc),
                ),
            )
            return
        self._check_registered(lr)
        if plan.status == "fresh":
            self.state.counters.restored("fresh", time.monotonic() - t0, 0)
            self.outbox.reply(
                ident,
                RestoreReply(
                    job=req.job,
                    request_id=req.request_id,
                    rank=req.rank,
                    step=0,
                    source="fresh",
                    arena=lr.arena.path,
                    slot_bytes=lr.arena.slot_bytes,
                ),
            )
            return
        if plan.status != "ready":
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    request_id=req.request_id,
                    code=ErrorCode.NOT_RECOVERABLE,
                    rank=req.rank,
                    message=plan.reason,
                ),
            )
            return
        step = plan.step
        t_data = time.monotonic()
        index = lr.find(step)
        source, pulled, direct, by_rank = "local", 0, False, False
        if index is not None:
            self._progress(ident, req, step, "local", 0, lr.slots[index].data_bytes)
        local_corrupt = index is not None and not await self._intact(lr, index)
        if local_corrupt:
            index = None
        if index is None:
            try:
                index, pulled, direct, by_rank = await self._fetch(
                    lr, step, plan.sources, req, ident, t0 + req.timeout_s
                )
            except (PullFailed, PeerError, ProtocolError, PlacementError) as exc:
                corrupt = isinstance(exc, CorruptEverywhere) or (
                    local_corrupt and isinstance(exc, PullFailed)
                )
                why = (
                    f"the rank's own copy failed its end-to-end checksum, and {exc}"
                    if local_corrupt
                    else str(exc)
                )
                self.outbox.reply(
                    ident,
                    Error(
                        job=req.job,
                        request_id=req.request_id,
                        code=ErrorCode.CORRUPT if corrupt else ErrorCode.PULL_FAILED,
                        rank=req.rank,
                        step=step,
                        message=why,
                    ),
                )
                return
            source = "pull" if pulled else "replica"
        self._check_registered(lr)
        for i, other in enumerate(lr.slots):  # steps past the restored one never happened for the new process
            if i != index and other.step > step and not other.streaming:
                lr.set_slot(i, SlotState())
        lr.seen_step = step
        lr.durable_step = min(lr.durable_step, step)  # the steps past it never happened for the new process
        s = lr.slots[index]
        seconds = time.monotonic() - t0
        self.state.counters.restored(source, seconds, pulled)
        moving = time.monotonic() - t_data
        holders = [a for a in plan.sources if a != self.state.data_addr] if source == "pull" else []
        log.info(
            "rank %d of job %s restores step %d: %s%s%s, %s in %.2f s (%s; %.2f s since it asked)%s%s%s",
            req.rank,
            req.job,
            step,
            source,
            " from " if holders else "",
            ", ".join(holders),
            format_bytes(s.data_bytes),
            moving,
            format_rate(s.data_bytes / moving if moving > 0 else 0.0),
            seconds,
            f", {format_bytes(pulled)} on the wire" if pulled else "",
            ", fetched by the rank" if by_rank else "",
            ", into its tensors" if direct else "",
            extra=fields(req.job, req.rank, step, "restore"),
        )
        self.outbox.reply(
            ident,
            RestoreReply(
                job=req.job,
                rank=req.rank,
                step=step,
                source=source,
                arena=lr.arena.path,
                slot_bytes=lr.arena.slot_bytes,
                slot=index,
                bytes_pulled=pulled,
                seconds=seconds,
                direct=direct,
                fetched=by_rank,
                table=s.table,
                meta=s.meta,
                request_id=req.request_id,
            ),
        )

    def _progress(
        self,
        ident: bytes,
        req: RestoreRequest,
        step: int,
        source: str,
        done: int,
        total: int,
        sources: tuple[str, ...] = (),
    ) -> None:
        """Tell the restoring rank how its restore goes, if it asked to be told."""
        if req.progress:
            self.outbox.reply(
                ident,
                RestoreProgress(
                    job=req.job,
                    rank=req.rank,
                    step=step,
                    done_bytes=min(done, total),
                    total_bytes=total,
                    source=source,
                    sources=sources,
                ),
            )

    def _dropped(self, exc: CorruptCopy, job: str, rank: int, step: int) -> None:
        self.state.counters.corrupt += 1
        log.error(
            "%s; the copy is dropped and the step is taken from another holder",
            exc,
            extra=fields(job, rank, step, "copy_corrupt"),
        )

    async def _intact(self, lr: LocalRank, index: int) -> bool:
        """Check the rank's own slot ``index`` against its seal (off the event loop); a slot that fails is
        dropped (False)."""
        s = lr.slots[index]
        assert s.seal is not None  # every valid slot has one
        what = f"the copy of job {lr.job!r} rank {lr.rank} step {s.step} in the rank's own shared memory"
        s.pins += 1
        try:
            await asyncio.to_thread(s.seal.check, lr.arena.slot(index)[: s.data_bytes], s.table, s.meta, what)
        except CorruptCopy as exc:
            self._dropped(exc, lr.job, lr.rank, s.step)
            if lr.slots[index] is s:
                lr.invalidate(index)
            return False
        finally:
            s.pins -= 1
        return True

    def _empty_slot(self, lr: LocalRank, data_bytes: int) -> int:
        """Make slot 0 of ``lr`` ready to receive ``data_bytes`` (growing the arena if needed).

        Raises:
            _RankGone: ``lr`` unregistered meanwhile.
        """
        self._check_registered(lr)
        if data_bytes > lr.arena.slot_bytes:
            old = lr.arena
            lr.arena = create_arena(
                lr.job, lr.rank, -(-data_bytes // 4096) * 4096, old.slots, node=self.state.node
            )
            old.close(unlink=True)
        lr.clear_slots()
        return 0

    async def _fetch(
        self,
        lr: LocalRank,
        step: int,
        sources: tuple[str, ...],
        req: RestoreRequest,
        ident: bytes,
        deadline: float,
    ) -> _Brought:
        """Bring ``(job, rank, step)`` to the restoring process: from this node's buddy store if held, else pulled
        (fetched by the rank where it can, see the module docstring); into a slot, or, where ``req`` names live
        tensors, straight into them (:mod:`.placement`). A slot that lacks the bytes written directly is not a valid
        copy of the step: it is never served or kept as the local fast path.

        Raises:
            PullFailed, PeerError, ProtocolError, PlacementError: the state could not be brought here.
        """
        store = self.state.store
        try:
            snap = store.get(lr.job, lr.rank, step)
        except UnknownSnapshot:
            snap = None
        if snap is not None:
            self._progress(ident, req, step, "replica", 0, snap.data_bytes)
            index = self._empty_slot(lr, snap.data_bytes)
            slot = lr.arena.slot(index)[: snap.data_bytes]
            sink = self._direct_sink(lr, req, snap.table, slot)
            land = sink.land if sink is not None else arena_sink(slot)
            what = f"the replica of job {lr.job!r} rank {lr.rank} step {step} held on this node"
            try:
                snap.seal.check_blobs(snap.table, snap.meta, what)
                for block, (start, part) in enumerate(snap.data.parts()):
                    snap.seal.check_block(block, part, what)
                    land(start, part)
            except CorruptCopy as exc:  # what landed is overwritten by the pull below
                self._dropped(exc, lr.job, lr.rank, step)
                store.discard(snap)
            else:
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
                return _Brought(index, 0, sink is not None)
        holders = tuple(a for a in sources if a != self.state.data_addr)
        links = [self.links.get(a) for a in holders]
        manifest = await describe_snapshot(links, job=lr.job, rank=lr.rank, step=step)
        proto.decode_table(manifest.table, manifest.data_bytes)
        if req.fetch and self.cfg.serves_bulk:
            fetched = await self._rank_fetch(lr, manifest, links, req, ident, deadline)
            if fetched is not None:
                return fetched
        index = 0
        direct = False
        done, total, told = 0, 0, 0.0

        def allocate(m: StreamBegin) -> Lander:
            nonlocal direct, total, told
            total, told = m.data_bytes, time.monotonic()
            self._progress(ident, req, step, "pull", 0, total, holders)
            self._empty_slot(lr, m.data_bytes)
            lr.slots[index].pins += 1
            slot = lr.arena.slot(index)[: m.data_bytes]
            sink = self._direct_sink(lr, req, m.table, slot)
            direct = sink is not None
            return sink.land if sink is not None else arena_sink(slot)

        def landed(n: int) -> None:
            nonlocal done, told
            done += n
            now = time.monotonic()
            if now - told >= PROGRESS_INTERVAL:
                told = now
                self._progress(ident, req, step, "pull", done, total, holders)

        try:
            manifest, seal, pulled = await pull_snapshot(
                links,
                job=lr.job,
                rank=lr.rank,
                step=step,
                allocate=allocate,
                on_progress=landed,
                manifest=manifest,
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
        self.state.counters.pulled(pulled)
        return _Brought(index, pulled, direct)

    async def _rank_fetch(
        self,
        lr: LocalRank,
        manifest: StreamBegin,
        links: list[PeerLink],
        req: RestoreRequest,
        ident: bytes,
        deadline: float,
    ) -> _Brought | None:
        """Have the restoring rank fetch ``manifest``'s snapshot from the holders' bulk ports (see the module
        docstring); None when no holder gave a ticket or the rank's fetch failed (the slot is then empty again,
        for a pull).

        Raises:
            PullFailed: the rank did not answer by ``deadline`` (``time.monotonic()``; the restore's own).
            _RankGone: the rank unregistered or died meanwhile.
        """
        job, rank, step = lr.job, lr.rank, manifest.step
        tickets = [
            t for t in await asyncio.gather(*(self._ticket(link, job, rank, step) for link in links)) if t
        ]
        if not tickets:
            return None
        if time.monotonic() >= deadline:  # the rank stops waiting about now: no fetch may start in its memory
            raise PullFailed(f"no time was left to fetch step {step} of job {job!r} rank {rank}")
        index = self._empty_slot(lr, manifest.data_bytes)
        lr.slots[index].pins += 1
        key, number = (job, rank), random.getrandbits(62) | 1
        fut: asyncio.Future[RestoreFetched] = asyncio.get_running_loop().create_future()
        self._fetching[key] = (number, fut)
        try:
            self._progress(ident, req, step, "pull", 0, manifest.data_bytes, tuple(a for a, _, _ in tickets))
            self.outbox.reply(
                ident,
                RestoreFetch(
                    job=job,
                    rank=rank,
                    step=step,
                    fetch=number,
                    data_bytes=manifest.data_bytes,
                    chunk_bytes=manifest.chunk_bytes,
                    arena=lr.arena.path,
                    slot_bytes=lr.arena.slot_bytes,
                    slots=lr.arena.slots,
                    slot=index,
                    holders=tuple(b for _, b, _ in tickets),
                    table=manifest.table,
                    tokens=b"".join(t for _, _, t in tickets),
                ),
            )
            answer = await self._await_fetch(lr, fut, deadline)
        except BaseException:
            lr.set_slot(index, SlotState())
            raise
        finally:
            if self._fetching.get(key, (-1, None))[1] is fut:
                del self._fetching[key]
        sums = memoryview(answer.sums)
        if answer.ok and sums.nbytes != 8 * manifest.nchunks:
            answer = RestoreFetched(
                job=job,
                rank=rank,
                step=step,
                fetch=number,
                ok=False,
                reason=f"{sums.nbytes} bytes of checksums for {manifest.nchunks} chunks",
            )
        if not answer.ok:
            lr.set_slot(index, SlotState())
            log.warning(
                "rank %d of job %s could not fetch step %d itself (%s): pulling it through the sidecars",
                rank,
                job,
                step,
                answer.reason,
                extra=fields(job, rank, step, "fetch_failed"),
            )
            return None
        seal = Seal(
            manifest.chunk_bytes, manifest.digest, dict(enumerate(np.frombuffer(sums, "<u8").tolist()))
        )
        lr.set_slot(
            index,
            SlotState(
                step=step,
                valid=not answer.direct,
                table=bytes(manifest.table),
                meta=bytes(manifest.meta),
                data_bytes=manifest.data_bytes,
                seal=seal,
            ),
        )
        self.state.counters.pulled(answer.fetched)
        return _Brought(index, answer.fetched, answer.direct, by_rank=True)

    async def _ticket(self, link: PeerLink, job: str, rank: int, step: int) -> tuple[str, str, bytes] | None:
        """The data address, bulk address (``host:port``) and token of ``link``'s holder for ``(job, rank, step)``;
        None if it gives none (it serves no bulk port, or failed)."""
        with link.subscribe(job, rank, step) as replies:
            try:
                await link.send(TicketRequest(job=job, rank=rank, step=step))
                reply = await link.receive(replies, Ticket)
            except PeerError as exc:
                log.info("no ticket from %s for job %s rank %d step %d: %s", link.addr, job, rank, step, exc)
                return None
        assert isinstance(reply, Ticket)
        host = urlsplit(link.addr).hostname
        if host is None or memoryview(reply.token).nbytes != TOKEN_BYTES:
            return None
        bulk = f"[{host}]:{reply.port}" if ":" in host else f"{host}:{reply.port}"
        return link.addr, bulk, bytes(reply.token)

    async def _await_fetch(
        self, lr: LocalRank, fut: asyncio.Future[RestoreFetched], deadline: float
    ) -> RestoreFetched:
        """The rank's answer to its RestoreFetch, looking every :data:`FETCH_CHECK_INTERVAL` seconds whether the
        rank is still registered and alive.

        Raises:
            _RankGone: it is not.
            PullFailed: no answer by ``deadline`` (``time.monotonic()``).
        """
        while not fut.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PullFailed(f"rank {lr.rank} of job {lr.job!r} did not finish fetching its step in time")
            await asyncio.wait({fut}, timeout=min(left, FETCH_CHECK_INTERVAL))
            self._check_registered(lr)
            if not lr.alive:
                raise _RankGone
        return fut.result()

    def _direct_sink(
        self, lr: LocalRank, req: RestoreRequest, table: bytes | memoryview, slot: memoryview
    ) -> DirectSink | None:
        """A sink into the restoring process's tensors, if it named any that match and the kernel lets us."""
        if not memoryview(req.targets).nbytes:
            return None
        live = proto.decode_table(req.table)
        sink = DirectSink(lr.pid, proto.decode_table(table, slot.nbytes), live, req.targets, slot)
        return sink if sink.direct_bytes and sink.probe() else None
