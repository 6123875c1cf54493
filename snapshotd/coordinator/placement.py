"""Buddy placement: which live nodes back up a node's ranks, and where a missing copy goes.

A node's buddies are the first ``replicas`` live nodes after it in ring order (sorted names) outside its failure
domain and not across a broken path from it (:mod:`.paths`; one across a broken path only where no other is
left), computed once per node until membership or the broken paths change (:attr:`Membership.epoch`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Collection

from snapshotd.proto import Assignment

from .jobs import Job
from .membership import Membership, Node

__all__ = ["Placement"]

log = logging.getLogger(__name__)


class Placement:
    """Buddies and re-replication targets over the live nodes of ``membership``.

    Args:
        membership: the live nodes.
        replicas: buddy copies wanted of every rank's snapshot.
    """

    def __init__(self, membership: Membership, replicas: int) -> None:
        self._membership = membership
        self._replicas = replicas
        self._buddies: dict[str, tuple[str, ...]] = {}  # node -> buddy node names, for epoch _epoch
        self._epoch = -1
        self._warned_short = False

    def buddies(self, name: str) -> tuple[str, ...]:
        """The first ``replicas`` live nodes after ``name`` in ring order whose failure domain differs, those across
        a broken path from it last."""
        members = self._membership
        if self._epoch != members.epoch:
            self._buddies.clear()
            self._epoch = members.epoch
        cached = self._buddies.get(name)
        if cached is not None:
            return cached
        nodes, ring = members.nodes, members.ring
        domain = nodes[name].domain
        want = min(self._replicas, len(ring) - members.domains[domain])
        if want < self._replicas and not self._warned_short:
            self._warned_short = True
            log.warning(
                "only %d live node(s) outside %s's rack for %d replica(s): placing fewer buddies "
                "(warned once)",
                want,
                name,
                self._replicas,
            )
        out: list[str] = []
        across: list[str] = []  # candidates across a broken path: taken only where no other is left
        paths = members.paths
        start = bisect.bisect_right(ring, name)
        for i in range(len(ring)):
            if len(out) >= want:
                break
            cand = ring[(start + i) % len(ring)]
            if nodes[cand].domain != domain:
                (across if paths.broken(name, cand) else out).append(cand)
        out.extend(across[: want - len(out)])
        result = self._buddies[name] = tuple(out)
        return result

    def assignments(self, node: Node) -> tuple[Assignment, ...]:
        """Where ``node`` streams the ranks it is home to: its buddies' data addresses, per rank, by job and rank.

        The same tuple while neither its ranks nor membership changed, so that replies holding it stay cacheable.
        """
        epoch = self._membership.epoch
        if node.assignments is None or node.assign_epoch != epoch:
            nodes = self._membership.nodes
            addrs = tuple(nodes[b].data_addr for b in self.buddies(node.name))
            node.assignments = tuple(Assignment(job=j, rank=r, buddies=addrs) for j, r in sorted(node.homed))
            node.assign_epoch = epoch
        return node.assignments

    def targets(
        self, job: Job, rank: int, exclude: set[str], count: int, sources: Collection[str] = ()
    ) -> list[str]:
        """Up to ``count`` live nodes for a new copy: the rank's assigned buddies, then ring order from its home.
        With ``sources`` (the copy's holders), never a node across a broken path from every one of them
        (:mod:`.paths`): its pull could not succeed.

        Never the home (or the last home, when the rank has none now) nor its failure domain, nor a node in
        ``exclude`` (holders and pending targets), nor a node leaving (out of the ring). Beyond the buddies, domains holding no copy yet come
        first. The ring is walked only when the domain counts say a candidate exists, so a deficit that cannot
        be helped costs O(copies), not O(nodes).
        """
        nodes, ring, domains = self._membership.nodes, self._membership.ring, self._membership.domains
        home = job.homes.get(rank)
        anchor = home or job.last_home.get(rank)
        anchor_domain = nodes[anchor].domain if anchor is not None else None
        paths = self._membership.paths
        blocked = (  # O(ring x sources), only while some path is broken
            {n for n in ring if n not in exclude and all(paths.broken(n, h) for h in sources)}
            if sources and paths
            else set()
        )
        picked = (
            [b for b in self.buddies(home) if b not in exclude and b not in blocked][:count]
            if home is not None
            else []
        )
        placed = [
            n for n in (*exclude, *picked) if nodes[n].alive and not nodes[n].leaving
        ]  # those in the ring
        taken = {nodes[n].domain for n in placed} - {anchor_domain}
        outside = len(ring) - (domains[anchor_domain] if anchor_domain is not None else 0)
        others = [n for n in blocked if n not in picked and nodes[n].domain != anchor_domain]
        # ring nodes in domains without a copy, and all ring nodes, that may take it
        fresh = outside - sum(domains[d] for d in taken) - sum(nodes[n].domain not in taken for n in others)
        spare = outside - sum(1 for n in placed if nodes[n].domain != anchor_domain) - len(others)
        count = min(count, len(picked) + spare)
        start = bisect.bisect_right(ring, anchor) if anchor is not None else 0
        for spread, available in ((True, fresh), (False, spare)):
            if available <= 0:
                continue
            for i in range(len(ring)):
                if len(picked) >= count:
                    return picked
                name = ring[(start + i) % len(ring)]
                domain = nodes[name].domain
                if (
                    name in exclude
                    or name in blocked
                    or name in picked
                    or domain == anchor_domain
                    or (spread and domain in taken)
                ):
                    continue
                picked.append(name)
                taken.add(domain)
        return picked
