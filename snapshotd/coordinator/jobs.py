"""Per job: the inventory index that G and D are read from, and the watermark published from it.

Data structures with no sockets, used by :class:`~.state.CoordinatorState`; the only clock read is the monotonic
one that stamps when G grew and D last moved (:meth:`Job.publish`).

Cost model: a heartbeat that changes its node's inventory costs O(snapshots added or removed), done in one loop
per job (:meth:`Job.add` / :meth:`Job.remove`) with no call per snapshot. A local copy (a rank's own slot) and a
copy on the rank's home node never count towards durability, so adding or removing one touches two counts and
nothing else; only a buddy copy on another node recounts the (two or three) holders of its snapshot. Each job
keeps, per step, how many of its ranks hold it (for G) and how many hold it durably (for D), so that G and D are a
max over the job's few distinct steps, computed when first asked for after a change (:meth:`Job.publish`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator

from snapshotd.proto import Watermark
from snapshotd.proto.limits import MAX_UNUSABLE_STEPS
from snapshotd.tally import Tally

from .rounds import Round

__all__ = ["Item", "Job", "Jobs", "check_rank"]

log = logging.getLogger(__name__)

Item = tuple[str, int, int, bool]
"""A snapshot a node holds: (job, rank, step, local)."""


@dataclasses.dataclass(slots=True, eq=False)
class Job:
    """A job's inventory index and the per-step counts that G and D are read from.

    ``covered[s]`` is the number of ranks ``r < world_size`` holding step ``s`` on some live node;
    ``durable[s]`` the number holding it as non-local copies on at least ``replicas`` live nodes other than
    their home; ``newest[s]`` the number whose newest step held on a live node is ``s``. All three are kept exact
    on every holder or home change. ``version`` counts the changes of
    ``holders`` and of the world size: while it stays the same, so does every plan answer read from them.

    ``stale = (lo, hi)``: the steps ``lo < s <= hi`` were held when a plan round froze at ``lo`` (see
    :meth:`fork`), so a copy of such a step may come from the run that failed rather than the one that resumed
    from ``lo``; they count for neither G nor D, and are unusable, until D reaches ``hi``. ``(-1, -1)``: none.
    """

    name: str
    replicas: int
    world_size: int = 0  # 0: not known yet (no rank or plan request reported it)
    seen_inventory: bool = False
    # r -> s -> {node: local}
    holders: dict[int, dict[int, dict[str, bool]]] = dataclasses.field(default_factory=dict)
    homes: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> live node reporting it
    last_home: dict[int, str] = dataclasses.field(default_factory=dict)  # survives the home's death
    covered: dict[int, int] = dataclasses.field(default_factory=dict)
    durable: dict[int, int] = dataclasses.field(default_factory=dict)
    newest: dict[int, int] = dataclasses.field(default_factory=dict)
    durable_pairs: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (rank, step) in durable
    watermark: Watermark | None = None  # what publish() returns until something changes; None: recompute
    published: Watermark | None = None  # the last one handed out
    round: Round | None = None  # the latest plan round (see plans.py)
    rounds: Tally = dataclasses.field(
        default_factory=Tally
    )  # rounds every rank was answered in: their seconds
    # (when, G) each time G was seen to grow
    g_seen: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=8)
    )
    # (D, when it was first published at that value): how long the durable watermark has stood still
    durable_seen: tuple[int, float] = (-1, 0.0)
    swept_g: tuple[int, float] = (-1, 0.0)  # (G, when the re-replication sweep first saw it)
    version: int = 0
    stale: tuple[int, int] = (-1, -1)

    def publish(self) -> Watermark:
        """The job's watermark as of now: G, D and the unusable steps (see DESIGN "Watermark").

        While a plan round is frozen at a step, D is capped at that step, so that buddies keep what the plan
        needs, until every rank has its answer and G has moved past the step (training resumed). A D at or past
        the stale steps ends them (see :meth:`fork`). Recomputed only after the index, the world size or the
        round changed; the same object while its values stay the same, so that replies holding it stay
        cacheable.
        """
        if self.watermark is not None:
            return self.watermark
        g, d = self._newest_complete()
        if self.round is not None and self.round.caps(g, self.world_size):
            d = min(d, self.round.step)
        hi = self.stale[1]
        if hi >= 0 and d >= hi:
            self.stale = (-1, -1)
        wm = Watermark(job=self.name, recoverable=g, durable=d, unusable=self.unusable(d, MAX_UNUSABLE_STEPS))
        if wm == self.published:
            wm = self.published
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("job %s: G %d, D %d, unusable %s", self.name, g, d, list(wm.unusable))
        self.watermark = self.published = wm
        if g >= 0 and (not self.g_seen or g > self.g_seen[-1][1]):
            self.g_seen.append((time.monotonic(), g))
        if d != self.durable_seen[0]:
            self.durable_seen = (d, time.monotonic())
        return wm

    def step_seconds(self) -> float | None:
        """The job's recent time per step, from how fast G grew over its last few changes (None: not known)."""
        if len(self.g_seen) < 2:
            return None
        (t0, g0), (t1, g1) = self.g_seen[0], self.g_seen[-1]
        return (t1 - t0) / (g1 - g0)

    def fork(self, step: int) -> None:
        """A plan round froze at ``step``: training resumes from it, so the copies of later steps held now (the
        failed run's: its local slots, its buddy copies, its streams still landing) must never be mixed with the
        resumed run's copies of the same steps, which carry the same ``(rank, step)`` names."""
        held = max(self.newest, default=-1)  # O(distinct steps), not O(ranks): this runs as the plan freezes
        lo, hi = self.stale
        if lo < step <= hi:  # an earlier fork's stale steps above ``step`` stay stale
            held = max(held, hi)
        self.stale = (step, held) if held > step else (-1, -1)
        self.watermark = None

    def _newest_complete(self) -> tuple[int, int]:
        """The newest step complete for every rank on live nodes, and the newest held as ``replicas`` buddy copies
        for every rank (-1: none), stale steps left out."""
        ws = self.world_size
        if not ws:
            return -1, -1
        lo, hi = self.stale
        g = max((s for s, n in self.covered.items() if n == ws and not lo < s <= hi), default=-1)
        d = max((s for s, n in self.durable.items() if n == ws and not lo < s <= hi), default=-1)
        return g, d

    def add(self, node: str, items: Iterable[Item]) -> None:
        """``node`` now holds these snapshots of this job (none of which it held before)."""
        holders, covered, homes, ws = self.holders, self.covered, self.homes, self.world_size
        for _, rank, step, local in items:
            by_step = holders.get(rank)
            if by_step is None:
                by_step = holders[rank] = {}
            h = by_step.get(step)
            if h is None:
                if rank < ws:
                    covered[step] = covered.get(step, 0) + 1
                    old = max(by_step, default=-1)
                    if step > old:
                        self._renew(old, step)
                h = by_step[step] = {}
            h[node] = local
            if not local and rank < ws and homes.get(rank) != node:
                self._recheck(rank, step, h)
        self.watermark = None
        self.version += 1

    def remove(self, node: str, items: Iterable[Item]) -> None:
        """``node`` no longer holds these snapshots of this job (all of which it held)."""
        holders, covered, homes, ws = self.holders, self.covered, self.homes, self.world_size
        for _, rank, step, _local in items:
            by_step = holders[rank]
            h = by_step[step]
            counted = not h.pop(node) and rank < ws and homes.get(rank) != node
            if not h:
                del by_step[step]
                if not by_step:
                    del holders[rank]
                if rank < ws:
                    left = covered[step] - 1
                    if left:
                        covered[step] = left
                    else:
                        del covered[step]
                    rest = max(by_step, default=-1)
                    if step > rest:
                        self._renew(step, rest)
            if counted:
                self._recheck(rank, step, h)
        self.watermark = None
        self.version += 1

    def set_home(self, rank: int, node: str | None) -> None:
        """``node`` (None: no live node) reports ``rank`` now."""
        if node is None:
            del self.homes[rank]
        else:
            self.homes[rank] = self.last_home[rank] = node
        for step, h in self.holders.get(rank, {}).items():
            self._recheck(rank, step, h)
        self.watermark = None

    def resize(self, world_size: int) -> None:
        """Latest report wins. A frozen plan round is abandoned; an open one forgets ranks now outside."""
        self.world_size = world_size
        if self.round is not None:
            self.round = self.round.resized(world_size)
        self.covered, self.durable, self.durable_pairs, self.newest = {}, {}, set(), {}
        for rank, by_step in self.holders.items():
            for step, h in by_step.items() if rank < world_size else ():
                self.covered[step] = self.covered.get(step, 0) + 1
                self._recheck(rank, step, h)
            if rank < world_size:
                self._renew(-1, max(by_step))
        self.watermark = None
        self.version += 1

    def unusable(self, durable: int, limit: int) -> tuple[int, ...]:
        """Steps above ``durable`` that some rank holds but no restore can use, at most ``limit``, oldest first.

        Such a step is stale (see :meth:`fork`), or missing for a rank that already holds a newer one: steps only
        grow, so that rank will never have it (it skipped the step, or its copy never reached a buddy). Costs
        O(distinct steps held).
        """
        ws = self.world_size
        if not ws:
            return ()
        lo, hi = self.stale
        behind = ws - sum(self.newest.values())  # ranks holding nothing have not reached any step yet
        newest = sorted(self.newest.items())
        i, out = 0, []
        for step in sorted(s for s, n in self.covered.items() if s > durable and (n < ws or lo < s <= hi)):
            while i < len(newest) and newest[i][0] < step:
                behind += newest[i][1]
                i += 1
            if lo < step <= hi or self.covered[step] + behind < ws:
                out.append(step)
                if len(out) == limit:
                    break
        return tuple(out)

    def _renew(self, old: int, new: int) -> None:
        """A rank's newest held step moved from ``old`` to ``new`` (-1: none)."""
        if old >= 0:
            left = self.newest[old] - 1
            if left:
                self.newest[old] = left
            else:
                del self.newest[old]
        if new >= 0:
            self.newest[new] = self.newest.get(new, 0) + 1

    def _recheck(self, rank: int, step: int, h: dict[str, bool]) -> None:
        """Count the durable copies of ``(rank, step)`` (held by ``h``) and move it in or out of ``durable``."""
        copies = 0
        if len(h) >= self.replicas and rank < self.world_size:
            home = self.homes.get(rank)
            for n, loc in h.items():
                if not loc and n != home:
                    copies += 1
        ok = copies >= self.replicas
        pair = (rank, step)
        if ok != (pair in self.durable_pairs):
            if ok:
                self.durable_pairs.add(pair)
                self.durable[step] = self.durable.get(step, 0) + 1
            else:
                self.durable_pairs.remove(pair)
                left = self.durable[step] - 1
                if left:
                    self.durable[step] = left
                else:
                    del self.durable[step]
        self.watermark = None


