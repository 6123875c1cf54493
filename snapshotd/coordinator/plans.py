"""Plan rounds: the answers to plan requests (see DESIGN "Recovery").

Pure logic with no clock and no sockets, used by :class:`~.state.CoordinatorState`. A plan request covers every
restoring rank of its node and costs O(its ranks). Its answer can be drafted while the round is still open
(:meth:`Plans.draft`), so that once the round is decided, answering a held request costs a check and a set
update (:meth:`Plans.confirm`) instead of building the answer while every other rank waits for its own.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable

from snapshotd.proto import PlanReply, PlanRequest, RankPlan, RankPlanFields

from .jobs import Job, Jobs, check_rank
from .membership import Membership
from .rounds import MAX_LISTED, Round

__all__ = ["PlanAnswer", "Plans", "check_ranks", "listed"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class PlanAnswer:
    """The answer to one plan request: ``wait`` while its round is undecided, else every rank's plan.

    ``plans``: the plan of each rank of the request, in its order, as a :class:`~snapshotd.proto.RankPlan`'s
    fields, which the server packs without building records (see :mod:`.replies`). Empty while the request
    waits: ``reason`` then says why, and ``rank`` is the request's first rank.
    """

    job: str
    rank: int
    reason: str = ""
    plans: tuple[RankPlanFields, ...] = ()

    @property
    def waiting(self) -> bool:
        return not self.plans

    def reply(self) -> PlanReply:
        """The :class:`~snapshotd.proto.PlanReply` this answer is sent as."""
        if not self.plans:
            return PlanReply(job=self.job, rank=self.rank, status="wait", reason=self.reason)
        return PlanReply.of(self.job, [RankPlan(*fields) for fields in self.plans])


class Plans:
    """The plan rounds of every job, and the answers to plan requests.

    Args:
        jobs: the jobs (a round lives in its job).
        membership: the nodes whose data addresses answers name as sources, and the death timeout that the
            rebuild window after the start lasts.
        started: the coordinator's start time.
    """

    def __init__(self, jobs: Jobs, membership: Membership, started: float) -> None:
        self._jobs = jobs
        self._membership = membership
        self._started = started
        self._rebuilt = False  # the rebuild window after the start is over (it never opens again)

    def rebuilding(self, now: float) -> bool:
        """Whether the rebuild window after the start is still open (see :meth:`plan`); once over, never again."""
        if not self._rebuilt and now - self._started >= self._membership.death_timeout(now):
            self._rebuilt = True
        return not self._rebuilt

    def plan(self, msg: PlanRequest, now: float, *, held: bool = False) -> PlanAnswer:
        """Answer a plan request for all its ranks (see DESIGN "Recovery" and :class:`Round` for the rules).

        For the rebuild window after the start (the death timeout, see :meth:`Membership.death_timeout`) every
        request waits and is not recorded: inventories are still coming back from the sidecars. A ``ready``
        answer names, per rank, the live nodes holding ``(job, rank, step)`` other than the asking one as
        sources, and sets ``local`` when the asking node holds it; a rank with none of them left gets ``none``.

        Args:
            held: the request waited before and was held unanswered since (long-polling), so it is asked again
                now: if its ranks were answered meanwhile (by a duplicate of the request) they get the same
                round's answer instead of opening a new round, as a rank asking after its answer would.

        Raises:
            ValueError: a rank is outside ``world_size`` or listed twice (nothing is recorded).
        """
        ranks = msg.all_ranks
        check_ranks(msg.job, ranks, msg.world_size)
        job = self._jobs.job(msg.job)
        if job.world_size != msg.world_size:
            self._jobs.resize(job, msg.world_size)
        if self.rebuilding(now):
            return _wait(
                msg,
                f"the coordinator started {now - self._started:.1f} s ago; waiting "
                f"{self._membership.death_timeout(now):g} s for sidecars to report their snapshots",
            )
        rnd = job.round
        if rnd is None or (not held and not rnd.continues(ranks, msg.attempt)):
            if rnd is not None:
                log.info(
                    "job %s: rank(s) %s asked again after their answer: new plan round",
                    job.name,
                    listed(sorted(rnd.answered.intersection(ranks))),
                )
            rnd = job.round = Round(opened=now)
            job.watermark = None
        if not rnd.frozen and now - rnd.opened < self._membership.death_timeout(now):
            moved = self._moved_from_live_node(job, ranks, msg.node)
            if moved is not None:
                self._membership.suspect(
                    moved[1], f"(rank {moved[0]} of job {job.name} asks from node {msg.node})", now
                )
                return _wait(
                    msg,
                    f"rank {moved[0]} asks from node {msg.node} while node {moved[1]}, which holds the "
                    "rank's own copies, has not been declared dead; waiting for it to be declared dead (it is "
                    "probed now), at most the death timeout",
                )
        rnd.asked.update(ranks)
        if not rnd.frozen:
            if len(rnd.asked) < job.world_size:
                return _wait(msg, rnd.wait_reason(job.world_size))
            g = job.publish().recoverable
            rnd.frozen, rnd.frozen_at = True, now
            if not job.seen_inventory:
                rnd.outcome, rnd.step, rnd.reason = (
                    "fresh",
                    0,
                    f"job {job.name} has no snapshot yet: start at 0",
                )
            elif g < 0:
                rnd.outcome, rnd.reason = "none", _why_none(job)
            else:
                rnd.outcome, rnd.step = "ready", g
                job.fork(g)
            log.info("job %s: every rank asked; plan %s at step %d", job.name, rnd.outcome, rnd.step)
            job.watermark = None  # the durable cap starts now
        self._answered(job, rnd, msg, now)
        return self._answer(job, rnd.outcome, rnd.step, rnd.reason, msg)

    def _moved_from_live_node(self, job: Job, ranks: tuple[int, ...], node: str) -> tuple[int, str] | None:
        """A rank of ``ranks`` and a live node other than ``node`` holding that rank's own (local) copies, if any.

        Such a rank restarts on a new node while its old node still counts as alive and last reported the rank's
        process running: most likely the old node just died (a replacement that started within the death
        timeout, as a warm spare does). Its copies there still count for G, so a round frozen now could name a
        step that only the dead node held; the request waits (unrecorded, so the round cannot freeze) until the
        node is declared dead, at most the death timeout from the round's first request (after which a live old
        node is taken at its word); the old node is probed meanwhile (see :mod:`.probes`). A live old node whose report shows the rank's process gone (ranks moved
        between nodes at a launcher's restart) holds nothing up."""
        nodes = self._membership.nodes
        for rank in ranks:
            for holders in job.holders.get(rank, {}).values():
                for holder, local in holders.items():
                    if not local or holder == node or (n := nodes.get(holder)) is None or not n.alive:
                        continue
                    info = n.ranks.get((job.name, rank))
                    # its last report still has the rank's process running
                    if info is not None and info.alive:
                        return rank, holder
        return None

    def draft(self, msg: PlanRequest) -> tuple[object, PlanAnswer] | None:
        """The answer a request that waits (and is held) gets if its round freezes with nothing changed.

        That is ``ready`` at the job's G of now, as :meth:`plan` would answer it, with a token naming everything
        that answer depends on (the round, the world size, the job's holders, the membership, the step). Drafting
        costs what answering does, but while the ranks arrive rather than all at once when the last one asks:
        :meth:`confirm` then answers a held request in O(its ranks). None when no ``ready`` answer is in sight
        (no G yet, a frozen round, the rebuild window).
        """
        job = self._jobs.get(msg.job)
        rnd = job.round if job is not None else None
        if job is None or rnd is None or rnd.frozen or not self._rebuilt or job.world_size != msg.world_size:
            return None
        g = job.publish().recoverable
        if g < 0 or not job.seen_inventory:
            return None
        return self._token(job, rnd, g), self._answer(job, "ready", g, "", msg)

    def confirm(self, msg: PlanRequest, token: object, now: float) -> bool:
        """Whether ``plan(msg, now, held=True)`` answers what the :meth:`draft` made under ``token`` holds: if so,
        ``msg``'s ranks are recorded as answered at ``now``; if not (the draft is stale), nothing is recorded."""
        job = self._jobs.get(msg.job)
        rnd = job.round if job is not None else None
        if job is None or rnd is None or not rnd.frozen or rnd.outcome != "ready":
            return False
        if self._token(job, rnd, rnd.step) != token:
            return False
        self._answered(job, rnd, msg, now)
        return True

    def _sources(self, holders: tuple[str, ...], asking: str) -> tuple[str, ...]:
        """The data addresses of ``holders`` but ``asking``, in address order; those across a broken path from
        ``asking`` (:mod:`.paths`) only where no other holder is left, so that a restore under a partition pulls
        from a holder it reaches."""
        nodes, paths = self._membership.nodes, self._membership.paths
        others = [n for n in holders if n != asking]
        reached = [n for n in others if not paths.broken(asking, n)]
        return tuple(sorted(nodes[n].data_addr for n in (reached or others)))

    def _token(self, job: Job, rnd: Round, step: int) -> tuple[object, ...]:
        return (rnd, job.world_size, job.version, self._membership.epoch, step)

    @staticmethod
    def _answered(job: Job, rnd: Round, msg: PlanRequest, now: float) -> None:
        ranks = msg.all_ranks
        rnd.answered.update(ranks)
        for r in ranks:
            if msg.attempt:
                rnd.attempts[r] = msg.attempt
            else:
                rnd.attempts.pop(r, None)
        if len(rnd.answered) == job.world_size:
            if rnd.answered_at is None:
                rnd.answered_at = now
                job.rounds.add(now - rnd.frozen_at)
            job.watermark = None  # the durable cap may end now

    def _answer(self, job: Job, outcome: str, step: int, reason: str, msg: PlanRequest) -> PlanAnswer:
        """The plan of ``outcome`` at ``step`` for every rank of ``msg``, in its order (see :meth:`plan`)."""
        if outcome != "ready":
            return PlanAnswer(
                msg.job, msg.rank, plans=tuple((r, outcome, step, False, (), reason) for r in msg.all_ranks)
            )
        holders_of, asking = job.holders, msg.node
        plans: list[RankPlanFields] = []
        sources_of: dict[tuple[str, ...], tuple[str, ...]] = {}  # a node's ranks mostly share their holders
        for r in msg.all_ranks:
            by_step = holders_of.get(r)
            holders = by_step.get(step) if by_step is not None else None
            if holders:
                local = asking in holders
                key = tuple(holders)
                sources = sources_of.get(key)
                if sources is None:
                    sources = sources_of[key] = self._sources(key, asking)
                if local or sources:
                    plans.append((r, "ready", step, local, sources, ""))
                    continue
            plans.append(
                (
                    r,
                    "none",
                    -1,
                    False,
                    (),
                    f"rank {r}: every node holding step {step} died after the plan "
                    "was made; restore from your last disk checkpoint",
                )
            )
        return PlanAnswer(msg.job, msg.rank, plans=tuple(plans))


