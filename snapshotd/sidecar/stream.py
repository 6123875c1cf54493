"""Outgoing streams: each announced slot of a local rank goes to every buddy of the rank.

One stream per rank at a time. A newer announced step supersedes the stream in flight (which stops, its step
counted as skipped, not failed), unless that stream has sent at least half its bytes to every buddy
(:data:`FINISH_FIRST`): then the newer step waits for it to end, for at most :data:`FINISH_WAIT` of the rank's
step time, and streams at once when it does (the newest step announced meanwhile, if several were); a stream
that has not ended by then is superseded after all. Superseding a stream that is nearly done throws away a step
about to be durable (a rank's first snapshots, landing in a buddy's fresh memory, each took longer than a
step, so that none became durable); the bound keeps a stream stalled on a broken path from holding the newer
steps back for longer than superseding would. Within a stream each buddy has its own task, so that a buddy the
coordinator stops assigning (it died) is cut off alone while the others finish. When the stream ends the rank's
process gets its free slots back, with a note when the step did not reach every buddy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from snapshotd.logs import fields

from .config import SidecarConfig
from .inflight import Flight
from .integrity import Seal
from .local import LocalRank
from .node import NodeState
from .pacer import Pacer
from .peers import PeerError, PeerLinks
from .tasks import TaskTree
from .transfer import CodecPolicy, send_snapshot

__all__ = ["FINISH_FIRST", "FINISH_WAIT", "PUSH_MIN_BYTES", "RankNotify", "StreamService"]

log = logging.getLogger(__name__)

PUSH_MIN_BYTES = 1 << 20
"""Smaller snapshots stream as data-plane messages even where they could push: a push's connections cost more
than they save on a few chunks."""

FINISH_FIRST = 0.5
"""The share of its bytes a stream must have sent to every buddy for a newer step to wait for it to end."""

FINISH_WAIT = 0.5
"""How long a newer step waits for a nearly sent stream to end, in units of the rank's step time."""

RankNotify = Callable[[LocalRank, str, int], None]
"""Hands a rank its free slots: ``notify(lr, note, failed_step)`` (see :meth:`.ingest.RankNotices.slots`)."""


