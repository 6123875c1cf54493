"""The coordinator's soft state: membership, placement, watermarks, recovery plans, re-replication.

Pure logic: no sockets, no asyncio, no clock. Every entry point takes ``now`` (seconds, monotonic) so that tests
drive time by hand. Everything here is rebuilt from the sidecars' reports after a restart: a heartbeat from a
node this process does not know gets ``known=False`` and the sidecar registers and reports everything again.

Cost model: a heartbeat costs O(ranks and inventory of that node). The inventory of all live nodes is kept in
one index (:class:`~.jobs.Job`), ``job -> rank -> step -> {node: local}``; each job keeps, per step, how many of
its ranks hold that step (for G) and how many hold it durably (for D), updated in O(1) per (rank, step) a report
adds or removes; G and D are then a max over a job's few distinct steps, cached until the next change. A report
of the same ranks as last time moves nothing. Placement is cached per node until membership changes. The
re-replication sweep, the only O(ranks of all jobs) pass, starts at most once per second and runs in slices of
``SWEEP_SLICE_RANKS`` ranks, one per call of :meth:`CoordinatorState.expire`. A plan request covers every
restoring rank of its node and costs O(its ranks); its answer can be drafted while the round is still open
(:meth:`CoordinatorState.draft`), so that once the round is decided a held request costs a check and a set
update. The rate of heartbeats is bounded instead of the fleet: beyond ``target_heartbeats_per_s`` the interval
handed out grows with the fleet (:meth:`heartbeat_interval`), so that 10,000 sidecars send 4,000 heartbeats a
second, not 20,000.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import operator
from collections.abc import Iterable, Iterator

import msgpack

from snapshotd.proto import (
    Assignment,
    Heartbeat,
    HeartbeatReply,
    MemberQuery,
    MemberReply,
    PlanReply,
    PlanRequest,
    RankInfo,
    RankPlan,
    RegisterSidecar,
    ReplicateTask,
    SidecarRegistered,
    Watermark,
)
from snapshotd.proto.limits import MAX_UNUSABLE_STEPS
from snapshotd.security import data_host

from .config import CoordinatorConfig
from .jobs import MAX_LISTED, Item, Job, PlanRow, Round

__all__ = ["CoordinatorState"]

log = logging.getLogger(__name__)

TASK_MEMORY_S = 10.0
"""An issued re-replication task is not issued again (same snapshot, same target) for this long."""
SWEEP_PERIOD_S = 1.0
"""Seconds between the starts of two re-replication sweeps (or more, when one takes longer)."""
SWEEP_SLICE_RANKS = 4096
"""Ranks a re-replication sweep looks at per call of :meth:`CoordinatorState.expire` (1.3-1.4 ms on a 2-core
machine): a job of 80,000 ranks is swept in 20 slices, one per expiry tick, so that the sweep never holds up
heartbeats and plan answers for long (in one pass it stalled the loop for 43-59 ms every second at 10,000
sidecars)."""
_RATE_WINDOW_S = 1.0
STATUS_PART_ENTRIES = 256
"""Node or rank entries per part of a status document (see :meth:`CoordinatorState.status_parts`): about a
millisecond of packing."""

_ITEM = operator.attrgetter("job", "rank", "step", "local")
_SNAPSHOT = operator.attrgetter("job", "rank", "step")
_JOB = operator.itemgetter(0)


@dataclasses.dataclass(slots=True, eq=False)
class _Node:
    name: str
    rack: str  # as registered; "" means the node is its own failure domain
    data_addr: str
    incarnation: str
    last_seen: float
    alive: bool = True
    told: float = 0.0  # the heartbeat interval it was last given
    ranks: dict[tuple[str, int], RankInfo] = dataclasses.field(default_factory=dict)
    inventory: frozenset[Item] = frozenset()
    jobs: tuple[str, ...] = ()  # jobs it hosts ranks of or holds inventory for, sorted
    homed: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # ranks whose home it is
    tasks: list[ReplicateTask] = dataclasses.field(default_factory=list)
    assignments: tuple[Assignment, ...] | None = None  # cache, valid while assign_epoch == membership epoch
    assign_epoch: int = -1
    stored_bytes: int = 0
    rate_ref: tuple[float, int, int] | None = None  # (time, bytes_out, bytes_in) the rates are measured from
    out_bps: float = 0.0
    in_bps: float = 0.0

    @property
    def host(self) -> str:
        """The IPv4 host of its data address, what a ``members`` mode sidecar admits connections from ("": none)."""
        return data_host(self.data_addr)

    @property
    def domain(self) -> tuple[str, str]:
        """The failure domain: the rack, or the node alone when it has no rack label."""
        return ("rack", self.rack) if self.rack else ("node", self.name)


class CoordinatorState:
    """Everything the coordinator knows, and the answers to every control-plane request.

    Args:
        cfg: replicas, heartbeat interval and timeout are used here.
        now: the start time; plan requests wait for ``heartbeat_timeout`` after it (the rebuild window).

    ``bad_messages`` and ``heartbeats`` are counters shown by :meth:`status`; the server increments the first.
    ``plan_changes`` names the jobs whose waiting plan requests may have an answer now for a reason other than
    another rank asking (their world size changed); whoever holds such requests takes the names and asks again.
    """

    def __init__(self, cfg: CoordinatorConfig, now: float) -> None:
        self.cfg = cfg
        self.started = now
        self.bad_messages = 0
        self.heartbeats = 0
        self._nodes: dict[str, _Node] = {}
        self._live: collections.OrderedDict[str, None] = collections.OrderedDict()  # least recently seen first
        self._ring: list[str] = []  # live node names, sorted
        self._domains: collections.Counter[tuple[str, str]] = collections.Counter()  # live nodes per failure domain
        self._hosts: dict[str, dict[str, None]] = {}  # data-address host -> live node names there
        self._epoch = 0  # bumped on every membership change
        self._placement: dict[str, tuple[str, ...]] = {}  # node -> buddy node names, for this epoch
        self._warned_short = False
        self._jobs: dict[str, Job] = {}
        self._issued: dict[tuple[str, int, int], dict[str, float]] = {}
        self._next_sweep = now
        self._sweeping: collections.deque[str] = collections.deque()  # jobs the sweep in progress has yet to finish
        self._sweep_at = 0  # the next rank of the first of them
        self._held = (1.0, now)  # (stretch factor the death timeout uses, until when at least)
        self._rebuilt = False  # the rebuild window after the start is over (it never opens again)
        self.plan_changes: set[str] = set()

    # ------------------------------------------------------------------------------------------ membership

    def register(self, msg: RegisterSidecar, now: float) -> SidecarRegistered:
        """A sidecar joins. A new incarnation of a known node name drops that node's old ranks and inventory.

        The same incarnation registering again (a lost reply, or a node declared dead that came back) keeps
        what the coordinator still has of it; a dead node's inventory was already dropped at expiry, and the
        sidecar reports everything in the heartbeat that follows its registration.
        """
        node = self._nodes.get(msg.node)
        if node is None:
            node = self._nodes[msg.node] = _Node(msg.node, msg.rack, msg.data_addr, msg.incarnation, now)
            log.info("node %s joined (rack %s, data %s)", msg.node, msg.rack or "-", msg.data_addr)
            self._add_live(node)
        else:
            if node.incarnation != msg.incarnation:
                log.info("node %s restarted (incarnation %s -> %s): its old ranks and snapshots are gone",
                         msg.node, node.incarnation, msg.incarnation)  # fmt: skip
                self._drop_data(node)
                node.incarnation, node.rate_ref = msg.incarnation, None
            if not node.alive:
                log.info("node %s is back", msg.node)
                node.ranks, node.alive, node.last_seen = {}, True, now
                self._add_live(node)
            if (node.rack, node.data_addr) != (msg.rack, msg.data_addr):
                self._remove_live(node)
                node.rack, node.data_addr = msg.rack, msg.data_addr
                self._add_live(node)
        self._seen(node, now)
        node.told = self.heartbeat_interval()
        return SidecarRegistered(heartbeat_interval=node.told)

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

    def expire(self, now: float) -> None:
        """Declare dead every node silent for :meth:`death_timeout`; run the re-replication sweep when due.

        A dead node stays listed in :meth:`status` (with the ranks it last reported) and counts nowhere else:
        its inventory leaves the index, its ranks lose their home, its pending tasks are dropped.
        """
        deadline = now - self.death_timeout(now)
        while self._live:
            node = self._nodes[next(iter(self._live))]
            if node.last_seen > deadline:
                break
            log.warning("node %s missed heartbeats for %.1f s: declared dead", node.name, now - node.last_seen)
            shown = node.ranks
            self._drop_data(node)
            self._remove_live(node)
            node.alive, node.ranks = False, shown
        if self._sweeping or now >= self._next_sweep:
            self._sweep(now)

    def _seen(self, node: _Node, now: float) -> None:
        node.last_seen = now
        self._live.move_to_end(node.name)

    def _add_live(self, node: _Node) -> None:
        self._live[node.name] = None
        bisect.insort(self._ring, node.name)
        self._domains[node.domain] += 1
        if node.host:
            self._hosts.setdefault(node.host, {})[node.name] = None
        self._membership_changed()

    def _remove_live(self, node: _Node) -> None:
        del self._live[node.name]
        del self._ring[bisect.bisect_left(self._ring, node.name)]
        self._domains[node.domain] -= 1
        on_host = self._hosts.get(node.host)
        if on_host is not None:
            del on_host[node.name]
            if not on_host:
                del self._hosts[node.host]
        self._membership_changed()

    def _membership_changed(self) -> None:
        self._epoch += 1
        self._placement.clear()

    def _drop_data(self, node: _Node) -> None:
        self._set_ranks(node, {})
        self._set_inventory(node, frozenset())
        node.jobs, node.tasks = (), []

    # ------------------------------------------------------------------------------------------ heartbeats

    def heartbeat(self, msg: Heartbeat, now: float) -> HeartbeatReply:
        """Record a heartbeat; answer with this node's assignments, its jobs' watermarks and its tasks.

        A heartbeat from an unknown node, a dead node or another incarnation gets ``known=False`` (register
        again). With ``changed`` the node's ranks and inventory are replaced wholesale; without, kept.

        Raises:
            ValueError: a reported rank is outside its world size (nothing is recorded).
        """
        self.heartbeats += 1
        node = self._nodes.get(msg.node)
        if node is None or not node.alive or node.incarnation != msg.incarnation:
            return HeartbeatReply(known=False)
        for info in msg.ranks:
            _check_rank(info.job, info.rank, info.world_size)
        self._seen(node, now)
        self._measure(node, msg, now)
        if msg.changed:
            ranks = {(info.job, info.rank): info for info in msg.ranks}
            if not self._settled(node, ranks):
                self._set_ranks(node, ranks)
            inventory = frozenset(map(_ITEM, msg.inventory))
            if len(inventory) != len(set(map(_SNAPSHOT, msg.inventory))):  # a buddy copy wins over a local one
                inventory = frozenset(it for it in inventory if not (it[3] and (*it[:3], False) in inventory))
            self._set_inventory(node, inventory)
            node.jobs = tuple(sorted({j for j, _ in node.ranks} | set(map(_JOB, inventory))))
        tasks, node.tasks = node.tasks, []
        interval = self.heartbeat_interval()
        tell = interval != self.cfg.heartbeat_interval or node.told != interval  # else 0: keep yours (omitted)
        node.told = interval
        return HeartbeatReply(
            known=True,
            assignments=self._assignments(node),
            watermarks=tuple(self._watermark(self._jobs[j]) for j in node.jobs),
            tasks=tuple(tasks),
            heartbeat_interval=interval if tell else 0.0,
        )

    def _measure(self, node: _Node, msg: Heartbeat, now: float) -> None:
        node.stored_bytes = msg.stored_bytes
        ref = node.rate_ref
        if ref is None or msg.bytes_out < ref[1] or msg.bytes_in < ref[2]:  # first sample, or counters reset
            node.rate_ref, node.out_bps, node.in_bps = (now, msg.bytes_out, msg.bytes_in), 0.0, 0.0
        elif now - ref[0] >= _RATE_WINDOW_S:
            node.out_bps = (msg.bytes_out - ref[1]) / (now - ref[0])
            node.in_bps = (msg.bytes_in - ref[2]) / (now - ref[0])
            node.rate_ref = (now, msg.bytes_out, msg.bytes_in)

    def _job(self, name: str) -> Job:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = Job(name, self.cfg.replicas)
        return job

    def _set_ranks(self, node: _Node, ranks: dict[tuple[str, int], RankInfo]) -> None:
        """Replace the ranks a node reports; move homes accordingly.

        "Latest report wins" for a rank's home, with one refinement: a report of a dead process does not take
        the home away from another live node that reports the same rank alive (the restarted replacement).
        """
        old = node.ranks
        for key, info in ranks.items():
            job = self._job(info.job)
            if job.world_size != info.world_size:
                self._set_world_size(job, info.world_size)
            prev = old.get(key)
            if not info.alive and (prev is None or prev.alive or prev.pid != info.pid):
                log.warning("rank %d of job %s on node %s died (pid %d)", info.rank, info.job, node.name, info.pid)
            home = job.homes.get(info.rank)
            if home != node.name and (info.alive or home is None or not self._reports_alive(home, key)):
                self._set_home(job, info.rank, node)
        for job_name, rank in old.keys() - ranks.keys():
            job = self._jobs[job_name]
            if job.homes.get(rank) == node.name:
                job.set_home(rank, None)
                node.homed.discard((job_name, rank))
                node.assignments = None
        node.ranks = ranks

    def _settled(self, node: _Node, ranks: dict[tuple[str, int], RankInfo]) -> bool:
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

    def _set_home(self, job: Job, rank: int, node: _Node) -> None:
        previous = job.homes.get(rank)
        if previous is not None:
            prev_node = self._nodes[previous]
            prev_node.homed.discard((job.name, rank))
            prev_node.assignments = None
        job.set_home(rank, node.name)
        node.homed.add((job.name, rank))
        node.assignments = None

    def _set_inventory(self, node: _Node, inventory: frozenset[Item]) -> None:
        old = node.inventory
        if old == inventory:
            return
        for name, items in _by_job(old - inventory):
            self._jobs[name].remove(node.name, items)
        for name, items in _by_job(inventory - old):
            job = self._job(name)
            job.seen_inventory = True
            job.add(node.name, items)
        node.inventory = inventory

    def _set_world_size(self, job: Job, world_size: int) -> None:
        """Latest report wins. A frozen plan round is abandoned; an open one forgets ranks now outside."""
        log.info("job %s: world size %d -> %d", job.name, job.world_size, world_size)
        job.resize(world_size)
        self.plan_changes.add(job.name)
        if job.round is not None:
            if job.round.frozen:
                job.round = None
            else:
                job.round.asked = {r for r in job.round.asked if r < world_size}

    # ------------------------------------------------------------------------------------ placement

    def _buddies(self, name: str) -> tuple[str, ...]:
        """The first ``replicas`` live nodes after ``name`` in ring order whose failure domain differs."""
        cached = self._placement.get(name)
        if cached is not None:
            return cached
        domain = self._nodes[name].domain
        want = min(self.cfg.replicas, len(self._ring) - self._domains[domain])
        if want < self.cfg.replicas and not self._warned_short:
            self._warned_short = True
            log.warning("only %d live node(s) outside %s's rack for %d replica(s): placing fewer buddies "
                        "(warned once)", want, name, self.cfg.replicas)  # fmt: skip
        out: list[str] = []
        start = bisect.bisect_right(self._ring, name)
        for i in range(len(self._ring)):
            if len(out) >= want:
                break
            cand = self._ring[(start + i) % len(self._ring)]
            if self._nodes[cand].domain != domain:
                out.append(cand)
        result = self._placement[name] = tuple(out)
        return result

    def _assignments(self, node: _Node) -> tuple[Assignment, ...]:
        if node.assignments is None or node.assign_epoch != self._epoch:
            addrs = tuple(self._nodes[b].data_addr for b in self._buddies(node.name))
            node.assignments = tuple(Assignment(job=j, rank=r, buddies=addrs) for j, r in sorted(node.homed))
            node.assign_epoch = self._epoch
        return node.assignments

    # ------------------------------------------------------------------------------------ watermarks

    def _watermark(self, job: Job) -> Watermark:
        """G and D of a job (see DESIGN "Watermark"); D is capped at the plan step while a round is open."""
        if job.watermark is not None:
            return job.watermark
        rnd = job.round if job.round is not None and job.round.frozen and not job.round.closed else None
        g, d = job.watermarks(rnd.step if rnd is not None else None)
        if rnd is not None and g > rnd.step and len(rnd.answered) >= job.world_size:  # training resumed past it
            rnd.closed = True
            g, d = job.watermarks(None)
        wm = job.watermark = Watermark(job=job.name, recoverable=g, durable=d,
                                       unusable=job.unusable(d, MAX_UNUSABLE_STEPS))  # fmt: skip
        if wm == job.published:  # hand out the same object while nothing moved: replies stay cacheable
            job.watermark = job.published
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("job %s: G %d, D %d, unusable %s", job.name, g, d, list(wm.unusable))
        job.published = job.watermark
        return job.watermark

    # ------------------------------------------------------------------------------------ plans

    def rebuilding(self, now: float) -> bool:
        """Whether the rebuild window after the start is still open (see :meth:`plan`); once over, never again."""
        if not self._rebuilt and now - self.started >= self.death_timeout(now):
            self._rebuilt = True
        return not self._rebuilt

    def plan(self, msg: PlanRequest, now: float, *, held: bool = False) -> PlanReply:
        """:meth:`plan_rows` as a reply."""
        answer = self.plan_rows(msg, now, held=held)
        if isinstance(answer, PlanReply):
            return answer
        first = answer[0]
        return PlanReply(job=msg.job, rank=first[0], status=first[1], step=first[2], local=first[3],
                         sources=first[4], reason=first[5], plans=tuple(RankPlan(*row) for row in answer[1:]))  # fmt: skip

    def plan_rows(self, msg: PlanRequest, now: float, *, held: bool = False) -> PlanReply | list[PlanRow]:
        """Answer a plan request for all its ranks (see DESIGN "Recovery" and :class:`Round` for the rules).

        For the rebuild window after the start (the death timeout, see :meth:`death_timeout`) every request
        gets ``wait`` and is not recorded: inventories are still coming back from the sidecars. A ``ready``
        answer names, per rank, the live nodes holding ``(job, rank, step)`` other than the asking one as
        sources, and sets ``local`` when the asking node holds it; a rank with none of them left gets ``none``.

        Returns:
            A ``wait`` reply, or once the round is decided each rank's plan in its wire form, in the request's
            order (the fields of :class:`~snapshotd.proto.RankPlan`), which the server packs without building
            message objects.

        Args:
            held: the request got ``wait`` before and was held unanswered since (long-polling), so it is asked
                again now: if its ranks were answered meanwhile (by a duplicate of the request) they get the same
                round's answer instead of opening a new round, as a rank asking after its answer would.

        Raises:
            ValueError: a rank is outside ``world_size`` or listed twice (nothing is recorded).
        """
        ranks = msg.all_ranks
        _check_ranks(msg.job, ranks, msg.world_size)
        job = self._job(msg.job)
        if job.world_size != msg.world_size:
            self._set_world_size(job, msg.world_size)
        if self.rebuilding(now):
            return _wait(msg, f"the coordinator started {now - self.started:.1f} s ago; waiting "
                              f"{self.death_timeout(now):g} s for sidecars to report their snapshots")  # fmt: skip
        rnd = job.round
        if rnd is None or (not held and not rnd.answered.isdisjoint(ranks)):
            if rnd is not None:
                log.info("job %s: rank(s) %s asked again after their answer: new plan round", job.name,
                         _listed(sorted(rnd.answered.intersection(ranks))))  # fmt: skip
            rnd = job.round = Round()
            job.watermark = None
        rnd.asked.update(ranks)
        if not rnd.frozen:
            if len(rnd.asked) < job.world_size:
                return _wait(msg, rnd.wait_reason(job.world_size))
            g = self._watermark(job).recoverable
            rnd.frozen, rnd.frozen_at = True, now
            if not job.seen_inventory:
                rnd.outcome, rnd.step, rnd.reason = "fresh", 0, f"job {job.name} has no snapshot yet: start at 0"
            elif g < 0:
                rnd.outcome, rnd.reason = "none", _why_none(job)
            else:
                rnd.outcome, rnd.step = "ready", g
                job.fork(g)
            log.info("job %s: every rank asked; plan %s at step %d", job.name, rnd.outcome, rnd.step)
            job.watermark = None  # the durable cap starts now
        self._answered(job, rnd, ranks, now)
        return self._rows(job, rnd.outcome, rnd.step, rnd.reason, msg)

    def draft(self, msg: PlanRequest) -> tuple[object, list[PlanRow]] | None:
        """The answer a request just answered ``wait`` (and held) gets if its round freezes with nothing changed.

        That is ``ready`` at the job's G of now, as the token and the rows :meth:`plan_rows` would answer; the
        token names
        everything that answer depends on (the round, the world size, the job's holders, the membership, the
        step). Drafting costs what answering does, but while the ranks arrive rather than all at once when the
        last one asks: :meth:`confirm` then answers a held request in O(its ranks). None when no ``ready``
        answer is in sight (no G yet, a frozen round, the rebuild window).
        """
        job = self._jobs.get(msg.job)
        rnd = job.round if job is not None else None
        if job is None or rnd is None or rnd.frozen or not self._rebuilt or job.world_size != msg.world_size:
            return None
        g = self._watermark(job).recoverable
        if g < 0 or not job.seen_inventory:
            return None
        return self._token(job, rnd, g), self._rows(job, "ready", g, "", msg)

    def confirm(self, msg: PlanRequest, token: object, now: float) -> bool:
        """``plan_rows(msg, now, held=True)`` when it answers the :meth:`draft` made under ``token``: True, and
        ``msg``'s ranks are recorded as answered at ``now``; False (nothing recorded) when the draft is stale."""
        job = self._jobs.get(msg.job)
        rnd = job.round if job is not None else None
        if job is None or rnd is None or not rnd.frozen or rnd.outcome != "ready":
            return False
        if self._token(job, rnd, rnd.step) != token:
            return False
        self._answered(job, rnd, msg.all_ranks, now)
        return True

    def _token(self, job: Job, rnd: Round, step: int) -> tuple[object, ...]:
        return (rnd, job.world_size, job.version, self._epoch, step)

    def _answered(self, job: Job, rnd: Round, ranks: tuple[int, ...], now: float) -> None:
        rnd.answered.update(ranks)
        if len(rnd.answered) == job.world_size:
            if rnd.answered_at is None:
                rnd.answered_at = now
            job.watermark = None  # the round may close now

    def _rows(self, job: Job, outcome: str, step: int, reason: str, msg: PlanRequest) -> list[PlanRow]:
        """The plan of ``outcome`` at ``step`` for every rank of ``msg``, in its order (see :meth:`plan`)."""
        if outcome != "ready":
            return [(r, outcome, step, False, (), reason) for r in msg.all_ranks]
        holders_of, nodes, asking = job.holders, self._nodes, msg.node
        rows: list[PlanRow] = []
        sources_of: dict[tuple[str, ...], tuple[str, ...]] = {}  # a node's ranks mostly share their holders
        for r in msg.all_ranks:
            by_step = holders_of.get(r)
            holders = by_step.get(step) if by_step is not None else None
            if holders:
                local = asking in holders
                key = tuple(holders)
                sources = sources_of.get(key)
                if sources is None:
                    sources = sources_of[key] = tuple(sorted([nodes[n].data_addr for n in key if n != asking]))
                if local or sources:
                    rows.append((r, "ready", step, local, sources, ""))
                    continue
            rows.append((r, "none", -1, False, (), f"rank {r}: every node holding step {step} died after the plan "
                                                   "was made; restore from your last disk checkpoint"))  # fmt: skip
        return rows

    # ------------------------------------------------------------------------------------ re-replication

    def _sweep(self, now: float) -> None:
        """One slice of the re-replication sweep: issue tasks so that every rank's snapshot at G has
        ``1 + replicas`` copies on live nodes, for the next ``SWEEP_SLICE_RANKS`` ranks of the sweep in progress,
        or of a new one (which lists the jobs then known).

        Each slice reads its job's G of the moment. For ``heartbeat_timeout`` after a job's G first shows up here,
        a deficit where the rank's live home holds the snapshot is left alone: that is the regular stream to the
        buddies, still in flight.
        """
        if not self._sweeping:
            self._next_sweep = now + SWEEP_PERIOD_S
            self._issued = {key: kept for key, targets in self._issued.items()
                            if (kept := {t: at for t, at in targets.items() if now - at < TASK_MEMORY_S})}  # fmt: skip
            self._sweeping.extend(self._jobs)
            self._sweep_at = 0
        budget = SWEEP_SLICE_RANKS
        while self._sweeping and budget > 0:
            job = self._jobs.get(self._sweeping[0])
            g = self._watermark(job).recoverable if job is not None else -1
            if job is not None and g >= 0 and self._sweep_at < job.world_size:
                end = min(job.world_size, self._sweep_at + budget)
                self._sweep_ranks(job, g, range(self._sweep_at, end), now)
                budget -= end - self._sweep_at
                self._sweep_at = end
                if end < job.world_size:
                    continue
            self._sweeping.popleft()  # gone, nothing recoverable yet, or done
            self._sweep_at = 0

    def _sweep_ranks(self, job: Job, g: int, ranks: range, now: float) -> None:
        """The sweep (see :meth:`_sweep`) of ``ranks`` of ``job``, whose G is ``g``."""
        if job.swept_g[0] != g:
            job.swept_g = (g, now)
        settling = now - job.swept_g[1] < self.cfg.heartbeat_timeout
        want = 1 + self.cfg.replicas
        holders_of, homes = job.holders, job.homes
        for r in ranks:
            holders = holders_of[r][g]
            if len(holders) >= want or (settling and homes.get(r) in holders):
                continue
            key = (job.name, r, g)
            pending = {t for t in self._issued.get(key, ()) if t not in holders and self._nodes[t].alive}
            count = want - len(holders) - len(pending)
            if count <= 0:
                continue
            sources = tuple(sorted(self._nodes[n].data_addr for n in holders))
            for target in self._targets(job, r, holders.keys() | pending, count):
                self._nodes[target].tasks.append(ReplicateTask(job=job.name, rank=r, step=g, sources=sources))
                self._issued.setdefault(key, {})[target] = now
                log.info("job %s rank %d step %d has %d of %d copies: replicating to %s",
                         job.name, r, g, len(holders), want, target)  # fmt: skip

    def _targets(self, job: Job, rank: int, exclude: set[str], count: int) -> list[str]:
        """Up to ``count`` live nodes for a new copy: the rank's assigned buddies, then ring order from its home.

        Never the home (or the last home, when the rank has none now) nor its failure domain, nor a node in
        ``exclude`` (live holders and pending targets). Beyond the buddies, domains holding no copy yet come
        first. The ring is walked only when the domain counts say a candidate exists, so a deficit that cannot
        be helped costs O(copies), not O(nodes).
        """
        home = job.homes.get(rank)
        anchor = home or job.last_home.get(rank)
        anchor_domain = self._nodes[anchor].domain if anchor is not None else None
        picked = [b for b in self._buddies(home) if b not in exclude][:count] if home is not None else []
        taken = {self._nodes[n].domain for n in (*exclude, *picked)} - {anchor_domain}
        outside = len(self._ring) - (self._domains[anchor_domain] if anchor_domain is not None else 0)
        fresh = outside - sum(self._domains[d] for d in taken)  # live nodes in domains without a copy
        spare = outside - sum(1 for n in (*exclude, *picked) if self._nodes[n].domain != anchor_domain)
        count = min(count, len(picked) + spare)
        ring = self._ring
        start = bisect.bisect_right(ring, anchor) if anchor is not None else 0
        for spread, available in ((True, fresh), (False, spare)):
            if available <= 0:
                continue
            for i in range(len(ring)):
                if len(picked) >= count:
                    return picked
                name = ring[(start + i) % len(ring)]
                domain = self._nodes[name].domain
                if name in exclude or name in picked or domain == anchor_domain or (spread and domain in taken):
                    continue
                picked.append(name)
                taken.add(domain)
        return picked

    # ------------------------------------------------------------------------------------ status

    def status(self, now: float) -> dict:
        """The document behind ``snapshotd status``: plain maps, lists, strings and numbers (msgpack / JSON).

        ``coordinator``: uptime_s, replicas, bad_messages, heartbeats, live_nodes, heartbeat_interval (the one
        given out now, seconds), heartbeat_timeout (the death timeout now, seconds). ``nodes`` (dead ones too):
        node, rack, data_addr, incarnation, alive, last_seen_s, ranks ([job, rank, alive]), stored_bytes,
        out_Bps, in_Bps. ``jobs``: job, world_size, recoverable, durable (as published), and per rank: rank,
        node (its home, or None), newest_step (-1: none), lag_steps (newest - recoverable; None while no step
        is recoverable), copies (live holders of the recoverable step); ``round``: its last plan round (None
        before the first), see :meth:`~.jobs.Round.status`.
        """
        doc: dict = msgpack.unpackb(b"".join(self.status_parts(now)), raw=False)
        return doc

    def status_parts(self, now: float) -> Iterator[bytes]:
        """The :meth:`status` document packed with msgpack, in parts of at most :data:`STATUS_PART_ENTRIES` node
        or rank entries; the parts joined are the document.

        At 10,000 nodes of 8 ranks the document takes 0.2 s or more to build, so the server
        handles requests between parts. The state may change meanwhile: the document lists the nodes and jobs
        there were when the first part was made, and each job's ranks up to the world size it had when its own
        part began; each entry is read as it is packed, and times are as of ``now``.
        """
        packer = msgpack.Packer(use_bin_type=True)
        pack = packer.pack
        coordinator = {
            "uptime_s": round(now - self.started, 3), "replicas": self.cfg.replicas,
            "bad_messages": self.bad_messages, "heartbeats": self.heartbeats, "live_nodes": len(self._live),
            "heartbeat_interval": self.heartbeat_interval(), "heartbeat_timeout": self.death_timeout(now),
        }  # fmt: skip
        nodes = [self._nodes[name] for name in sorted(self._nodes)]
        jobs = [self._jobs[name] for name in sorted(self._jobs)]
        yield (packer.pack_map_header(3) + pack("coordinator") + pack(coordinator) + pack("nodes")
               + packer.pack_array_header(len(nodes)))  # fmt: skip
        for i in range(0, len(nodes), STATUS_PART_ENTRIES):
            yield b"".join([pack({
                "node": n.name, "rack": n.rack, "data_addr": n.data_addr, "incarnation": n.incarnation,
                "alive": n.alive, "last_seen_s": round(now - n.last_seen, 3),
                "ranks": [[j, r, n.alive and info.alive] for (j, r), info in sorted(n.ranks.items())],
                "stored_bytes": n.stored_bytes, "out_Bps": n.out_bps, "in_Bps": n.in_bps,
            }) for n in nodes[i : i + STATUS_PART_ENTRIES]])  # fmt: skip
        yield pack("jobs") + packer.pack_array_header(len(jobs))
        for job in jobs:
            wm = self._watermark(job)
            g, ws = wm.recoverable, job.world_size
            yield (packer.pack_map_header(6) + pack("job") + pack(job.name) + pack("world_size") + pack(ws)
                   + pack("recoverable") + pack(g) + pack("durable") + pack(wm.durable) + pack("ranks")
                   + packer.pack_array_header(ws))  # fmt: skip
            for lo in range(0, ws, STATUS_PART_ENTRIES):
                entries = []
                for r in range(lo, min(ws, lo + STATUS_PART_ENTRIES)):
                    steps = job.holders.get(r, {})
                    newest = max(steps, default=-1)
                    entries.append(pack({
                        "rank": r, "node": job.homes.get(r), "newest_step": newest,
                        "lag_steps": newest - g if g >= 0 else None, "copies": len(steps.get(g, ())),
                    }))  # fmt: skip
                yield b"".join(entries)
            yield pack("round") + pack(None if job.round is None else job.round.status(now))


