"""Seats: which block of a job's ranks each node runs, for jobs that let snapshotd place their ranks.

A job of ``world_size`` ranks on nodes of ``per_node`` ranks each has ``world_size // per_node`` seats; seat
``s`` is ranks ``s * per_node`` up to ``(s + 1) * per_node - 1``. In live mode with ``nodes=`` (see
:func:`snapshotd.client.live.init_process_group`) every rank asks, through its sidecar, which seat its node has
(:class:`~snapshotd.proto.SeatRequest`), and:

- a node keeps its seat: asking again (its other ranks, a worker its launcher restarted) gets the same one;
- a node asking for the first time gets the lowest free seat; a seat is held while the live node it was given to
  lives, and while a live node reports one of its ranks (a node placed by its own index, or one whose seat this
  coordinator has not seen given: it restarted);
- with no seat free the answer is ``wait``: a spare node started ahead waits until a node of the job is declared
  dead (its heartbeats stopped for the death timeout) and then takes that node's seat. Which node's ranks are lost
  need not be known in advance: the spare takes whichever seat comes free first.

Seats are soft state, like everything here: in the rebuild window after the coordinator's start every request
waits, and then the seats are read from what the nodes report. A job's seats are forgotten with the job (no live
node reported it for ``forget_jobs_after``).

Cost model: a node asking again costs O(1); a node's first request costs O(the seats before the one it gets,
times ``per_node``), once per node.
"""

from __future__ import annotations

import logging

from snapshotd.proto import SeatReply, SeatRequest

from .jobs import Jobs
from .membership import Membership
from .plans import Plans

__all__ = ["Seats"]

log = logging.getLogger(__name__)


class _JobSeats:
    """One job's seats: its ``per_node``, and which node each seat was given to (both ways)."""

    __slots__ = ("per_node", "world_size", "node_of", "seat_of")

    def __init__(self, per_node: int, world_size: int) -> None:
        self.per_node, self.world_size = per_node, world_size
        self.node_of: dict[int, str] = {}
        self.seat_of: dict[str, int] = {}

    def give(self, seat: int, node: str) -> None:
        old = self.node_of.get(seat)
        if old is not None:
            self.seat_of.pop(old, None)
        self.node_of[seat] = node
        self.seat_of[node] = seat


class Seats:
    """The seats of every job whose nodes ask for them (see the module docstring)."""

    def __init__(self, jobs: Jobs, membership: Membership, plans: Plans) -> None:
        self._jobs = jobs
        self._membership = membership
        self._plans = plans
        self._seats: dict[str, _JobSeats] = {}

    def ask(self, msg: SeatRequest, now: float) -> SeatReply:
        """The seat of node ``msg.node`` in ``msg.job``: ``given`` (its first rank) or ``wait``.

        Raises:
            ValueError: the world size is not a multiple of ``per_node``, or disagrees with the job's (its ranks'
                reports, or earlier seat requests); ``per_node`` disagrees with earlier seat requests; the node
                is not a live node registered here.
        """
        if msg.world_size % msg.per_node:
            raise ValueError(f"job {msg.job}: world size {msg.world_size} is not a multiple of the {msg.per_node} "
                             "ranks per node")  # fmt: skip
        node = self._membership.nodes.get(msg.node)
        if node is None or not node.alive:
            raise ValueError(f"node {msg.node!r} is not a live node of this coordinator (its sidecar must register)")
        job = self._jobs.get(msg.job)
        if job is not None and job.world_size and job.world_size != msg.world_size:
            raise ValueError(f"job {msg.job} has {job.world_size} ranks, not {msg.world_size}")
        seats = self._seats.get(msg.job)
        if seats is None:
            seats = self._seats[msg.job] = _JobSeats(msg.per_node, msg.world_size)
        elif (seats.per_node, seats.world_size) != (msg.per_node, msg.world_size):
            raise ValueError(f"job {msg.job}'s nodes asked for seats of {seats.per_node} of {seats.world_size} ranks, "
                             f"this one for {msg.per_node} of {msg.world_size}")  # fmt: skip
        if self._plans.rebuilding(now):
            return SeatReply(job=msg.job, status="wait", reason="the coordinator restarted and is hearing from the "
                                                                "nodes again")  # fmt: skip
        mine = seats.seat_of.get(msg.node)
        if mine is None:
            mine = self._reported_seat(msg.job, msg.node, seats.per_node)
        if mine is None:
            mine = self._free_seat(msg.job, seats)
            if mine is None:
                return SeatReply(job=msg.job, status="wait", reason=f"all {msg.world_size // msg.per_node} seats of "
                                 f"job {msg.job} are held by live nodes")  # fmt: skip
            log.info("job %s: node %s takes seat %d (ranks %d-%d)", msg.job, msg.node, mine, mine * seats.per_node,
                     (mine + 1) * seats.per_node - 1)  # fmt: skip
        seats.give(mine, msg.node)
        return SeatReply(job=msg.job, status="given", first=mine * seats.per_node)

    def forget(self, job: str) -> None:
        """Drop ``job``'s seats (the job itself was forgotten)."""
        self._seats.pop(job, None)

    def _alive(self, name: str) -> bool:
        node = self._membership.nodes.get(name)
        return node is not None and node.alive

    def _reported_seat(self, job: str, name: str, per_node: int) -> int | None:
        """The seat of the ranks of ``job`` that node ``name`` reports (the lowest, if it reports several), if any."""
        ranks = [rank for (j, rank) in self._membership.nodes[name].ranks if j == job]
        return min(ranks) // per_node if ranks else None

    def _free_seat(self, job: str, seats: _JobSeats) -> int | None:
        """The lowest seat neither given to a live node nor holding a rank a live node reports."""
        homes = self._jobs[job].homes if self._jobs.get(job) is not None else {}
        per = seats.per_node
        for seat in range(seats.world_size // per):
            holder = seats.node_of.get(seat)
            if holder is not None and self._alive(holder):
                continue
            if any(homes.get(rank) is not None for rank in range(seat * per, (seat + 1) * per)):
                continue
            return seat
        return None
