"""The sidecar's control loop: registration, heartbeats, and what the coordinator's replies ask for.

A heartbeat goes out every interval the coordinator gives, and at once whenever the node's state changed in a
way the coordinator must hear of (:attr:`~.node.NodeState.changed`: a rank registered or died, a copy completed
or went). It carries the ranks and the inventory of complete copies only when they differ from what the last
acknowledged heartbeat carried; the broken paths to peers (:mod:`.paths`) it always carries. Each reply brings the buddy assignments (a stream to a sidecar no longer
assigned stops), each job's watermarks (buddy copies below the durable step D, or of steps no restore can use,
are dropped, and a rank whose held slots are no longer needed gets them back), and re-replication tasks.
A heartbeat not answered within two intervals (half a second at least) is followed at once by the next, so one
lost message costs the node's liveness at most that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from snapshotd.logs import fields
from snapshotd.proto import Heartbeat, HeartbeatReply, ProtocolError, RegisterSidecar
from snapshotd.shm import pid_alive

from .config import SidecarConfig
from .control import CoordinatorClient, CoordinatorUnavailable
from .node import NodeState
from .replicate import ReplicateService
from .serve import ServeService
from .stream import RankNotify, StreamService
from .tasks import TaskTree

__all__ = ["ControlService"]

log = logging.getLogger(__name__)


class ControlService:
    """Runs the control loop (see the module docstring).

    Args:
        state, cfg: the node's state and configuration.
        control: the coordinator client.
        streams: outgoing streams (a reassigned buddy's part is cut off).
        serve: the data plane (incoming streams whose sender vanished are forgotten).
        replicate: runs re-replication tasks.
        tasks: the sidecar's task tree.
        notify: hands a rank the slots it may have back.
    """

    def __init__(
        self,
        state: NodeState,
        cfg: SidecarConfig,
        control: CoordinatorClient,
        streams: StreamService,
        serve: ServeService,
        replicate: ReplicateService,
        tasks: TaskTree,
        notify: RankNotify,
    ) -> None:
        self.state = state
        self.cfg = cfg
        self.control = control
        self.streams = streams
        self.serve = serve
        self.replicate = replicate
        self.tasks = tasks
        self.notify = notify

    async def run(self) -> None:
        """Heartbeat until cancelled; the coordinator's absence is waited out (its next start is heard)."""
        interval = self.cfg.heartbeat_interval
        registered = False
        sent: tuple[object, ...] | None = None  # what the last acknowledged heartbeat reported
        seq = 0  # heartbeats sent (each reply echoes its heartbeat's)
        with self.state.changed.subscribe() as changed:
            while True:
                try:
                    if not registered:
                        reply = await self.control.register(
                            RegisterSidecar(
                                node=self.state.node,
                                rack=self.cfg.rack,
                                data_addr=self.state.data_addr,
                                incarnation=self.state.incarnation,
                            ),
                            timeout=max(1.0, 4 * interval),
                        )
                        interval = reply.heartbeat_interval
                        registered, sent = True, None
                        log.info(
                            "registered with coordinator %s as %s",
                            self.cfg.coordinator,
                            self.state.node,
                            extra=fields(event="registered"),
                        )
                    self._check_ranks()
                    self.serve.forget_vanished_streams()
                    changed.clear()  # a change from here on wakes the next heartbeat, even one made while this waits
                    report = self.state.report()
                    news = report != sent
                    counters = self.state.counters
                    pace = self.streams.pacer.state()
                    seq += 1
                    hb = Heartbeat(
                        node=self.state.node,
                        incarnation=self.state.incarnation,
                        changed=news,
                        ranks=report[0] if news else (),
                        inventory=report[1] if news else (),
                        bytes_out=counters.bytes_out,
                        bytes_in=counters.bytes_in,
                        stored_bytes=self.state.store.used_bytes,
                        seq=seq,
                        pace_Bps=0 if math.isinf(pace.rate) else int(pace.rate),
                        step_budget_ppm=round(pace.budget * 1e6),
                        step_slowdown_ppm=round(min(1e9, max(-1e6, pace.slowdown * 1e6))),
                        seats=tuple(self.state.seats.values()) if news else (),
                        unreachable=self.state.paths.troubles(),
                    )
                    sent_at = time.monotonic()
                    hb_reply = await self.control.heartbeat(hb, timeout=max(0.5, 2 * interval))
                    counters.heartbeat_rtt.add(time.monotonic() - sent_at)
                    if not hb_reply.known:
                        registered = False
                        continue
                    sent = report
                    interval = hb_reply.heartbeat_interval or interval  # stretched as the fleet grows
                    self._apply(hb_reply)
                except CoordinatorUnavailable as exc:  # waited out: its next start is heard
                    log.debug("control plane: %s", exc)
                    if registered:
                        continue  # a heartbeat or its reply was lost: the next goes at once, so liveness holds
                except ProtocolError as exc:  # refused (a registration it cannot use): say so, ask again
                    log.warning("the coordinator refused this sidecar: %s", exc)
                except Exception:  # a bug in one round: the next round tries again, an interval later
                    self.state.counters.errors += 1
                    log.exception("control loop round failed")
                    changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await changed.wait()

    def _check_ranks(self) -> None:
        for lr in self.state.ranks.values():
            if lr.alive and not pid_alive(lr.pid):
                lr.mark_dead()
                self.streams.pacer.forget((lr.job, lr.rank))
                log.warning(
                    "rank %d of job %s (pid %d) died; its last snapshot stays in shared memory",
                    lr.rank,
                    lr.job,
                    lr.pid,
                    extra=fields(lr.job, lr.rank, event="rank_died"),
                )

    def _apply(self, reply: HeartbeatReply) -> None:
        state = self.state
        was = state.assignments
        state.set_assignments({(a.job, a.rank): a.buddies for a in reply.assignments})
        for lr in state.ranks.values():
            key = (lr.job, lr.rank)
            assigned = state.assignments.get(key, ())
            self.streams.cut_off(lr, assigned)
            if was.get(key, assigned) != assigned:  # re-placed: its newest snapshot goes to the new buddies
                self.streams.restream(lr)
        for w in reply.watermarks:
            unusable = frozenset(w.unusable)
            state.store.drop_unneeded(w.job, w.durable, unusable)
            for lr in state.ranks.values():
                if lr.job == w.job and (lr.job_durable, lr.job_unusable) != (w.durable, unusable):
                    before = lr.free_slots()
                    lr.job_durable, lr.job_unusable = w.durable, unusable
                    # a held copy is no longer needed: the client may have its slot
                    if lr.free_slots() != before:
                        self.notify(lr, "", -1)
        for task in reply.tasks:
            self.tasks.spawn(
                self.replicate.replicate(task),
                f"re-replication of {task.job} rank {task.rank} step {task.step}",
            )