def _by_job(items: frozenset[Item]) -> list[tuple[str, Iterable[Item]]]:
    """``items`` grouped by job (a node's inventory is nearly always of one job: then no copy is made)."""
    if not items:
        return []
    jobs = set(map(_JOB, items))
    if len(jobs) == 1:
        return [(jobs.pop(), items)]
    return [(j, [it for it in items if it[0] == j]) for j in sorted(jobs)]


def _why_none(job: Job) -> str:
    """Which ranks stand in the way of a common complete step, for a ``none`` plan."""
    lacking = [r for r in range(job.world_size) if r not in job.holders]
    if lacking:
        named = _listed(lacking)
        verb = "has" if len(lacking) == 1 else "have"
        what = f"rank{'s' if len(lacking) > 1 else ''} {named} {verb} no complete snapshot on a live node"
    else:
        ranks = sorted(r for r in job.holders if r < job.world_size)
        what = "no step is complete for every rank on live nodes: " + "; ".join(
            f"rank {r} holds step{'s' if len(job.holders[r]) > 1 else ''} {_steps(job.holders[r])}"
            for r in ranks[:MAX_LISTED])
        if len(ranks) > MAX_LISTED:
            what += f"; {len(ranks) - MAX_LISTED} more ranks"
    return f"job {job.name}: {what}; restore from your last disk checkpoint"


