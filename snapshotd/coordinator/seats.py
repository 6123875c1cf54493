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
  dead (its heartbeats stopped for the death timeout, or a probe found its sidecar gone) and then takes that
  node's seat. Which node's ranks are lost need not be known in advance: the spare takes whichever seat comes
  free first;
- a node that had a seat (its sidecar says which, ``held``) given since to another live node is answered
  ``taken``: it was declared dead (it hung, or was cut off) and replaced, and its processes, which may have
  woken up, must not rejoin the job (they would take ranks the replacement runs).

Each grant is stamped with the coordinator's wall clock (:attr:`~snapshotd.proto.SeatReply.granted`), and the
sidecar remembers its seat and stamp per job (:class:`~snapshotd.proto.HeldSeat`). Seats are soft state, like
everything here: each sidecar reports its seats with its ranks (:meth:`Seats.report`, on every heartbeat that
reports them: the first after a registration does), and of two nodes claiming one seat the later grant holds it,
so a restarted coordinator, which every request waits for during its rebuild window, knows again which node
holds which seat, and a node declared dead before the restart that comes back is still answered ``taken``. A
node not registered (yet) waits too. A job's seats are forgotten with the job (no live node reported it for
``forget_jobs_after``).

Cost model: a node asking again costs O(1); a node's first request costs O(the seats before the one it gets,
times ``per_node``), once per node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from snapshotd.proto import HeldSeat, SeatReply, SeatRequest

from .jobs import Jobs
from .membership import Membership
from .plans import Plans

__all__ = ["Seats"]

log = logging.getLogger(__name__)


class _JobSeats:
    """One job's seats: its ``per_node``, which node each seat was given to (both ways) and when."""

    __slots__ = ("per_node", "world_size", "node_of", "seat_of", "granted")

    def __init__(self, per_node: int, world_size: int) -> None:
        self.per_node, self.world_size = per_node, world_size
        self.node_of: dict[int, str] = {}
        self.seat_of: dict[str, int] = {}
        self.granted: dict[int, int] = {}  # seat -> when it was given to node_of[seat] (see HeldSeat)

    def give(self, seat: int, node: str, granted: int) -> None:
        old = self.node_of.get(seat)
        if old is not None:
            self.seat_of.pop(old, None)
        mine = self.seat_of.get(node)
        if mine is not None and mine != seat:
            self.node_of.pop(mine, None)
            self.granted.pop(mine, None)
        self.node_of[seat] = node
        self.seat_of[node] = seat
        self.granted[seat] = granted


