"""Heartbeat ingest: what a node reports (its ranks and its inventory) applied to the job index.

A report replaces the node's ranks and inventory wholesale and costs O(ranks and inventory of that node); only the
difference to its last report moves anything in the index, and a report of the same ranks as last time moves
nothing.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable

from snapshotd.proto import Heartbeat, RankInfo

from .jobs import Item, Job, Jobs, check_rank
from .membership import Membership, Node

__all__ = ["Reports"]

log = logging.getLogger(__name__)

_ITEM = operator.attrgetter("job", "rank", "step", "local")
_SNAPSHOT = operator.attrgetter("job", "rank", "step")
_JOB = operator.itemgetter(0)


class Reports:
    """Applies nodes' reports to ``jobs``; the nodes are those of ``membership``."""

    def __init__(self, jobs: Jobs, membership: Membership) -> None:
        self._jobs = jobs
        self._nodes = membership.nodes

    @staticmethod
    def check(msg: Heartbeat) -> None:
        """Refuse a heartbeat reporting a rank outside its world size.

        Raises:
            ValueError: naming the rank.
        """
        for info in msg.ranks:
            check_rank(info.job, info.rank, info.world_size)

    def apply(self, node: Node, msg: Heartbeat) -> None:
        """Replace ``node``'s ranks and inventory with those ``msg`` reports (a heartbeat with ``changed``)."""
        ranks = {(info.job, info.rank): info for info in msg.ranks}
        if not self._settled(node, ranks):
            self._set_ranks(node, ranks)
        inventory = frozenset(map(_ITEM, msg.inventory))
        if len(inventory) != len(set(map(_SNAPSHOT, msg.inventory))):  # a buddy copy wins over a local one
            inventory = frozenset(it for it in inventory if not (it[3] and (*it[:3], False) in inventory))
        self._set_inventory(node, inventory)
        node.jobs = tuple(sorted({j for j, _ in node.ranks} | set(map(_JOB, inventory))))

    def drop(self, node: Node) -> None:
        """Forget everything ``node`` reported (it died, or restarted as a new incarnation): its ranks lose their
        home, its inventory leaves the index, its pending tasks are dropped."""
        self._set_ranks(node, {})
        self._set_inventory(node, frozenset())
        node.jobs, node.tasks = (), []

    def _set_ranks(self, node: Node, ranks: dict[tuple[str, int], RankInfo]) -> None:
        """Replace the ranks a node reports; move homes accordingly.

        "Latest report wins" for a rank's home, with one refinement: a report of a dead process does not take
        the home away from another live node that reports the same rank alive (the restarted replacement).
        """
        old = node.ranks
        for key, info in ranks.items():
            job = self._jobs.job(info.job)
            if job.world_size != info.world_size:
                self._jobs.resize(job, info.world_size)
            prev = old.get(key)
            if not info.alive and (prev is None or prev.alive or prev.pid != info.pid):
                log.warning(
                    "rank %d of job %s on node %s died (pid %d)", info.rank, info.job, node.name, info.pid
                )
            home = job.homes.get(info.rank)
            if home != node.name and (info.alive or home is None or not self._reports_alive(home, key)):
                self._set_home(job, info.rank, node)
        for job_name, rank in old.keys() - ranks.keys():
            gone = self._jobs.get(job_name)  # None: forgotten (a dead node's last report still named it)
            if gone is None or gone.homes.get(rank) == node.name:
                if gone is not None:
                    gone.set_home(rank, None)
                node.homed.discard((job_name, rank))
                node.assignments = None
        node.ranks = ranks

    def _settled(self, node: Node, ranks: dict[tuple[str, int], RankInfo]) -> bool:
        """Whether :meth:`_set_ranks` would change nothing: the same report as last time, every rank homed here."""
        if ranks != node.ranks:
            return False
        for (job_name, rank), info in ranks.items():
            job = self._jobs[job_name]
            if job.world_size != info.world_size or job.homes.get(rank) != node.name:
                return False
        return True

    def _reports_alive(self, name: str, key: tuple[str, int]) -> bool:
        node = self._nodes[name]
        info = node.ranks.get(key)
        return node.alive and info is not None and info.alive

    def _set_home(self, job: Job, rank: int, node: Node) -> None:
        previous = job.homes.get(rank)
        if previous is not None:
            prev_node = self._nodes[previous]
            prev_node.homed.discard((job.name, rank))
            prev_node.assignments = None
        job.set_home(rank, node.name)
        node.homed.add((job.name, rank))
        node.assignments = None

    def _set_inventory(self, node: Node, inventory: frozenset[Item]) -> None:
        old = node.inventory
        if old == inventory:
            return
        for name, items in _by_job(old - inventory):
            self._jobs[name].remove(node.name, items)
        for name, items in _by_job(inventory - old):
            job = self._jobs.job(name)
            job.seen_inventory = True
            job.add(node.name, items)
        node.inventory = inventory


def _by_job(items: frozenset[Item]) -> list[tuple[str, Iterable[Item]]]:
    """``items`` grouped by job (a node's inventory is nearly always of one job: then no copy is made)."""
    if not items:
        return []
    jobs = set(map(_JOB, items))
    if len(jobs) == 1:
        return [(jobs.pop(), items)]
    return [(j, [it for it in items if it[0] == j]) for j in sorted(jobs)]
