"""Broken paths: pairs of live nodes that cannot move snapshots to each other, as their sidecars report them.

Heartbeats reach the coordinator over one path; snapshots go between nodes over others. A sidecar that cannot
stream to a peer, or whose streams to it stall, says so in every heartbeat
(:attr:`~snapshotd.proto.Heartbeat.unreachable`, see :mod:`snapshotd.sidecar.paths`), and again once the path
heals. :class:`BrokenPaths` keeps what each live node reports and the pairs it makes:

- A pair is broken while either node reports the other: a snapshot's path needs both directions (a stream's
  chunks go one way and its acknowledgements the other, and a restore pulls the other way), so a path broken one
  way counts as broken both ways.
- Placement puts no buddy across a broken pair while another node outside the rank's failure domain can take
  the copy (:meth:`~.placement.Placement.buddies`); where every candidate is across one, it keeps the one it
  would pick (a slow path still moves bytes) and the status shows the pair. A restore plan names no holder
  across one while another holder has the step (:mod:`.plans`). A re-replication goes to no node across one
  from every holder, and names only the holders its target reaches (:mod:`.replication`).
- A node's reports go with it when it dies, and a pair naming a dead node goes; a report naming an address no
  live node has pairs nothing until a node registers there. The pairs are made anew from the reports whenever a
  report or the live set changes.

Every change of the pairs bumps :attr:`~.membership.Membership.epoch`, so placement and drafted plans are made
anew. A warning names each pair when it breaks and when it heals.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from snapshotd.logs import fields
from snapshotd.proto import PathTrouble

__all__ = ["BrokenPaths"]

log = logging.getLogger(__name__)

Pair = frozenset[str]


class BrokenPaths:
    """The broken pairs of nodes (see the module docstring)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[PathTrouble, ...]] = {}  # live node -> what its last heartbeat said
        self._pairs: dict[Pair, dict[str, str]] = {}  # pair -> reporting node -> why

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def report(self, node: str, troubles: tuple[PathTrouble, ...], names: Mapping[str, str]) -> bool:
        """Live node ``node`` says its paths to ``troubles`` are broken (and every other path works); ``names`` maps
        the live nodes' data addresses to their names. Whether the set of broken pairs changed (a new reason for a
        pair already broken only shows in the status).

        Cost: O(1) when the report is the node's last one; else O(every node's reported troubles).
        """
        if self._reports.get(node, ()) == troubles:
            return False
        if troubles:
            self._reports[node] = troubles
        else:
            del self._reports[node]
        return self.rebuild(names)

    def drop(self, node: str, names: Mapping[str, str]) -> bool:
        """Forget what ``node`` reported (it died); whether the set of broken pairs changed."""
        self._reports.pop(node, None)
        return self.rebuild(names)

    def rebuild(self, names: Mapping[str, str]) -> bool:
        """Make the pairs anew from the reports, with ``names`` the live nodes' data addresses and names (the live
        set changed: a report may name a node that registered since, or one that died); whether the set of pairs
        changed. O(every node's reported troubles)."""
        pairs: dict[Pair, dict[str, str]] = {}
        for node, troubles in self._reports.items():
            for t in troubles:
                peer = names.get(t.addr)
                if peer is not None and peer != node:
                    pairs.setdefault(frozenset((node, peer)), {})[node] = t.reason
        before, self._pairs = self._pairs, pairs
        for pair in pairs.keys() - before.keys():
            reporter, why = next(iter(sorted(pairs[pair].items())))
            a, b = sorted(pair)
            log.warning(
                "the snapshot path between nodes %s and %s is broken (%s reports: %s): no copy goes between them "
                "while another node can take it",
                a,
                b,
                reporter,
                why,
                extra=fields(event="path_broken"),
            )
        gone = before.keys() - pairs.keys()
        live = set(names.values()) if gone else set()
        for pair in gone:
            if not pair <= live:  # a node of it died: that is logged as such
                continue
            a, b = sorted(pair)
            log.warning(
                "the snapshot path between nodes %s and %s healed", a, b, extra=fields(event="path_healed")
            )
        return pairs.keys() != before.keys()

    def broken(self, a: str, b: str) -> bool:
        """Whether the path between nodes ``a`` and ``b`` is broken."""
        return bool(self._pairs) and frozenset((a, b)) in self._pairs

    def pairs(self) -> list[dict[str, object]]:
        """The broken pairs, for the status document: ``nodes`` (sorted) and ``reported_by`` (node: why)."""
        return [
            {"nodes": sorted(pair), "reported_by": dict(sorted(reporters.items()))}
            for pair, reporters in sorted(self._pairs.items(), key=lambda item: sorted(item[0]))
        ]
