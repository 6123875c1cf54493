"""Plan requests held unanswered (long-polling) until their job's round is decided or a hold time passes.

A request that must wait for the other ranks is held rather than answered ``wait`` at once: answered, every
waiting sidecar would poll, so that the coordinator's load would grow with the fleet times the poll rate, and a
rank would learn its plan up to a poll interval late. A held request costs nothing until something can change
its answer: the server asks the state again for every held request of a job whose round was just decided (the
last rank asked), whose world size changed, or for all of them when the rebuild window closes; a request still
waiting after ``hold`` seconds is answered ``wait`` so that the sidecar knows the coordinator is there and asks
again.

A request covers all the ranks its sidecar asks for at once. One from the same peer (ROUTER envelope) and job
whose ranks include all of a held request's ranks replaces it: the sidecar asked again (its earlier request
timed out) or more of its ranks joined; the earlier one is dropped unanswered. A peer keeps at most
``MAX_PLAN_RANKS`` requests of a job held (a node never has more ranks asking); beyond, its oldest is dropped.

Each held request may carry a draft of its answer, encoded once while the requests arrive (see
:meth:`~.plans.Plans.draft`), so that answering every held request of a round when it freezes costs
little more than sending them. The server drafts only when its loop has caught up (nothing queued), at most a
batch at a time, so that drafting never delays a request; when the round freezes it sends each held request whose
draft still holds, and asks the state again for the others, a batch at a time with their replies encoded
together. This module only keeps the requests; asking the state and sending answers is the server's part
(:mod:`.loop`).
"""

from __future__ import annotations

import collections
import dataclasses

from snapshotd.proto import PlanRequest
from snapshotd.proto.limits import MAX_PLAN_RANKS

__all__ = ["Held", "HeldPlans"]

MAX_HELD = 1 << 18
"""Held requests at most (a few hundred bytes each); beyond, a waiting request is answered ``wait`` at once."""


@dataclasses.dataclass(slots=True, eq=False)
class Held:
    """One held request: where the answer goes (the ROUTER envelope), the request, and when to give up.

    ``token`` and ``frame``: a draft of the answer (the state's token, frame 0 of the encoded reply) or None.
    """

    envelope: list[bytes]
    msg: PlanRequest
    until: float
    token: object = None
    frame: bytes = b""


class _Job:
    """One job's held requests in arrival order (which is deadline order), and each peer's."""

    __slots__ = ("order", "by_peer")

    def __init__(self) -> None:
        self.order: dict[Held, None] = {}
        self.by_peer: dict[tuple[bytes, ...], list[Held]] = {}

    def remove(self, held: Held) -> None:
        del self.order[held]
        env = tuple(held.envelope)
        mine = self.by_peer[env]
        mine.remove(held)
        if not mine:
            del self.by_peer[env]


class HeldPlans:
    """Held plan requests by job.

    Args:
        hold: seconds a request is held at most; 0 holds nothing.
        limit: requests held at most.
    """

    def __init__(self, hold: float, limit: int = MAX_HELD) -> None:
        self.hold_s = hold
        self.limit = limit
        self._jobs: dict[str, _Job] = {}
        self._count = 0
        self.due: collections.deque[Held] = collections.deque()  # woken: to be asked again now

    def __len__(self) -> int:
        """Requests held or due."""
        return self._count + len(self.due)

    def hold(self, envelope: list[bytes], msg: PlanRequest, now: float) -> Held | None:
        """Hold ``msg`` (answered ``wait`` just now) until ``now + hold``; None when full or holding is off."""
        if self.hold_s <= 0 or self._count >= self.limit:
            return None
        held = Held(envelope, msg, now + self.hold_s)
        self.keep(held)
        return held

    def keep(self, held: Held) -> None:
        """Hold ``held`` (again), keeping its deadline; a woken request still waiting comes back this way.

        It goes behind requests that arrived after it, so it may be answered up to one hold time late. A held
        request of the same peer and job whose ranks are all among ``held``'s is dropped.
        """
        job = self._jobs.get(held.msg.job)
        if job is None:
            job = self._jobs[held.msg.job] = _Job()
        env = tuple(held.envelope)
        mine = job.by_peer.get(env)
        if mine:
            asked = set(held.msg.all_ranks)
            drop = [h for h in mine if h is held or asked.issuperset(h.msg.all_ranks)]
            if len(mine) - len(drop) >= MAX_PLAN_RANKS:  # more than a node asks for: the oldest goes
                drop.append(next(h for h in mine if h not in drop))
            for old in drop:
                job.remove(old)
                self._count -= 1
        job.order[held] = None
        job.by_peer.setdefault(env, []).append(held)
        self._count += 1

    def wake(self, job: str) -> None:
        """Something may have decided ``job``'s round: move its held requests to :attr:`due`."""
        held = self._jobs.pop(job, None)
        if held is not None:
            self._count -= len(held.order)
            self.due.extend(held.order)

    def wake_all(self) -> None:
        for job in list(self._jobs):
            self.wake(job)

    def take_expired(self, now: float, limit: int) -> list[Held]:
        """Up to ``limit`` requests held past their deadline."""
        out: list[Held] = []
        for name in list(self._jobs):
            job = self._jobs[name]
            while job.order and len(out) < limit:
                held = next(iter(job.order))
                if held.until > now:
                    break
                job.remove(held)
                out.append(held)
                self._count -= 1
            if not job.order:
                del self._jobs[name]
        return out

    def take_all(self) -> list[Held]:
        """Every request held or due (at shutdown)."""
        self.wake_all()
        out, self.due = list(self.due), collections.deque()
        return out