class Jobs:
    """Every job the coordinator knows of, by name.

    ``plan_changes`` names the jobs whose waiting plan requests may have an answer now for a reason other than
    another rank asking (their world size changed); whoever holds such requests takes the names and asks again.
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._jobs: dict[str, Job] = {}
        self.plan_changes: set[str] = set()

    def __getitem__(self, name: str) -> Job:
        return self._jobs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def job(self, name: str) -> Job:
        """The job named ``name``, added (knowing nothing yet) if new."""
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = Job(name, self.replicas)
        return job

    def forget(self, name: str) -> None:
        """Drop the job named ``name`` (no live node reports it; see ``CoordinatorConfig.forget_jobs_after``)."""
        self._jobs.pop(name, None)
        self.plan_changes.discard(name)

    def resize(self, job: Job, world_size: int) -> None:
        """``job`` has ``world_size`` ranks from now on (see :meth:`Job.resize`)."""
        log.info("job %s: world size %d -> %d", job.name, job.world_size, world_size)
        job.resize(world_size)
        self.plan_changes.add(job.name)


def check_rank(job: str, rank: int, world_size: int) -> None:
    """Refuse a rank outside its job's world size.

    Raises:
        ValueError: naming the rank, the job and the world size.
    """
    if rank >= world_size:
        raise ValueError(f"rank {rank} of job {job} is outside its world size {world_size}")