class Seats:
    """The seats of every job whose nodes ask for them (see the module docstring)."""

    def __init__(self, jobs: Jobs, membership: Membership, plans: Plans) -> None:
        self._jobs = jobs
        self._membership = membership
        self._plans = plans
        self._seats: dict[str, _JobSeats] = {}

    def ask(self, msg: SeatRequest, now: float) -> SeatReply:
        """The seat of node ``msg.node`` in ``msg.job``: ``given`` (its first rank, and when it was given), ``wait``,
        or ``taken`` (the seat the node says it held was given to another live node).

        The node's seat is, in this order: the one it was given here; the one its sidecar says it was given
        (``msg.held``: by this coordinator before a restart); the one of the ranks it reports; the lowest free
        one. The last three only while no other live node holds that seat: a node declared dead that comes back
        does not take its seat back from the node seated since.

        Raises:
            ValueError: the world size is not a multiple of ``per_node``, or disagrees with the job's (its ranks'
                reports, or earlier seat requests); ``per_node`` disagrees with earlier seat requests.
        """
        if msg.world_size % msg.per_node:
            raise ValueError(
                f"job {msg.job}: world size {msg.world_size} is not a multiple of the {msg.per_node} "
                "ranks per node"
            )
        job = self._jobs.get(msg.job)
        if job is not None and job.world_size and job.world_size != msg.world_size:
            raise ValueError(f"job {msg.job} has {job.world_size} ranks, not {msg.world_size}")
        seats = self._seats.get(msg.job)
        if seats is not None and (seats.per_node, seats.world_size) != (msg.per_node, msg.world_size):
            raise ValueError(
                f"job {msg.job}'s nodes asked for seats of {seats.per_node} of {seats.world_size} ranks, "
                f"this one for {msg.per_node} of {msg.world_size}"
            )
        if self._plans.rebuilding(now):
            return self._wait(msg, "the coordinator restarted and is hearing from the nodes again")
        if not self._alive(msg.node):
            return self._wait(msg, f"node {msg.node!r} is not registered with the coordinator (yet)")
        if seats is None:
            seats = self._seats[msg.job] = _JobSeats(msg.per_node, msg.world_size)
        mine = seats.seat_of.get(msg.node)
        granted = seats.granted.get(mine, 0) if mine is not None else 0
        if mine is None:
            held = [msg.held // msg.per_node] if msg.held >= 0 and msg.held % msg.per_node == 0 else []
            claims = held + self._reported_seats(msg.job, msg.node, msg.per_node)
            mine = next(
                (
                    c
                    for c in claims
                    if c < msg.world_size // msg.per_node and self._free(msg.job, seats, c, msg.node)
                ),
                None,
            )
            if held and mine == held[0] and msg.held_granted >= seats.granted.get(mine, 0):
                # its grant, which this coordinator knows of no later one to outrank
                granted = msg.held_granted
            holder = seats.node_of.get(held[0]) if held else None
            if mine is None and holder is not None and holder != msg.node and self._alive(holder):
                return SeatReply(
                    job=msg.job,
                    status="taken",
                    reason=f"seat {held[0]} (ranks {msg.held}-{msg.held + msg.per_node - 1}) of job "
                    f"{msg.job}, which node {msg.node} had, was given to node {holder} after "
                    f"{msg.node} was declared dead; its processes must not rejoin",
                )
        if mine is None:
            mine = next(
                (c for c in range(msg.world_size // msg.per_node) if self._free(msg.job, seats, c, msg.node)),
                None,
            )
            if mine is None:
                return self._wait(
                    msg, f"all {msg.world_size // msg.per_node} seats of job {msg.job} are held by live nodes"
                )
            log.info(
                "job %s: node %s takes seat %d (ranks %d-%d)",
                msg.job,
                msg.node,
                mine,
                mine * seats.per_node,
                (mine + 1) * seats.per_node - 1,
            )
        granted = granted or max(time.time_ns() // 1000, seats.granted.get(mine, 0) + 1)
        seats.give(mine, msg.node, granted)
        return SeatReply(job=msg.job, status="given", first=mine * seats.per_node, granted=granted)

    def report(self, name: str, held: Iterable[HeldSeat]) -> None:
        """Node ``name`` (live) reports the seats its sidecar was given: each seat whose ranks it reports is
        recorded as its, unless that seat was given (to any node, live or dead) by a later grant than the one it
        reports (then the report is stale: the node was replaced; asking, it gets a fresh grant if the seat is
        free). A claim that disagrees with the job (its world size, or the ``per_node`` its nodes asked with) is
        ignored.

        Cost: O(the seats reported, times ``per_node``).
        """
        for h in held:
            if h.world_size % h.per_node or h.first % h.per_node or h.first >= h.world_size:
                continue
            job = self._jobs.get(h.job)
            seats = self._seats.get(h.job)
            if (job is not None and job.world_size and job.world_size != h.world_size) or (
                seats is not None and (seats.per_node, seats.world_size) != (h.per_node, h.world_size)
            ):
                continue
            seat = h.first // h.per_node
            if seat not in self._reported_seats(h.job, name, h.per_node):
                continue
            if seats is None:
                seats = self._seats[h.job] = _JobSeats(h.per_node, h.world_size)
            holder, recorded = seats.node_of.get(seat), seats.granted.get(seat, 0)
            if holder == name:
                seats.give(seat, name, max(h.granted, recorded))
            elif holder is None or h.granted > recorded:
                if holder is not None:
                    log.info(
                        "job %s: node %s holds seat %d by a later grant than node %s",
                        h.job,
                        name,
                        seat,
                        holder,
                    )
                seats.give(seat, name, h.granted)

    @staticmethod
    def _wait(msg: SeatRequest, reason: str) -> SeatReply:
        return SeatReply(job=msg.job, status="wait", reason=reason)

    def forget(self, job: str) -> None:
        """Drop ``job``'s seats (the job itself was forgotten)."""
        self._seats.pop(job, None)

    def _alive(self, name: str) -> bool:
        node = self._membership.nodes.get(name)
        return node is not None and node.alive

    def _reported_seats(self, job: str, name: str, per_node: int) -> list[int]:
        """The seats of the ranks of ``job`` that node ``name`` reports, lowest first."""
        return sorted({rank // per_node for (j, rank) in self._membership.nodes[name].ranks if j == job})

    def _free(self, job: str, seats: _JobSeats, seat: int, name: str) -> bool:
        """Whether node ``name`` may take ``seat``: not given to another live node, and none of its ranks reported
        by another live node."""
        holder = seats.node_of.get(seat)
        if holder is not None and holder != name and self._alive(holder):
            return False
        homes = self._jobs[job].homes if self._jobs.get(job) is not None else {}
        per = seats.per_node
        return all(homes.get(rank) in (None, name) for rank in range(seat * per, (seat + 1) * per))