def _wait(msg: PlanRequest, reason: str) -> PlanAnswer:
    return PlanAnswer(msg.job, msg.rank, reason=reason)


def _why_none(job: Job) -> str:
    """Which ranks stand in the way of a common complete step, for a ``none`` plan."""
    lacking = [r for r in range(job.world_size) if r not in job.holders]
    if lacking:
        named = listed(lacking)
        verb = "has" if len(lacking) == 1 else "have"
        what = f"rank{'s' if len(lacking) > 1 else ''} {named} {verb} no complete snapshot on a live node"
    else:
        ranks = sorted(r for r in job.holders if r < job.world_size)
        what = "no step is complete for every rank on live nodes: " + "; ".join(
            f"rank {r} holds step{'s' if len(job.holders[r]) > 1 else ''} {_steps(job.holders[r])}"
            for r in ranks[:MAX_LISTED]
        )
        if len(ranks) > MAX_LISTED:
            what += f"; {len(ranks) - MAX_LISTED} more ranks"
    return f"job {job.name}: {what}; restore from your last disk checkpoint"


def _steps(steps: Iterable[int], most: int = 6) -> str:
    """The newest ``most`` of ``steps``, comma-separated, oldest first."""
    newest = sorted(steps)[-most:]
    return ", ".join(map(str, newest))


def check_ranks(job: str, ranks: tuple[int, ...], world_size: int) -> None:
    """Refuse the ranks of a plan request unless each is inside ``world_size`` and listed once.

    Raises:
        ValueError: naming the first rank outside, or the ranks listed twice.
    """
    if max(ranks) >= world_size:
        check_rank(job, max(ranks), world_size)
    if len(ranks) > 1 and len(set(ranks)) != len(ranks):
        twice = sorted(r for r, n in collections.Counter(ranks).items() if n > 1)
        raise ValueError(f"job {job}: rank(s) {listed(twice)} asked for twice in one plan request")


def listed(ranks: list[int]) -> str:
    """At most :data:`MAX_LISTED` rank numbers, comma-separated, and how many more."""
    named = ", ".join(map(str, ranks[:MAX_LISTED]))
    return named + (f" and {len(ranks) - MAX_LISTED} more" if len(ranks) > MAX_LISTED else "")
