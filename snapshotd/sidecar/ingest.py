"""The ipc endpoint's side of the sidecar: requests from the node's training ranks.

A rank registers (the sidecar creates its shared-memory arena), announces each staged slot (the slot becomes a
valid copy and starts streaming to the rank's buddies), asks to restore, and unregisters when it closes. A rank whose job lets snapshotd place its ranks asks which
seat its node has first (:class:`~snapshotd.proto.SeatRequest`, passed on to the coordinator); in live mode a
rank that lost a peer says so (:class:`~snapshotd.proto.PeerLostReport`, passed on too, unanswered). The
sidecar answers each request and, whenever the slots a rank may write into change, tells it with a
:class:`~snapshotd.proto.SlotUpdate` (:class:`RankNotices`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

from snapshotd.logs import fields
from snapshotd.proto import (
    Announce,
    Error,
    ErrorCode,
    HeldSeat,
    Message,
    PeerLostReport,
    ProtocolError,
    RankRegistered,
    RegisterRank,
    RestoreFetched,
    RestoreRequest,
    SeatReply,
    SeatRequest,
    SlotUpdate,
    UnregisterRank,
)
from snapshotd.shm import SHM_DIR, create_arena

from .control import CoordinatorClient, CoordinatorUnavailable
from .integrity import Seal
from .local import LocalRank, SlotState
from .node import NodeState
from .outbox import Outbox
from .pacer import Pacer
from .restore import RestoreService
from .stream import StreamService
from .tasks import TaskTree

__all__ = ["MAX_LOCAL_RANKS", "ArenaRefused", "IngestService", "RankNotices"]

log = logging.getLogger(__name__)

PEER_LOST_TIMEOUT = 5.0
"""Seconds the coordinator has to acknowledge a :class:`~snapshotd.proto.PeerLostReport` passed on to it."""

MAX_LOCAL_RANKS = 4096
"""Ranks one sidecar holds arenas for (a node runs a few; a peer registering without end is refused)."""


class ArenaRefused(ProtocolError):
    """A registration whose arena the node has no room for (answered ``memory_limit``)."""


class RankNotices:
    """What the sidecar sends its local ranks, over the ipc endpoint's outbox."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def reply(self, ident: bytes, msg: Message) -> None:
        self.outbox.reply(ident, msg)

    def slots(self, lr: LocalRank, note: str = "", failed_step: int = -1) -> None:
        """Hand ``lr``'s free slots back to its process (they stop being copies from now on), with what became of
        the snapshot that freed them: ``failed_step`` and ``note`` when it did not reach every buddy."""
        free = lr.release_free()
        self.outbox.reply(
            lr.identity,
            SlotUpdate(
                job=lr.job,
                rank=lr.rank,
                free_slots=tuple(free),
                seen_step=lr.seen_step,
                durable_step=lr.durable_step,
                failed_step=failed_step,
                note=note,
            ),
        )


def _unfilled(path: str) -> int:
    """Bytes of the sparse file at ``path`` that no page backs yet (0 when it is gone)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    return max(0, st.st_size - st.st_blocks * 512)


def _filled(path: str) -> int:
    """Bytes of the file at ``path`` that pages back (0 when it is gone)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


