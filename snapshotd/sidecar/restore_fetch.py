"""A pull the restoring rank fetches itself, from the holders' bulk ports.

Each holder is asked for a ticket (:class:`~snapshotd.proto.TicketRequest`): its bulk port (:mod:`.bulk`) and a
token for this one copy. The rank is sent a :class:`~snapshotd.proto.RestoreFetch` naming the holders that gave
one, its slot and the snapshot's table; it fetches the chunks straight into its tensors and slot, checks each
against its carried checksum, and answers with a :class:`~snapshotd.proto.RestoreFetched` whose checksums become
the slot's seal. This saves the sidecar's copy of every byte. A fetch no holder gave a ticket for, or one the rank
reports failed, leaves the slot empty for a pull through the sidecars; one not answered by the restore's deadline
fails the restore.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from urllib.parse import urlsplit

import numpy as np

from snapshotd.logs import fields
from snapshotd.proto import RestoreFetch, RestoreFetched, StreamBegin, Ticket, TicketRequest
from snapshotd.proto.bulk import TOKEN_BYTES

from .integrity import Seal
from .local import LocalRank, SlotState
from .node import NodeState
from .outbox import Outbox
from .peers import PeerError, PeerLink
from .pull import PullFailed
from .restore_local import Brought, RankGone, check_registered, empty_slot
from .restore_progress import ProgressReports

__all__ = ["FETCH_CHECK_INTERVAL", "RankFetches"]

log = logging.getLogger(__name__)

FETCH_CHECK_INTERVAL = 1.0
"""Seconds between two looks at whether a rank fetching its pull is still alive."""


class RankFetches:
    """The fetches this node's restoring ranks run (see the module docstring), each paired with its answer.

    Args:
        state: the node's state (the ranks, the counters).
        outbox: the ipc endpoint's replies (a rank's RestoreFetch goes through it).
    """

    def __init__(self, state: NodeState, outbox: Outbox) -> None:
        self.state = state
        self.outbox = outbox
        self._fetching: dict[tuple[str, int], tuple[int, asyncio.Future[RestoreFetched]]] = {}
        """The ranks fetching their pulls (job, rank): the number of the fetch asked, and its answer to come."""

    def answered(self, msg: RestoreFetched) -> None:
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

    async def fetch(
        self,
        lr: LocalRank,
        manifest: StreamBegin,
        links: list[PeerLink],
        ident: bytes,
        progress: ProgressReports,
        deadline: float,
    ) -> Brought | None:
        """Have the restoring rank (``ident`` on the ipc endpoint) fetch ``manifest``'s snapshot from the bulk ports
        of the holders behind ``links``; None when no holder gave a ticket or the rank's fetch failed (the slot is
        then empty again, for a pull).

        Raises:
            PullFailed: the rank did not answer by ``deadline`` (``time.monotonic()``; the restore's own).
            RankGone: the rank unregistered or died meanwhile.
        """
        job, rank, step = lr.job, lr.rank, manifest.step
        tickets = [t for t in await asyncio.gather(*(_ticket(link, job, rank, step) for link in links)) if t]
        if not tickets:
            return None
        if time.monotonic() >= deadline:  # the rank stops waiting about now: no fetch may start in its memory
            raise PullFailed(f"no time was left to fetch step {step} of job {job!r} rank {rank}")
        index = empty_slot(self.state, lr, manifest.data_bytes)
        lr.slots[index].pins += 1
        key, number = (job, rank), random.getrandbits(62) | 1
        fut: asyncio.Future[RestoreFetched] = asyncio.get_running_loop().create_future()
        self._fetching[key] = (number, fut)
        try:
            progress.tell(step, "pull", 0, manifest.data_bytes, tuple(a for a, _, _ in tickets))
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
            answer = await self._answer(lr, fut, deadline)
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
        return Brought(index, answer.fetched, answer.direct, by_rank=True)

    async def _answer(
        self, lr: LocalRank, fut: asyncio.Future[RestoreFetched], deadline: float
    ) -> RestoreFetched:
        """The rank's answer to its RestoreFetch, looking every :data:`FETCH_CHECK_INTERVAL` seconds whether the
        rank is still registered and alive.

        Raises:
            RankGone: it is not.
            PullFailed: no answer by ``deadline`` (``time.monotonic()``).
        """
        while not fut.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PullFailed(f"rank {lr.rank} of job {lr.job!r} did not finish fetching its step in time")
            await asyncio.wait({fut}, timeout=min(left, FETCH_CHECK_INTERVAL))
            check_registered(self.state, lr)
            if not lr.alive:
                raise RankGone
        return fut.result()


async def _ticket(link: PeerLink, job: str, rank: int, step: int) -> tuple[str, str, bytes] | None:
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