class StreamService:
    """Streams announced slots to buddies (see the module docstring).

    Args:
        state, cfg: the node's state and configuration (chunk size, window, codec, heartbeat interval).
        links: connections to the other sidecars.
        pacer: keeps every stream of the node inside its bandwidth budget.
        tasks: the sidecar's task tree.
        notify: hands a rank its free slots (``notify(lr, note, failed_step)``).
    """

    def __init__(
        self,
        state: NodeState,
        cfg: SidecarConfig,
        links: PeerLinks,
        pacer: Pacer,
        tasks: TaskTree,
        notify: RankNotify,
    ) -> None:
        self.state = state
        self.cfg = cfg
        self.links = links
        self.pacer = pacer
        self.tasks = tasks
        self.notify = notify
        self.policies: dict[str, CodecPolicy] = {}

    def start(self, lr: LocalRank, index: int) -> None:
        """Stream slot ``index`` of ``lr`` (just announced): now, superseding the rank's stream in flight, or when
        that one ends if it has sent :data:`FINISH_FIRST` of its bytes to every buddy (see the module docstring)."""
        task = lr.stream_task
        if task is not None and not task.done() and lr.step_seconds > 0 and self._nearly_sent(lr):
            if lr.next_due is None:  # the first step to wait sets how long any waits
                lr.next_due = asyncio.get_running_loop().call_later(
                    FINISH_WAIT * lr.step_seconds, self._overdue, lr
                )
            lr.next_slot = index  # a step announced earlier and still waiting is passed over
            return
        self._launch(lr, index)

    def _launch(self, lr: LocalRank, index: int) -> None:
        lr.cancel_next()
        if lr.stream_task is not None:
            lr.stream_task.cancel()
        slot = lr.slots[index]
        slot.streaming = (
            True  # from now, not from when the task first runs: slots handed back meanwhile skip it
        )
        task = self.tasks.spawn(self._stream(lr, index), f"stream of {lr.job} rank {lr.rank}")
        # a task cancelled before it ever ran never reaches its finally
        task.add_done_callback(lambda _: setattr(slot, "streaming", False))
        lr.stream_task = task

    def _start_next(self, lr: LocalRank) -> None:
        """Stream the step that waited for the rank's stream in flight, if it still may: that stream ended, or
        it took too long (:data:`FINISH_WAIT`)."""
        index = lr.next_slot
        lr.cancel_next()
        if index is None or self.state.ranks.get((lr.job, lr.rank)) is not lr:
            return
        # streamed even once the rank's process is gone, as a stream started at its announce would go on
        if lr.slots[index].valid and lr.slots[index].seal is not None:
            self._launch(lr, index)

    def _overdue(self, lr: LocalRank) -> None:
        lr.next_due = None
        self._start_next(lr)

    @staticmethod
    def _nearly_sent(lr: LocalRank) -> bool:
        flights = lr.stream_flights
        return (
            bool(flights)
            and flights.keys() == lr.buddy_streams.keys()
            and all(f.data_sent >= FINISH_FIRST * f.data_bytes for f in flights.values())
        )

    def restream(self, lr: LocalRank) -> None:
        """``lr``'s buddies changed: stream its newest snapshot to them now, unless a stream of it is under way or
        that snapshot is durable already. Else the new buddies would get their first copy at the rank's next
        announce, and with the rank's slots held by copies that are not durable, that one may be many steps
        away (see ``AlignedStride``)."""
        if lr.stream_task is not None or not lr.alive or lr.awaiting_restore:
            return  # a stream under way, or a new process whose restore decides which step counts
        if not self.state.assignments.get((lr.job, lr.rank)):
            return  # no buddy now: nothing to stream to
        index = lr.kept_slot()
        if index is None:
            return
        slot = lr.slots[index]
        if (
            slot.seal is None
            or slot.step <= max(lr.durable_step, lr.job_durable)
            or slot.step in lr.job_unusable
        ):
            return  # durable already (here, or job-wide), or a step no restore may use
        log.info(
            "%s rank %d: streaming step %d again, to its new buddies",
            lr.job,
            lr.rank,
            slot.step,
            extra=fields(lr.job, lr.rank, slot.step, "restream"),
        )
        self.start(lr, index)

    def cut_off(self, lr: LocalRank, assigned: tuple[str, ...]) -> None:
        """Stop the part of ``lr``'s stream in flight that goes to a sidecar no longer among its buddies."""
        for addr, task in lr.buddy_streams.items():
            if addr not in assigned and not task.done():
                log.info(
                    "%s is no longer a buddy of %s rank %d: its stream stops",
                    addr,
                    lr.job,
                    lr.rank,
                    extra=fields(lr.job, lr.rank, event="buddy_removed"),
                )
                task.cancel()

    def _fill(self, lr: LocalRank, seal: Seal, data: memoryview, step: int) -> None:
        """Take the checksum of every block of a slot that has none yet, in a worker thread: whether or not a buddy
        ever takes the slot, its seal is whole."""
        self.tasks.spawn(
            asyncio.to_thread(seal.fill, data), f"checksums of {lr.job} rank {lr.rank} step {step}"
        )

    async def _stream(self, lr: LocalRank, index: int) -> None:
        s = lr.slots[index]
        s.streaming = True
        buddies: tuple[str, ...] = ()
        errors: list[str] = []
        ok = 0
        reassigned = False
        me = asyncio.current_task()
        mine: dict[str, asyncio.Task[None]] = {}
        flights: dict[str, Flight] = {}
        data = lr.arena.slot(index)[: s.data_bytes]
        seal = s.seal
        assert seal is not None  # every announced slot has one
        try:
            # the slot's checksums, taken now in a worker thread (the sends below take any
            if not self.cfg.pushes:
                self._fill(lr, seal, data, s.step)  # block's that is not in yet themselves, alike)
            # a rank that just registered gets its buddies with the next heartbeat reply
            buddies = await self.state.buddies(lr.job, lr.rank, timeout=4 * self.cfg.heartbeat_interval + 1.0)
            prev = lr.previous(index)
            base = None
            if prev is not None and lr.slots[prev].table == s.table:
                base = (lr.slots[prev].step, lr.arena.slot(prev)[: s.data_bytes])
            took: set[str] = set()

            async def one(addr: str) -> None:
                policy = self.policies.setdefault(addr, CodecPolicy(self.cfg.codec))
                pushes = (
                    self.cfg.pushes and s.data_bytes >= PUSH_MIN_BYTES and policy.raw_stream(self.pacer.cap)
                )
                lanes = self.cfg.push_connections if pushes else 0
                try:
                    with (
                        self.state.paths.transfer(addr),
                        self.state.in_flight.stream(addr, s.data_bytes) as flight,
                    ):
                        flights[addr] = flight
                        res = await send_snapshot(
                            self.links.get(addr),
                            job=lr.job,
                            rank=lr.rank,
                            step=s.step,
                            src_node=self.state.node,
                            data=data,
                            table=s.table,
                            meta=s.meta,
                            seal=seal,
                            window=self.cfg.window,
                            pacer=self.pacer,
                            policy=policy,
                            base=base,
                            elem=s.elem,
                            lanes=lanes,
                            flight=flight,
                        )
                except PeerError as exc:
                    if exc.code is None:  # no answer, or no connection: the path to it is broken
                        self.state.paths.failed(addr, str(exc))
                    else:  # it answered: the path works
                        self.state.paths.succeeded(addr)
                    log.warning(
                        "stream of %s rank %d step %d to %s failed: %s",
                        lr.job,
                        lr.rank,
                        s.step,
                        addr,
                        exc,
                        extra=fields(lr.job, lr.rank, s.step, "stream_failed"),
                    )
                    errors.append(f"{addr}: {exc}"[:300])
                    return
                except Exception as exc:  # a bug in this stream: this buddy failed, the others go on
                    self.state.counters.errors += 1
                    log.exception(
                        "stream of %s rank %d step %d to %s failed",
                        lr.job,
                        lr.rank,
                        s.step,
                        addr,
                        extra=fields(lr.job, lr.rank, s.step, "stream_failed"),
                    )
                    errors.append(f"{addr}: {type(exc).__name__}: {exc}"[:300])
                    return
                took.add(addr)
                self.state.counters.streamed(
                    addr, res.wire_bytes, -(-res.data_bytes // seal.block_bytes), res.delta_chunks
                )
                log.debug(
                    "step %d of %s rank %d -> %s: %d B (%d on the wire) in %.3f s",
                    s.step,
                    lr.job,
                    lr.rank,
                    addr,
                    res.data_bytes,
                    res.wire_bytes,
                    res.seconds,
                )

            async with asyncio.TaskGroup() as group:  # one task per buddy: a reassigned one is cut off alone
                mine = lr.buddy_streams = {addr: group.create_task(one(addr)) for addr in buddies}
                lr.stream_flights = flights
            ok = len(took)
            if len(errors) < len(buddies) - ok:
                reassigned = True
                errors.append("a buddy was reassigned by the coordinator (it died, or the path to it broke)")
        finally:
            # the lanes took each block's checksum as they sent it; any they did not reach now
            if self.cfg.pushes and not seal.whole(data.nbytes):
                self._fill(lr, seal, data, s.step)
            if lr.buddy_streams is mine:  # a newer stream of the rank may have taken over already
                lr.buddy_streams = {}
            if lr.stream_flights is flights:
                lr.stream_flights = {}
            s.streaming = False
            if buddies and ok == len(buddies):
                if s.step >= lr.durable_step:
                    lr.durable_step, lr.durable_at = s.step, s.taken_at
                lr.durable_count += 1
                if lr.waits_on_watermark():  # its buddies report the copy at once: ask for the new D now
                    self.state.changed.fire()
            superseded = lr.stream_task is not None and lr.stream_task is not me
            if lr.stream_task is me:
                lr.stream_task = None
                self._start_next(lr)
            if self.state.ranks.get((lr.job, lr.rank)) is lr and lr.alive:
                if superseded:  # a newer step took over: this one is skipped, not failed
                    self.notify(lr, "", -1)
                elif not buddies:
                    lr.failed("no_buddy")
                    self.notify(lr, "no buddy assigned yet", s.step)
                elif ok < len(buddies):
                    lr.failed("buddy_reassigned" if reassigned and len(errors) == 1 else "buddy_failed")
                    note = f"{len(buddies) - ok} of {len(buddies)} buddies did not take step {s.step}"
                    if errors:
                        note += ": " + "; ".join(errors)
                    self.notify(lr, note[:4000], s.step)
                else:
                    self.notify(lr, "", -1)
                if reassigned and not superseded:  # the step may still reach the buddies that replaced them
                    self.restream(lr)
