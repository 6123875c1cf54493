"""Membership: the nodes, which of them are live, their ring and failure domains, and the heartbeat schedule.

Pure logic with no clock and no sockets: every entry point takes ``now`` (seconds, monotonic). A node that
registers is live until it is silent for :meth:`Membership.death_timeout`, or until a probe finds its sidecar
gone (:meth:`Membership.suspect`, :mod:`.probes`); a dead node stays listed (the status
document shows it) until it registers again. A live node that is stopping (:meth:`Membership.leave`) leaves the
ring at once, so that placement puts nothing new on it, and stays live, a source for copies of what it holds, until
its heartbeats stop. Every change of the live set, the ring or the broken paths between nodes (:mod:`.paths`)
bumps :attr:`Membership.epoch`, which tells placement and plan drafts that what they computed may no longer hold.

The rate of heartbeats is bounded instead of the fleet: beyond ``target_heartbeats_per_s`` the interval handed
out grows with the fleet (:meth:`Membership.heartbeat_interval`), and the death timeout with it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math

from snapshotd.logs import fields
from snapshotd.proto import (
    Assignment,
    Heartbeat,
    MemberQuery,
    MemberReply,
    PathTrouble,
    RankInfo,
    RegisterSidecar,
    ReplicateTask,
)
from snapshotd.security import data_host

from .config import CoordinatorConfig
from .jobs import Item
from .paths import BrokenPaths

__all__ = ["DEATH_CAUSES", "Membership", "Node"]

log = logging.getLogger(__name__)

DEATH_CAUSES = ("silent", "probe")
"""Why a node is declared dead: ``silent`` (no heartbeat for the death timeout), ``probe`` (a probe found its
sidecar gone)."""

_RATE_WINDOW_S = 1.0
"""Seconds over which a node's byte rates are measured (at least)."""


@dataclasses.dataclass(slots=True, eq=False)
class Node:
    """A sidecar's node as last reported: its identity, liveness, ranks and inventory, and what it is owed."""

    name: str
    rack: str  # as registered; "" means the node is its own failure domain
    data_addr: str
    incarnation: str
    last_seen: float
    alive: bool = True
    leaving: bool = False  # live and stopping: out of the ring (see Membership.leave)
    told: float = 0.0  # the heartbeat interval it was last given
    ranks: dict[tuple[str, int], RankInfo] = dataclasses.field(default_factory=dict)
    inventory: frozenset[Item] = frozenset()
    jobs: tuple[str, ...] = ()  # jobs it hosts ranks of or holds inventory for, sorted
    homed: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # ranks whose home it is
    tasks: list[ReplicateTask] = dataclasses.field(default_factory=list)  # for its next heartbeat reply
    assignments: tuple[Assignment, ...] | None = None  # cache, valid while assign_epoch == membership epoch
    assign_epoch: int = -1
    stored_bytes: int = 0
    rate_ref: tuple[float, int, int] | None = None  # (time, bytes_out, bytes_in) the rates are measured from
    out_bps: float = 0.0
    in_bps: float = 0.0
    pacer: tuple[int, float, float] = (0, 0.0, 0.0)  # its pacer's rate (0: unpaced), step budget and slowdown
    probed: float = -math.inf  # when it was last queued for a probe (see Membership.suspect)

    @property
    def host(self) -> str:
        """The IPv4 host of its data address, what a ``members`` mode sidecar admits connections from ("": none)."""
        return data_host(self.data_addr)

    @property
    def domain(self) -> tuple[str, str]:
        """The failure domain: the rack, or the node alone when it has no rack label."""
        return ("rack", self.rack) if self.rack else ("node", self.name)

    def measure(self, msg: Heartbeat, now: float) -> None:
        """Take the byte counters of a heartbeat: the rates over at least ``_RATE_WINDOW_S``, restarted when the
        counters go back (a new incarnation)."""
        self.stored_bytes = msg.stored_bytes
        self.pacer = (msg.pace_Bps, msg.step_budget_ppm / 1e6, msg.step_slowdown_ppm / 1e6)
        ref = self.rate_ref
        if ref is None or msg.bytes_out < ref[1] or msg.bytes_in < ref[2]:  # first sample, or counters reset
            self.rate_ref, self.out_bps, self.in_bps = (now, msg.bytes_out, msg.bytes_in), 0.0, 0.0
        elif now - ref[0] >= _RATE_WINDOW_S:
            self.out_bps = (msg.bytes_out - ref[1]) / (now - ref[0])
            self.in_bps = (msg.bytes_in - ref[2]) / (now - ref[0])
            self.rate_ref = (now, msg.bytes_out, msg.bytes_in)


