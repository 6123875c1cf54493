"""Restores: bringing a local rank's recoverable step back to its (restarted) process.

The rank asks; this sidecar asks the coordinator for the plan (every rank of the job gets the same step G), then
finds ``(job, rank, G)``, in this order: a valid slot of the rank's own arena (the process crashed, the node
lived: nothing moves), a copy this node holds for the rank as a buddy (a replica: copied into the arena), or the
live holders the plan names (a pull striped across all of them). Every byte and both blobs are checked against
the copy's seal (:mod:`.integrity`) before the reply lets the rank load them; a local copy that fails is dropped
and the next source is tried (:mod:`.restore_local`). Where the restoring process named its live tensors, pulled
or replica bytes go straight into them (:mod:`.placement`); the rest goes through the arena. The reply says which
and where.

A pull is fetched by the rank itself where it can (it asked with ``fetch``, this sidecar serves a bulk port, and
a holder gives a ticket: :mod:`.restore_fetch`), which saves this sidecar's copy of every byte. A fetch that fails
is followed by a pull through the sidecars (:mod:`.restore_pull`); one not answered by the restore's deadline
fails the restore.

A rank that asks with ``progress`` is told how it goes (:mod:`.restore_progress`). The sidecar itself logs one
line per restore.
"""

from __future__ import annotations

import asyncio
import logging
import time

from snapshotd import proto
from snapshotd.logs import fields
from snapshotd.proto import (
    Error,
    ErrorCode,
    PlanRequest,
    ProtocolError,
    RestoreFetched,
    RestoreReply,
    RestoreRequest,
)
from snapshotd.units import format_bytes, format_rate

from .config import SidecarConfig
from .control import CoordinatorClient, CoordinatorUnavailable
from .local import LocalRank, SlotState
from .node import NodeState
from .outbox import Outbox
from .peers import PeerError, PeerLinks
from .placement import PlacementError
from .pull import CorruptEverywhere, PullFailed, describe_snapshot
from .restore_fetch import RankFetches
from .restore_local import Brought, RankGone, check_registered, from_replica, own_slot_intact
from .restore_progress import ProgressReports
from .restore_pull import pull_through_sidecars
from .stream import RankNotify

__all__ = ["RestoreService"]

log = logging.getLogger(__name__)


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
        self.fetches = RankFetches(state, outbox)
        """The pulls the restoring ranks fetch themselves."""

    def fetched(self, msg: RestoreFetched) -> None:
        """A rank answered the RestoreFetch of its restore (:meth:`.RankFetches.answered`)."""
        self.fetches.answered(msg)

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
            self._refuse(ident, req, ErrorCode.NOT_REGISTERED, "register the rank before restoring")
            return
        lr.awaiting_restore = True
        try:
            await self._restore(ident, req, lr)
        except RankGone:
            self._refuse(
                ident, req, ErrorCode.NOT_REGISTERED, "the rank unregistered while its restore was pending"
            )
        except Exception as exc:
            self.state.counters.errors += 1
            log.exception(
                "restore of %s rank %d failed",
                req.job,
                req.rank,
                extra=fields(req.job, req.rank, event="restore_failed"),
            )
            self._refuse(ident, req, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if self.state.rank(lr.job, lr.rank) is not lr:  # dropped meanwhile: its arena belongs to nobody
                lr.arena.close(unlink=True)
            elif self._pending.get(key) is task:  # else abandoned: the new registration's restore decides
                lr.awaiting_restore = False
                self.notify(lr, "", -1)
            if self._pending.get(key) is task:
                del self._pending[key]

    def _refuse(
        self, ident: bytes, req: RestoreRequest, code: ErrorCode, message: str, step: int = -1
    ) -> None:
        """Answer ``req`` with an Error of ``code`` (about ``step`` where one is known)."""
        self.outbox.reply(
            ident,
            Error(
                job=req.job,
                request_id=req.request_id,
                code=code,
                rank=req.rank,
                step=step,
                message=message,
            ),
        )

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

    async def _restore(self, ident: bytes, req: RestoreRequest, lr: LocalRank) -> None:
        t0 = time.monotonic()
        progress = ProgressReports(self.outbox, ident, req)
        try:
            plan = await self.control.plan(
                PlanRequest(job=req.job, rank=req.rank, world_size=req.world_size, node=self.state.node),
                t0 + req.timeout_s,
            )
        except (CoordinatorUnavailable, ProtocolError) as exc:
            self._refuse(ident, req, ErrorCode.PLAN_TIMEOUT, str(exc))
            return
        check_registered(self.state, lr)
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
            self._refuse(ident, req, ErrorCode.NOT_RECOVERABLE, plan.reason)
            return
        step = plan.step
        t_data = time.monotonic()
        index = lr.find(step)
        source, pulled, direct, by_rank = "local", 0, False, False
        if index is not None:
            progress.tell(step, "local", 0, lr.slots[index].data_bytes)
        local_corrupt = index is not None and not await own_slot_intact(self.state, lr, index)
        if local_corrupt:
            index = None
        if index is None:
            try:
                index, pulled, direct, by_rank = await self._bring(
                    lr, step, plan.sources, req, ident, progress, t0 + req.timeout_s
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
                self._refuse(
                    ident, req, ErrorCode.CORRUPT if corrupt else ErrorCode.PULL_FAILED, why, step=step
                )
                return
            source = "pull" if pulled else "replica"
        check_registered(self.state, lr)
        for i, other in enumerate(lr.slots):  # steps past the restored one never happened for the new process
            if i != index and other.step > step and not other.streaming:
                lr.set_slot(i, SlotState())
        lr.seen_step = step
        s = lr.slots[index]
        if step < lr.durable_step:  # the steps past it never happened for the new process
            lr.durable_step, lr.durable_at = step, s.taken_at
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

    async def _bring(
        self,
        lr: LocalRank,
        step: int,
        sources: tuple[str, ...],
        req: RestoreRequest,
        ident: bytes,
        progress: ProgressReports,
        deadline: float,
    ) -> Brought:
        """Bring ``step`` of ``lr`` to the restoring process (``ident``): from this node's buddy store if it holds
        a sound copy, else from the holders among ``sources``, fetched by the rank where it can, else pulled
        through the sidecars (see the module docstring).

        Raises:
            PullFailed, PeerError, ProtocolError, PlacementError: the state could not be brought here.
            RankGone: ``lr`` unregistered meanwhile.
        """
        brought = from_replica(self.state, lr, step, req, progress)
        if brought is not None:
            return brought
        holders = tuple(a for a in sources if a != self.state.data_addr)
        links = [self.links.get(a) for a in holders]
        manifest = await describe_snapshot(links, job=lr.job, rank=lr.rank, step=step, paths=self.state.paths)
        proto.decode_table(manifest.table, manifest.data_bytes)
        if req.fetch and self.cfg.serves_bulk:
            fetched = await self.fetches.fetch(lr, manifest, links, ident, progress, deadline)
            if fetched is not None:
                return fetched
        return await pull_through_sidecars(
            self.state, lr, step, manifest, links, req, progress.pull(step, holders)
        )