def _steps(steps: Iterable[int], most: int = 6) -> str:
    """The newest ``most`` of ``steps``, comma-separated, oldest first."""
    newest = sorted(steps)[-most:]
    return ", ".join(map(str, newest))


def _check_rank(job: str, rank: int, world_size: int) -> None:
    if rank >= world_size:
        raise ValueError(f"rank {rank} of job {job} is outside its world size {world_size}")


def _check_ranks(job: str, ranks: tuple[int, ...], world_size: int) -> None:
    if max(ranks) >= world_size:
        _check_rank(job, max(ranks), world_size)
    if len(ranks) > 1 and len(set(ranks)) != len(ranks):
        twice = sorted(r for r, n in collections.Counter(ranks).items() if n > 1)
        raise ValueError(f"job {job}: rank(s) {_listed(twice)} asked for twice in one plan request")


def _listed(ranks: list[int]) -> str:
    """At most ``MAX_LISTED`` rank numbers, comma-separated, and how many more."""
    named = ", ".join(map(str, ranks[:MAX_LISTED]))
    return named + (f" and {len(ranks) - MAX_LISTED} more" if len(ranks) > MAX_LISTED else "")


def _wait(msg: PlanRequest, reason: str) -> PlanReply:
    return PlanReply(job=msg.job, rank=msg.rank, status="wait", reason=reason)