class Membership:
    """Every node that registered, and the order, ring and failure domains of the live ones.

    Args:
        cfg: the heartbeat interval, timeout and target rate are used here.
        now: the start time.
    """

    def __init__(self, cfg: CoordinatorConfig, now: float) -> None:
        self.cfg = cfg
        self.nodes: dict[str, Node] = {}
        self.epoch = 0  # bumped on every change of the live set
        self.ring: list[str] = []  # live node names, sorted, but those leaving
        # ring nodes per failure domain
        self.domains: collections.Counter[tuple[str, str]] = collections.Counter()
        # least recently seen first
        self._live: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._hosts: dict[str, dict[str, None]] = {}  # data-address host -> live node names there
        self._held = (1.0, now)  # (stretch factor the death timeout uses, until when at least)
        self.suspects: dict[str, str] = {}  # live nodes to probe, oldest first -> why each is suspected
        self.paths = BrokenPaths()  # the pairs of live nodes that cannot move snapshots to each other
        self._addrs: dict[str, str] = {}  # live nodes' data addresses -> their names
        self.deaths = dict.fromkeys(DEATH_CAUSES, 0)
        """Nodes declared dead, by cause (:data:`DEATH_CAUSES`; every cause listed from the start). A leaving node
        whose heartbeats stop left; it did not die."""

    @property
    def live(self) -> int:
        """How many nodes are live."""
        return len(self._live)

    def register(self, msg: RegisterSidecar, now: float) -> Node:
        """A sidecar joins (or joins again): its node is live, with the rack and data address it gives.

        A node coming back from the dead has no ranks until its next heartbeat; a new incarnation starts its
        byte rates afresh. Whatever the old incarnation held must be dropped by the caller before.
        """
        node = self.nodes.get(msg.node)
        if node is None:
            node = self.nodes[msg.node] = Node(msg.node, msg.rack, msg.data_addr, msg.incarnation, now)
            log.info("node %s joined (rack %s, data %s)", msg.node, msg.rack or "-", msg.data_addr)
            self._add_live(node)
        else:
            if node.incarnation != msg.incarnation:
                node.incarnation, node.rate_ref = msg.incarnation, None
                if node.alive and node.leaving:  # restarted while it drained: it stays after all
                    node.leaving = False
                    self._place(node)
                    self.epoch += 1
            if not node.alive:
                log.info("node %s is back", msg.node)
                node.ranks, node.alive, node.last_seen = {}, True, now
                self._add_live(node)
            if (node.rack, node.data_addr) != (msg.rack, msg.data_addr):
                self._remove_live(node)
                node.rack, node.data_addr = msg.rack, msg.data_addr
                self._add_live(node)
        self.seen(node, now)
        node.told = self.heartbeat_interval()
        return node

    def seen(self, node: Node, now: float) -> None:
        """``node`` was heard from at ``now``."""
        node.last_seen = now
        self._live.move_to_end(node.name)

    def pardon(self, gap: float, now: float) -> None:
        """The coordinator itself did not run for ``gap`` seconds (stopped, or starved of CPU): no live node's
        silence counts for that time, so that no node is declared dead for a heartbeat nobody was there to hear."""
        for name in self._live:
            node = self.nodes[name]
            node.last_seen = min(node.last_seen + gap, now)

    def expire(self, now: float) -> list[Node]:
        """Declare dead, and return, every live node silent for :meth:`death_timeout`; the caller drops what
        they held."""
        deadline = now - self.death_timeout(now)
        dead: list[Node] = []
        while self._live:
            node = self.nodes[next(iter(self._live))]
            if node.last_seen > deadline:
                break
            self.declare_dead(node, f"missed heartbeats for {now - node.last_seen:.1f} s", "silent")
            dead.append(node)
        return dead

    def declare_dead(self, node: Node, why: str, cause: str) -> None:
        """``node`` (live) is dead because of ``why`` (logged as "node NAME WHY: declared dead", and counted in
        :attr:`deaths` under ``cause``; a node that was leaving, as "node NAME left (WHY)", and not counted)."""
        if node.leaving:
            log.info("node %s left (%s)", node.name, why, extra=fields(event="node_left"))
        else:
            log.warning("node %s %s: declared dead", node.name, why, extra=fields(event="node_dead"))
            self.deaths[cause] += 1
        self._remove_live(node)
        node.alive, node.leaving = False, False
        self.suspects.pop(node.name, None)

    def leave(self, node: Node) -> bool:
        """Live ``node`` is stopping: it leaves the ring (placement puts nothing new on it) and stays live until
        its heartbeats stop. True if it was not leaving before."""
        if not node.alive or node.leaving:
            return False
        log.info(
            "node %s is leaving: placing what it holds elsewhere",
            node.name,
            extra=fields(event="node_leaving"),
        )
        self._unplace(node)
        node.leaving = True
        self.epoch += 1
        return True

    def suspect(self, name: str, why: str, now: float) -> bool:
        """Something points at live node ``name``'s death before its heartbeats have stopped for the death
        timeout (``why`` says what): queue it for a probe (see :mod:`.probes`), unless it was queued within the
        last heartbeat interval. True if it was queued now."""
        node = self.nodes.get(name)
        if (
            node is None
            or not node.alive
            or name in self.suspects
            or now < node.probed + self.heartbeat_interval()
        ):
            return False
        node.probed = now
        self.suspects[name] = why
        return True

    def take_suspects(self, most: int) -> list[tuple[Node, str]]:
        """Up to ``most`` queued suspects (oldest first) that are still live, with why each is suspected."""
        taken: list[tuple[Node, str]] = []
        while self.suspects and len(taken) < most:
            name = next(iter(self.suspects))
            why = self.suspects.pop(name)
            node = self.nodes[name]
            if node.alive:
                taken.append((node, why))
        return taken

    def member(self, msg: MemberQuery) -> MemberReply:
        """Whether ``msg.host`` is the IPv4 host of a live node's data address (any node registered here: one
        coordinator serves one job)."""
        on_host = self._hosts.get(data_host(f"tcp://{msg.host}:0"))
        node = next(iter(on_host), "") if on_host else ""
        return MemberReply(host=msg.host, member=bool(node), node=node)

    def heartbeat_interval(self) -> float:
        """The interval every sidecar is given now (see ``CoordinatorConfig.target_heartbeats_per_s``).

        The configured one while ``live nodes / interval`` stays under the target rate; beyond, ``live nodes /
        target``, rounded up to a quarter of the configured interval so that one node joining or leaving does
        not change every node's interval.
        """
        base = self.cfg.heartbeat_interval
        factor = len(self._live) / (self.cfg.target_heartbeats_per_s * base)
        return base if factor <= 1.0 else min(3600.0, base * math.ceil(factor * 4) / 4)

    def death_timeout(self, now: float) -> float:
        """Seconds of silence after which a node is dead: ``heartbeat_timeout`` stretched like the interval.

        When the interval shrinks (nodes left), the longer timeout is kept for one such timeout, so that nodes
        still on the longer interval, which learn the new one only at their next heartbeat, are not declared dead.
        """
        factor = self.heartbeat_interval() / self.cfg.heartbeat_interval
        held, until = self._held
        if factor >= held or now >= until:
            held = factor
            self._held = (factor, now + factor * self.cfg.heartbeat_timeout)
        return self.cfg.heartbeat_timeout * held

    def report_paths(self, node: Node, troubles: tuple[PathTrouble, ...]) -> None:
        """Live ``node``'s heartbeat named the peers it cannot reach (see :mod:`.paths`); a change of the broken
        pairs bumps :attr:`epoch`. O(1) while the report is the node's last one."""
        if self.paths.report(node.name, troubles, self._addrs):
            self.epoch += 1

    def _add_live(self, node: Node) -> None:
        self._live[node.name] = None
        self._addrs[node.data_addr] = node.name
        self.paths.rebuild(self._addrs)  # a report may name its address; the epoch is bumped below
        if not node.leaving:
            self._place(node)
        if node.host:
            self._hosts.setdefault(node.host, {})[node.name] = None
        self.epoch += 1

    def _remove_live(self, node: Node) -> None:
        del self._live[node.name]
        if self._addrs.get(node.data_addr) == node.name:
            del self._addrs[node.data_addr]
        self.paths.drop(
            node.name, self._addrs
        )  # its reports, and the pairs naming it; the epoch is bumped below
        if not node.leaving:
            self._unplace(node)
        on_host = self._hosts.get(node.host)
        if on_host is not None:
            del on_host[node.name]
            if not on_host:
                del self._hosts[node.host]
        self.epoch += 1

    def _place(self, node: Node) -> None:
        bisect.insort(self.ring, node.name)
        self.domains[node.domain] += 1

    def _unplace(self, node: Node) -> None:
        del self.ring[bisect.bisect_left(self.ring, node.name)]
        self.domains[node.domain] -= 1
