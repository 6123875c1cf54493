"""Plan requests held unanswered (long-polling) until their job's round is decided or a hold time passes.

A rank whose plan must wait for the other ranks used to be told ``wait`` at once and asked again every 0.2 s:
80,000 ranks restoring together sent the coordinator 400,000 requests a second, and a rank learnt its plan up
to a poll interval late. Held instead, a request costs nothing until something can change its answer: the
server asks the state again for every held request of a job whose round was just decided (the last rank
asked), whose world size changed, or for all of them when the rebuild window closes; a request still waiting
after ``hold`` seconds is answered ``wait`` so that the sidecar knows the coordinator is there and asks again.

This module only keeps the requests; asking the state and sending answers is the server's part.
"""

from __future__ import annotations

import collections
import dataclasses

from snapshotd.proto import PlanRequest

__all__ = ["Held", "HeldPlans"]

MAX_HELD = 1 << 18
"""Held requests at most (a few hundred bytes each); beyond, a waiting request is answered ``wait`` at once."""

_Key = tuple[tuple[bytes, ...], int]  # (envelope, rank)


@dataclasses.dataclass(slots=True, eq=False)
class Held:
    """One held request: where the answer goes (the ROUTER envelope), the request, and when to give up."""

    envelope: list[bytes]
    msg: PlanRequest
    until: float


class HeldPlans:
    """Held plan requests by job, each job's in arrival order (which is deadline order).

    Args:
        hold: seconds a request is held at most; 0 holds nothing.
        limit: requests held at most.
    """

    def __init__(self, hold: float, limit: int = MAX_HELD) -> None:
        self.hold_s = hold
        self.limit = limit
        self._jobs: dict[str, collections.OrderedDict[_Key, Held]] = {}
        self._count = 0
        self.due: collections.deque[Held] = collections.deque()  # woken: to be asked again now

    def __len__(self) -> int:
        """Requests held or due."""
        return self._count + len(self.due)

    def hold(self, envelope: list[bytes], msg: PlanRequest, now: float) -> bool:
        """Hold ``msg`` (answered ``wait`` just now) until ``now + hold``; False when full or holding is off.

        A request from the same peer for the same rank replaces the one held before (the sidecar sent it again,
        its earlier one timed out); the earlier one is dropped unanswered.
        """
        if self.hold_s <= 0 or self._count >= self.limit:
            return False
        self.keep(Held(envelope, msg, now + self.hold_s))
        return True

    def keep(self, held: Held) -> None:
        """Hold ``held`` (again), keeping its deadline; a woken request still waiting comes back this way.

        It goes behind requests that arrived after it, so it may be answered up to one hold time late.
        """
        job = self._jobs.get(held.msg.job)
        if job is None:
            job = self._jobs[held.msg.job] = collections.OrderedDict()
        key = (tuple(held.envelope), held.msg.rank)
        if job.pop(key, None) is not None:
            self._count -= 1
        job[key] = held
        self._count += 1

    def wake(self, job: str) -> None:
        """Something may have decided ``job``'s round: move its held requests to :attr:`due`."""
        held = self._jobs.pop(job, None)
        if held is not None:
            self._count -= len(held)
            self.due.extend(held.values())

    def wake_all(self) -> None:
        for job in list(self._jobs):
            self.wake(job)

    def take_due(self, limit: int) -> list[Held]:
        """Up to ``limit`` woken requests, oldest first."""
        return [self.due.popleft() for _ in range(min(limit, len(self.due)))]

    def take_expired(self, now: float, limit: int) -> list[Held]:
        """Up to ``limit`` requests held past their deadline."""
        out: list[Held] = []
        for name in list(self._jobs):
            job = self._jobs[name]
            while job and len(out) < limit:
                key = next(iter(job))
                if job[key].until > now:
                    break
                out.append(job.pop(key))
                self._count -= 1
            if not job:
                del self._jobs[name]
        return out

    def take_all(self) -> list[Held]:
        """Every request held or due (at shutdown)."""
        self.wake_all()
        out, self.due = list(self.due), collections.deque()
        return out
