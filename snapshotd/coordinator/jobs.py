"""Per job: the inventory index that G and D are read from, and the plan round.

Pure data structures with no clock and no sockets, used by :class:`~.state.CoordinatorState`.

Cost model: a heartbeat that changes its node's inventory costs O(snapshots added or removed), done in one loop
per job (:meth:`Job.add` / :meth:`Job.remove`) with no call per snapshot. A local copy (a rank's own slot) and a
copy on the rank's home node never count towards durability, so adding or removing one touches two counts and
nothing else; only a buddy copy on another node recounts the (two or three) holders of its snapshot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from snapshotd.proto import Watermark

__all__ = ["MAX_LISTED", "Item", "Job", "PlanRow", "Round"]

Item = tuple[str, int, int, bool]  # (job, rank, step, local)
PlanRow = tuple[int, str, int, bool, tuple[str, ...], str]  # a RankPlan's fields: rank, status, step, local, sources, reason

MAX_LISTED = 8
"""Ranks named in one wait or none reason."""


@dataclasses.dataclass(slots=True, eq=False)
class Round:
    """One plan round of a job.

    Ranks ask until every rank ``0 .. world_size - 1`` has asked; the last ask freezes the outcome (``fresh``,
    ``none`` or ``ready`` at ``step``) and every rank of the round gets that same answer. A rank that asks again
    after its answer restarted again and opens a new round. Once frozen, the round stays open (durable capped
    at ``step``, so buddies keep what the plan needs) until every rank was answered and G moved past ``step``:
    training resumed. Before the freeze there is no plan step yet and no cap is needed (D <= G always).
    """

    asked: set[int] = dataclasses.field(default_factory=set)
    answered: set[int] = dataclasses.field(default_factory=set)
    frozen: bool = False
    closed: bool = False
    outcome: str = ""
    step: int = -1
    reason: str = ""
    waiting_note: tuple[int, str] = (-1, "")  # (len(asked), wait reason), so a poll costs O(1)
    frozen_at: float = 0.0  # when the last rank asked (the coordinator's clock); set once frozen
    answered_at: float | None = None  # when the last rank was answered

    def status(self, now: float) -> dict:
        """The round for the status document: outcome and step (once frozen), ranks asked and answered,
        ``age_s`` since it froze and ``answer_s``, from the freeze to the last rank's answer (None until then)."""
        return {
            "outcome": self.outcome or "asking", "step": self.step, "asked": len(self.asked),
            "answered": len(self.answered), "age_s": round(now - self.frozen_at, 3) if self.frozen else None,
            "answer_s": None if self.answered_at is None else round(self.answered_at - self.frozen_at, 6),
        }  # fmt: skip

    def wait_reason(self, world_size: int) -> str:
        if self.waiting_note[0] != len(self.asked):
            missing = world_size - len(self.asked)
            if missing <= MAX_LISTED:
                who = "rank(s) " + ", ".join(str(r) for r in range(world_size) if r not in self.asked)
            else:
                who = f"{missing} more ranks"
            text = f"{len(self.asked)} of {world_size} ranks accounted for; waiting for {who}"
            self.waiting_note = (len(self.asked), text)
        return self.waiting_note[1]


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
    holders: dict[int, dict[int, dict[str, bool]]] = dataclasses.field(default_factory=dict)  # r -> s -> {node: local}
    homes: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> live node reporting it
    last_home: dict[int, str] = dataclasses.field(default_factory=dict)  # survives the home's death
    covered: dict[int, int] = dataclasses.field(default_factory=dict)
    durable: dict[int, int] = dataclasses.field(default_factory=dict)
    newest: dict[int, int] = dataclasses.field(default_factory=dict)
    durable_pairs: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (rank, step) in durable
    watermark: Watermark | None = None  # cache; None when stale
    published: Watermark | None = None  # the last one handed out
    round: Round | None = None
    swept_g: tuple[int, float] = (-1, 0.0)  # (G, when the sweep first saw it)
    version: int = 0
    stale: tuple[int, int] = (-1, -1)

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

    def watermarks(self, cap: int | None) -> tuple[int, int]:
        """G and D: the newest step complete for every rank on live nodes, and the newest held as ``replicas``
        buddy copies for every rank (-1: none), stale steps left out; D at most ``cap``. A D at or past the
        stale steps ends them."""
        ws = self.world_size
        if not ws:
            return -1, -1
        lo, hi = self.stale
        g = max((s for s, n in self.covered.items() if n == ws and not lo < s <= hi), default=-1)
        d = max((s for s, n in self.durable.items() if n == ws and not lo < s <= hi), default=-1)
        if cap is not None:
            d = min(d, cap)
        if hi >= 0 and d >= hi:
            self.stale = (-1, -1)
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
        if node is None:
            del self.homes[rank]
        else:
            self.homes[rank] = self.last_home[rank] = node
        for step, h in self.holders.get(rank, {}).items():
            self._recheck(rank, step, h)
        self.watermark = None

    def resize(self, world_size: int) -> None:
        self.world_size = world_size
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
