"""The coordinator's soft state, made of its parts, and the requests that touch several of them.

Pure logic: no sockets, no asyncio, no clock. Every entry point takes ``now`` (seconds, monotonic) so that tests
drive time by hand. Everything here is rebuilt from the sidecars' reports after a restart: a heartbeat from a
node this process does not know gets ``known=False`` and the sidecar registers and reports everything again.

The parts: :mod:`.membership` (nodes, liveness, the heartbeat schedule), :mod:`.jobs` (the inventory index and
the watermarks), :mod:`.reports` (heartbeat ingest), :mod:`.placement` (buddies), :mod:`.plans` (plan rounds),
:mod:`.seats` (which ranks a node runs),
:mod:`.replication` (the re-replication sweep) and :mod:`.status` (the status document). A request that concerns
one part goes to it directly (``state.plans.plan(...)``, ``state.membership.member(...)``); this class answers
those that concern several: registration, heartbeats, expiry and probes (a lost peer reported, a node found gone).

Cost model: a heartbeat costs O(ranks and inventory of that node) (see :mod:`.reports` and :mod:`.jobs`);
placement is cached per node until membership changes; the re-replication sweep, the only O(ranks of all jobs)
pass, runs in slices (see :mod:`.replication`); a plan request costs O(its ranks) (see :mod:`.plans`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from typing import Any

import msgpack

from snapshotd.proto import (
    Drain,
    DrainReply,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    PeerLostReply,
    PeerLostReport,
    RegisterSidecar,
    SidecarRegistered,
)

from .config import CoordinatorConfig
from .jobs import Jobs
from .membership import Membership, Node
from .placement import Placement
from .plans import Plans
from .replication import Sweep
from .reports import Reports
from .seats import Seats
from .status import status_parts

__all__ = ["CoordinatorState"]

log = logging.getLogger(__name__)


class CoordinatorState:
    """Everything the coordinator knows, and the answers to registration, heartbeats and expiry.

    Args:
        cfg: the configuration.
        now: the start time; plan requests wait for the death timeout after it (the rebuild window, see
            :meth:`~.plans.Plans.rebuilding`).

    ``bad_messages`` and ``heartbeats`` are counters shown in the status document; the server increments the
    first.
    """

    def __init__(self, cfg: CoordinatorConfig, now: float) -> None:
        self.cfg = cfg
        self.started = now
        self.bad_messages = 0
        self.heartbeats = 0
        self.membership = Membership(cfg, now)
        self.jobs = Jobs(cfg.replicas)
        self.placement = Placement(self.membership, cfg.replicas)
        self.plans = Plans(self.jobs, self.membership, now)
        self.seats = Seats(self.jobs, self.membership, self.plans)
        self._reports = Reports(self.jobs, self.membership)
        self._sweep = Sweep(cfg, self.jobs, self.membership, self.placement, now)
        self._unreported: dict[str, float] = {}  # job -> since when no live node reports it
        self._peer_lost_at: dict[str, float] = {}  # job -> when a lost peer's report last queued its nodes
        self._next_forget = now

    def register(self, msg: RegisterSidecar, now: float) -> SidecarRegistered:
        """A sidecar joins. A new incarnation of a known node name drops that node's old ranks and inventory.

        The same incarnation registering again (a lost reply, or a node declared dead that came back) keeps
        what the coordinator still has of it; a dead node's inventory was already dropped at expiry, and the
        sidecar reports everything in the heartbeat that follows its registration.

        Raises:
            ValueError: see :func:`check_registration` (nothing is recorded).
        """
        check_registration(msg)
        known = self.membership.nodes.get(msg.node)
        if known is not None and known.incarnation != msg.incarnation:
            log.info(
                "node %s restarted (incarnation %s -> %s): its old ranks and snapshots are gone",
                msg.node,
                known.incarnation,
                msg.incarnation,
            )
            self._reports.drop(known)
        node = self.membership.register(msg, now)
        return SidecarRegistered(heartbeat_interval=node.told)

    def heartbeat(self, msg: Heartbeat, now: float) -> HeartbeatReply:
        """Record a heartbeat; answer with this node's assignments, its jobs' watermarks and its tasks.

        A heartbeat from an unknown node, a dead node or another incarnation gets ``known=False`` (register
        again). With ``changed`` the node's ranks and inventory are replaced wholesale; without, kept. The
        heartbeat interval is told when it is not the configured one or changed since the node was last told,
        else left at 0 (keep yours).

        Raises:
            ValueError: a reported rank is outside its world size (nothing is recorded).
        """
        self.heartbeats += 1
        node = self.membership.nodes.get(msg.node)
        if node is None or not node.alive or node.incarnation != msg.incarnation:
            return HeartbeatReply(known=False, seq=msg.seq)
        self._reports.check(msg)
        self.membership.seen(node, now)
        self.membership.report_paths(node, msg.unreachable)
        node.measure(msg, now)
        if msg.changed:
            self._reports.apply(node, msg)
            self.seats.report(node.name, msg.seats)
        tasks, node.tasks = node.tasks, []
        interval = self.membership.heartbeat_interval()
        tell = interval != self.cfg.heartbeat_interval or node.told != interval
        node.told = interval
        return HeartbeatReply(
            known=True,
            assignments=self.placement.assignments(node),
            watermarks=tuple(self.jobs[j].publish() for j in node.jobs),
            tasks=tuple(tasks),
            heartbeat_interval=interval if tell else 0.0,
            seq=msg.seq,
        )

    def drain(self, msg: Drain) -> DrainReply | Error:
        """Node ``msg.node`` is stopping (see :class:`~snapshotd.proto.Drain`): it leaves placement (its first
        drain), and the reply counts the snapshots at their job's G that it holds while fewer than ``1 + replicas``
        live nodes that stay hold them. Those the re-replication sweep can place another copy of are ``remaining``
        (it places them, pulling from this node while it serves); those it cannot, and that no node that stays
        holds, are ``unplaceable``. An unknown node, or another incarnation, is told to register first
        (``not_registered``: a coordinator that restarted knows it again after its next heartbeat).

        Cost: O(the node's inventory).
        """
        node = self.membership.nodes.get(msg.node)
        if node is None or not node.alive or node.incarnation != msg.incarnation:
            return Error(
                code=ErrorCode.NOT_REGISTERED,
                message=f"node {msg.node} (incarnation {msg.incarnation}) "
                "is not a live node here: register first",
            )
        self.membership.leave(node)
        nodes, want = self.membership.nodes, 1 + self.cfg.replicas
        remaining = unplaceable = 0
        for job_name, rank, step, _ in node.inventory:
            job = self.jobs.get(job_name)
            if job is None or rank >= job.world_size or step != job.publish().recoverable:
                continue  # the sweep, whose work this counts, keeps copies of the job's ranks at G only
            holders = job.holders.get(rank, {}).get(step, {})
            staying = sum(not nodes[h].leaving for h in holders)
            if staying >= want:
                continue
            if self.placement.targets(job, rank, set(holders), want - staying, sources=holders.keys()):
                remaining += 1
            elif staying == 0:
                unplaceable += 1
        return DrainReply(remaining=remaining, unplaceable=unplaceable)

    def expire(self, now: float) -> None:
        """Declare dead every node silent for the death timeout; run the re-replication sweep's next slice when
        one is due.

        A dead node stays listed in the status document (with the ranks it last reported) and counts nowhere
        else: its inventory leaves the index, its ranks lose their home, its pending tasks are dropped.
        """
        for node in self.membership.expire(now):
            self._drop_dead(node)
        self._sweep.run(now)
        if now >= self._next_forget:
            self._forget_unreported_jobs(now)
            self._next_forget = now + min(10.0, self.cfg.forget_jobs_after / 4)

    def peer_lost(self, msg: PeerLostReport, now: float) -> PeerLostReply:
        """A rank of ``msg.job`` lost a peer: queue every other live node running the job's ranks for a probe
        (see :mod:`.probes`); the reply counts those queued now. A job's nodes are queued at most once per
        heartbeat interval: the reports of its other ranks within it (every survivor reports) change nothing.

        Cost: O(the job's ranks), once per job and interval; O(1) for the other reports.
        """
        job = self.jobs.get(msg.job)
        if (
            job is None
            or now < self._peer_lost_at.get(msg.job, -math.inf) + self.membership.heartbeat_interval()
        ):
            # unknown, or its nodes were queued within the interval
            return PeerLostReply(job=msg.job, probed=0)
        self._peer_lost_at[msg.job] = now
        why = f"(rank {msg.rank} of job {msg.job} on node {msg.node} lost a peer)"
        queued = sum(
            self.membership.suspect(name, why, now) for name in sorted(set(job.homes.values()) - {msg.node})
        )
        return PeerLostReply(job=msg.job, probed=queued)

    def lose(self, node: Node, incarnation: str, why: str) -> bool:
        """A probe found node ``node``'s sidecar (``incarnation``) gone: declare it dead now, as :meth:`expire`
        would once its heartbeats were missing for the death timeout. False (nothing changes) when the node is
        dead already or registered again as another incarnation since."""
        if not node.alive or node.incarnation != incarnation:
            return False
        self.membership.declare_dead(node, why, "probe")
        self._drop_dead(node)
        return True

    def _drop_dead(self, node: Node) -> None:
        """Drop what a node just declared dead held; the status document still shows the ranks it last reported."""
        shown = node.ranks
        self._reports.drop(node)
        node.ranks = shown

    def _forget_unreported_jobs(self, now: float) -> None:
        """Forget every job no live node has reported for ``forget_jobs_after`` seconds (see its docstring)."""
        reported = {name for node in self.membership.nodes.values() if node.alive for name in node.jobs}
        for name in list(self.jobs):
            if name in reported:
                self._unreported.pop(name, None)
            elif now - self._unreported.setdefault(name, now) >= self.cfg.forget_jobs_after:
                del self._unreported[name]
                self.jobs.forget(name)
                self.seats.forget(name)
                self._peer_lost_at.pop(name, None)
                log.info(
                    "job %s: no live node has reported it for %.0f s; forgotten",
                    name,
                    self.cfg.forget_jobs_after,
                )

    def status(self, now: float) -> dict[str, Any]:
        """The document behind ``snapshotd status`` (see :func:`~.status.status_parts`), as plain maps, lists,
        strings and numbers."""
        doc: dict[str, Any] = msgpack.unpackb(b"".join(self.status_parts(now)), raw=False)
        return doc

    def status_parts(self, now: float) -> Iterator[bytes]:
        """The status document packed in parts (see :func:`~.status.status_parts`); the counters are read when
        the first part is made."""
        counters = {
            "bad_messages": self.bad_messages,
            "heartbeats": self.heartbeats,
            "node_deaths": dict(self.membership.deaths),
        }
        yield from status_parts(self.cfg, self.membership, self.jobs, counters, self.started, now)


_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):(?P<port>\d{1,5})|ipc://\S+|mem://\S+)$")


def check_registration(msg: RegisterSidecar) -> None:
    """Refuse a registration the coordinator could not use: an empty node name or incarnation, or a data
    address other sidecars could not connect to (buddies are placed there).

    Raises:
        ValueError: naming what is wrong.
    """
    if not msg.node or not msg.incarnation:
        raise ValueError("a sidecar registers with a node name and an incarnation")
    m = _ENDPOINT.match(msg.data_addr)
    if m is None or (m.group("port") is not None and not 0 < int(m.group("port")) < 65536):
        raise ValueError(
            f"node {msg.node}: data address {msg.data_addr!r} is not tcp://HOST:PORT, ipc:// or mem://"
        )
