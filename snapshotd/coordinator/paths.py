"""Broken paths: pairs of live nodes that cannot move snapshots to each other, as their sidecars report them.

Heartbeats reach the coordinator over one path; snapshots go between nodes over others. A sidecar that cannot
stream to a peer, or whose streams to it stall, says so in every heartbeat
(:attr:`~snapshotd.proto.Heartbeat.unreachable`, see :mod:`snapshotd.sidecar.paths`), and again once the path
heals. :class:`BrokenPaths` keeps what each live node reports and the pairs it makes:

- A pair is broken while either node reports the other: a snapshot's path needs both directions (a stream's
  chunks go one way and its acknowledgements the other, and a restore pulls the other way), so a path broken one
  way counts as broken both ways.
- Placement puts no buddy across a broken pair while another node outside the rank's failure domain can take
  the copy (:meth:`~.placement.Placement.buddies`), and a restore plan names no holder across one while another
  holder has the step (:mod:`.plans`), nor a re-replication a source across one from its target
  (:mod:`.replication`). Where every candidate is across a broken pair, placement keeps the one it
  would pick (a slow path still moves bytes) and the status shows the pair.
- A node's reports go with it when it dies; a report naming an address no live node has is kept but pairs
  nothing.

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
        self._reports: dict[str, tuple[PathTrouble, ...]] = {}  # node -> what its last heartbeat said
        self._pairs: dict[Pair, dict[str, str]] = {}  # pair -> reporting node -> why

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def report(self, node: str, troubles: tuple[PathTrouble, ...], names: Mapping[str, str]) -> bool:
        """Node ``node`` says its paths to ``troubles`` are broken (and every other path works); ``names`` maps the
        live nodes' data addresses to their names. Whether the broken pairs changed.

        Cost: O(1) when the report is the node's last one; else O(the pairs it names).
        """
        if self._reports.get(node, ()) == troubles:
            return False
        self._reports[node] = troubles
        if not troubles:
            del self._reports[node]
        now = {names[t.addr]: t.reason for t in troubles if t.addr in names and names[t.addr] != node}
        changed = False
        for pair, reporters in list(self._pairs.items()):
            if node in reporters and (pair - {node}).isdisjoint(now):
                del reporters[node]
                changed = True
                if not reporters:
                    del self._pairs[pair]
                    self._healed(pair)
        for peer, why in now.items():
            pair = frozenset((node, peer))
            reporters = self._pairs.setdefault(pair, {})
            if reporters.get(node) != why:
                first = not reporters
                reporters[node] = why
                changed = True
                if first:
                    log.warning(
                        "the snapshot path between nodes %s and %s is broken (%s reports: %s): no copy goes "
                        "between them while another node can take it",
                        node,
                        peer,
                        node,
                        why,
                        extra=fields(event="path_broken"),
                    )
        return changed

    def drop(self, node: str) -> bool:
        """Forget what ``node`` reported (it died); whether the broken pairs changed."""
        return self.report(node, (), {})

    def broken(self, a: str, b: str) -> bool:
        """Whether the path between nodes ``a`` and ``b`` is broken."""
        return bool(self._pairs) and frozenset((a, b)) in self._pairs

    def pairs(self) -> list[dict[str, object]]:
        """The broken pairs, for the status document: ``nodes`` (sorted) and ``reported_by`` (node: why)."""
        return [
            {"nodes": sorted(pair), "reported_by": dict(sorted(reporters.items()))}
            for pair, reporters in sorted(self._pairs.items(), key=lambda item: sorted(item[0]))
        ]

    def _healed(self, pair: Pair) -> None:
        a, b = sorted(pair)
        log.warning(
            "the snapshot path between nodes %s and %s healed", a, b, extra=fields(event="path_healed")
        )
