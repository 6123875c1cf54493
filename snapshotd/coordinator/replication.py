"""Re-replication: the sweep that issues tasks so that every rank's snapshot at G keeps ``1 + replicas`` copies.

The sweep is the coordinator's only pass over the ranks of every job. It starts at most once every
``SWEEP_PERIOD_S`` and runs in slices of ``SWEEP_SLICE_RANKS`` ranks, one per call of :meth:`Sweep.run` (each
expiry tick), so that no single pass holds up heartbeats and plan answers for long, however many ranks there are.
"""

from __future__ import annotations

import collections
import logging

from snapshotd.proto import ReplicateTask

from .config import CoordinatorConfig
from .jobs import Job, Jobs
from .membership import Membership
from .placement import Placement

__all__ = ["SWEEP_PERIOD_S", "SWEEP_SLICE_RANKS", "TASK_MEMORY_S", "Sweep"]

log = logging.getLogger(__name__)

TASK_MEMORY_S = 10.0
"""An issued re-replication task is not issued again (same snapshot, same target) for this long."""
SWEEP_PERIOD_S = 1.0
"""Seconds between the starts of two re-replication sweeps (or more, when one takes longer)."""
SWEEP_SLICE_RANKS = 4096
"""Ranks a sweep looks at per slice: few enough that a slice is short next to a heartbeat's round trip, enough
that a job of 80,000 ranks is swept in 20 slices (two seconds of expiry ticks)."""


class Sweep:
    """The re-replication sweep over every job, a slice at a time.

    Args:
        cfg: ``replicas`` and ``heartbeat_timeout`` are used here.
        jobs, membership, placement: what the sweep reads; tasks go to the target nodes' ``tasks``.
        now: the start time (the first sweep is due at once).
    """

    def __init__(
        self, cfg: CoordinatorConfig, jobs: Jobs, membership: Membership, placement: Placement, now: float
    ) -> None:
        self.cfg = cfg
        self._jobs = jobs
        self._membership = membership
        self._placement = placement
        self._issued: dict[tuple[str, int, int], dict[str, float]] = {}  # snapshot -> target -> when issued
        self._next = now
        # jobs the sweep in progress has yet to finish
        self._sweeping: collections.deque[str] = collections.deque()
        self._at = 0  # the next rank of the first of them

    def run(self, now: float) -> None:
        """One slice of the sweep in progress, or of a new one when one is due (which lists the jobs then known).

        A slice issues tasks so that every rank's snapshot at G has ``1 + replicas`` copies on live nodes that are
        not leaving (a leaving node's copy is a source only), for the next ``SWEEP_SLICE_RANKS`` ranks. Each slice reads its job's G of the moment. For ``heartbeat_timeout``
        after a job's G first shows up here, a deficit where the rank's live home holds the snapshot is left
        alone: that is the regular stream to the buddies, still in flight.
        """
        if not self._sweeping:
            if now < self._next:
                return
            self._next = now + SWEEP_PERIOD_S
            self._issued = {
                key: kept
                for key, targets in self._issued.items()
                if (kept := {t: at for t, at in targets.items() if now - at < TASK_MEMORY_S})
            }
            self._sweeping.extend(self._jobs)
            self._at = 0
        budget = SWEEP_SLICE_RANKS
        while self._sweeping and budget > 0:
            job = self._jobs.get(self._sweeping[0])
            g = job.publish().recoverable if job is not None else -1
            if job is not None and g >= 0 and self._at < job.world_size:
                end = min(job.world_size, self._at + budget)
                self._sweep_ranks(job, g, range(self._at, end), now)
                budget -= end - self._at
                self._at = end
                if end < job.world_size:
                    continue
            self._sweeping.popleft()  # gone, nothing recoverable yet, or done
            self._at = 0

    def _sweep_ranks(self, job: Job, g: int, ranks: range, now: float) -> None:
        """The sweep (see :meth:`run`) of ``ranks`` of ``job``, whose G is ``g``."""
        if job.swept_g[0] != g:
            job.swept_g = (g, now)
        settling = now - job.swept_g[1] < self.cfg.heartbeat_timeout
        want = 1 + self.cfg.replicas
        holders_of, homes, nodes = job.holders, job.homes, self._membership.nodes
        for r in ranks:
            holders = holders_of[r][g]
            staying = sum(not nodes[h].leaving for h in holders)  # a leaving holder is a source, not a copy
            home = homes.get(r)
            if staying >= want or (settling and home in holders and not nodes[home].leaving):
                continue
            key = (job.name, r, g)
            pending = {
                t
                for t in self._issued.get(key, ())
                if t not in holders and nodes[t].alive and not nodes[t].leaving
            }
            count = want - staying - len(pending)
            if count <= 0:
                continue
            paths = self._membership.paths
            for target in self._placement.targets(
                job, r, holders.keys() | pending, count, sources=holders.keys()
            ):
                # the holders it reaches; all of them where it reaches none (see .paths)
                reached = [n for n in holders if not paths.broken(target, n)] or list(holders)
                sources = tuple(sorted(nodes[n].data_addr for n in reached))
                nodes[target].tasks.append(ReplicateTask(job=job.name, rank=r, step=g, sources=sources))
                self._issued.setdefault(key, {})[target] = now
                log.info(
                    "job %s rank %d step %d has %d of %d copies: replicating to %s",
                    job.name,
                    r,
                    g,
                    staying,
                    want,
                    target,
                )