class IngestService:
    """Handles the requests of local ranks (see the module docstring).

    Args:
        state: the node's state.
        notices: replies and slot updates to the ranks.
        streams: starts the stream of an announced slot.
        restores: runs a restore request.
        tasks: the sidecar's task tree (a restore runs as its own task).
        pacer: the node's pacer, told each announced step, its duration and its bytes.
        block_bytes: the block size of the seals of announced slots (the node's chunk size).
        control: the coordinator client (seat requests).
    """

    def __init__(
        self,
        state: NodeState,
        notices: RankNotices,
        streams: StreamService,
        restores: RestoreService,
        tasks: TaskTree,
        pacer: Pacer,
        block_bytes: int,
        control: CoordinatorClient,
    ) -> None:
        self.block_bytes = block_bytes
        self.control = control
        self.state = state
        self.notices = notices
        self.streams = streams
        self.restores = restores
        self.tasks = tasks
        self.pacer = pacer
        self._reporting: set[str] = set()  # jobs whose lost peer report is with the coordinator now

    def handle(self, ident: bytes, msg: Message) -> None:
        """Act on one request from the rank at ``ident``.

        Raises:
            ProtocolError: a request that is not an ipc request, or one this rank may not make now.
        """
        if isinstance(msg, RegisterRank):
            self._register(ident, msg)
        elif isinstance(msg, Announce):
            self._announce(ident, msg)
        elif isinstance(msg, RestoreRequest):
            task = self.tasks.spawn(
                self.restores.restore(ident, msg), f"restore of {msg.job} rank {msg.rank}"
            )
            self.restores.track(msg.job, msg.rank, task)
        elif isinstance(msg, RestoreFetched):
            self.restores.fetched(msg)
        elif isinstance(msg, UnregisterRank):
            self._unregister(msg.job, msg.rank)
        elif isinstance(msg, SeatRequest):
            self.tasks.spawn(self._seat(ident, msg), f"seat request of {msg.job}")
        elif isinstance(msg, PeerLostReport):
            if msg.job not in self._reporting:  # the node's other ranks that lost the peer too add nothing
                self._reporting.add(msg.job)
                try:
                    self.tasks.spawn(self._peer_lost(msg), f"lost peer report of {msg.job} rank {msg.rank}")
                except BaseException:
                    self._reporting.discard(msg.job)
                    raise
        else:
            raise ProtocolError(f"{msg.TYPE} is not an ipc request")

    async def _seat(self, ident: bytes, msg: SeatRequest) -> None:
        """Ask the coordinator for this node's seat in ``msg.job`` until it is given or ``msg.timeout_s`` passes;
        answer the rank with the coordinator's last reply, or an error: ``bad_message`` (the coordinator refused the
        request: it says why), ``plan_timeout`` (no answer), ``internal``."""
        held = self.state.seats.get(msg.job)
        req = dataclasses.replace(
            msg,
            node=self.state.node,
            held=-1 if held is None else held.first,
            held_granted=0 if held is None else held.granted,
        )
        try:
            reply: Message = await self.control.seat(req, time.monotonic() + msg.timeout_s)
            if isinstance(reply, SeatReply) and reply.status == "given":
                self.state.seats[msg.job] = HeldSeat(
                    msg.job, reply.first, msg.per_node, msg.world_size, reply.granted
                )
        except CoordinatorUnavailable as exc:
            reply = Error(job=msg.job, code=ErrorCode.PLAN_TIMEOUT, message=str(exc))
        except ProtocolError as exc:
            reply = Error(job=msg.job, code=ErrorCode.BAD_MESSAGE, message=str(exc))
        except Exception as exc:
            log.exception("seat request of %s failed", msg.job)
            reply = Error(job=msg.job, code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        self.notices.reply(ident, dataclasses.replace(reply, request_id=msg.request_id))  # type: ignore[call-arg]

    async def _peer_lost(self, msg: PeerLostReport) -> None:
        """Tell the coordinator that a rank here lost a peer (it probes the job's other nodes); the rank expects no
        answer, so a failure is only logged. One report per job is in flight at a time: the reports of the
        node's other ranks meanwhile are dropped."""
        try:
            reply = await self.control.peer_lost(
                dataclasses.replace(msg, node=self.state.node), PEER_LOST_TIMEOUT
            )
        except (CoordinatorUnavailable, ProtocolError) as exc:
            log.warning(
                "rank %d of job %s lost a peer; telling the coordinator failed: %s", msg.rank, msg.job, exc
            )
            return
        finally:
            self._reporting.discard(msg.job)
        log.info(
            "rank %d of job %s lost a peer: the coordinator probes %d node(s)",
            msg.rank,
            msg.job,
            reply.probed,
            extra=fields(msg.job, msg.rank, event="peer_lost"),
        )

    def _register(self, ident: bytes, msg: RegisterRank) -> None:
        if msg.rank >= msg.world_size:
            raise ProtocolError(
                f"rank {msg.rank} of job {msg.job!r} is outside its world size {msg.world_size}"
            )
        lr = self.state.rank(msg.job, msg.rank)
        need = max(4096, -(-msg.data_bytes // 4096) * 4096)
        if lr is not None and lr.arena.slot_bytes >= msg.data_bytes and lr.arena.slots == msg.slots:
            self.restores.abandon(msg.job, msg.rank)
            lr.revive(msg.pid, ident, msg.world_size)
        else:
            self._check_room(msg, need * msg.slots, replacing=lr)
            if lr is not None:
                self.restores.abandon(msg.job, msg.rank)
                self.state.drop_rank(lr)
            arena = create_arena(msg.job, msg.rank, need, msg.slots, node=self.state.node)
            lr = LocalRank(
                msg.job,
                msg.rank,
                msg.world_size,
                msg.pid,
                ident,
                arena,
                [SlotState() for _ in range(msg.slots)],
            )
            self.state.add_rank(lr)
            log.info(
                "rank %d of job %s (pid %d) registered: arena %s, %d x %d B",
                msg.rank,
                msg.job,
                msg.pid,
                arena.path,
                msg.slots,
                need,
                extra=fields(msg.job, msg.rank, event="rank_registered"),
            )
        lr.table_id = -1  # a new process numbers its tables afresh
        self.notices.reply(
            ident,
            RankRegistered(
                job=msg.job,
                rank=msg.rank,
                arena=lr.arena.path,
                slot_bytes=lr.arena.slot_bytes,
                slots=lr.arena.slots,
                pid=os.getpid(),
                request_id=msg.request_id,
            ),
        )
        self.notices.slots(lr)

    def _check_room(self, msg: RegisterRank, arena_bytes: int, replacing: LocalRank | None) -> None:
        """Refuse an arena that would not fit: the node's arenas together may not pass the size of the shared
        memory file system, nor, with the pages they have yet to fill, what it has free (its files are sparse, so
        creating one never fails; a process writing into a full one is killed by SIGBUS); nor may the node hold
        more than :data:`MAX_LOCAL_RANKS` ranks.

        Raises:
            ArenaRefused: naming the sizes, or the count.
        """
        others = [lr for lr in self.state.ranks.values() if lr is not replacing]
        if len(others) >= MAX_LOCAL_RANKS:
            raise ArenaRefused(f"this sidecar already holds {len(others)} ranks, its most (MAX_LOCAL_RANKS)")
        held = sum(lr.arena.slot_bytes * lr.arena.slots for lr in others)
        usage = shutil.disk_usage(SHM_DIR)
        what = f"rank {msg.rank} of job {msg.job!r} needs an arena of {arena_bytes} B ({msg.slots} slots)"
        if held + arena_bytes > usage.total:
            raise ArenaRefused(
                f"{what}, and the node's arenas already take {held} B of the {usage.total} B of "
                f"{SHM_DIR}: enlarge {SHM_DIR} or snapshot less"
            )
        unfilled = sum(_unfilled(lr.arena.path) for lr in others)
        # that one goes first
        free = usage.free + (_filled(replacing.arena.path) if replacing is not None else 0)
        if unfilled + arena_bytes > free:
            raise ArenaRefused(
                f"{what}, and {SHM_DIR} has {free} B free ({unfilled} B of it promised to the "
                f"node's other arenas): free {SHM_DIR} or snapshot less"
            )

    def _unregister(self, job: str, rank: int) -> None:
        lr = self.state.rank(job, rank)
        if lr is not None:
            log.info(
                "rank %d of job %s closed its snapshotter",
                rank,
                job,
                extra=fields(job, rank, event="rank_closed"),
            )
            self.state.drop_rank(lr)
            self.pacer.forget((job, rank))

    def _announce(self, ident: bytes, msg: Announce) -> None:
        lr = self.state.rank(msg.job, msg.rank)
        if lr is None:
            raise ProtocolError(f"rank {msg.rank} of job {msg.job!r} announced before registering")
        if msg.table.nbytes:
            lr.set_table(msg.table_id, msg.table)
        elif msg.table_id != lr.table_id:
            raise ProtocolError(f"unknown tensor table {msg.table_id}; send the table again")
        if not 0 <= msg.slot < lr.arena.slots:
            raise ProtocolError(f"slot {msg.slot} is outside the arena's {lr.arena.slots} slots")
        slot = lr.slots[msg.slot]
        if slot.valid or slot.streaming or slot.pins:
            raise ProtocolError(f"slot {msg.slot} was not free (it holds step {slot.step})")
        for i, other in enumerate(lr.slots):
            # a copy past the step seen is the failed run's, kept past a restore because it was streaming then
            if other.valid and other.step > lr.seen_step and not other.streaming and not other.pins:
                lr.set_slot(i, SlotState())
        newest = max(lr.valid_steps(), default=-1)
        if msg.step <= newest:
            raise ProtocolError(
                f"step {msg.step} is not newer than the newest snapshot {newest}; steps only grow"
            )
        lr.identity = ident
        lr.seen_step = msg.step
        lr.announced += 1
        lr.skipped = msg.skipped
        if msg.step_seconds > 0:
            lr.step_seconds = msg.step_seconds
        buddies = [a for a in self.state.assignments.get((lr.job, lr.rank), ()) if a != self.state.data_addr]
        steps = msg.steps or (msg.step_seconds,)  # an older client sends its last step only
        self.pacer.report_step(
            (lr.job, lr.rank), msg.step, steps, msg.steps_end, lr.data_bytes * max(1, len(buddies))
        )
        meta = bytes(msg.meta)
        lr.set_slot(
            msg.slot,
            SlotState(
                step=msg.step,
                valid=True,
                table=lr.table,
                meta=meta,
                data_bytes=lr.data_bytes,
                elem=lr.elem,
                seal=Seal.announced(self.block_bytes, lr.table, meta),
                taken_at=time.monotonic(),
            ),
        )
        self.streams.start(lr, msg.slot)
