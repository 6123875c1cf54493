"""Recovery plans asked of the coordinator together: the plan part of :class:`~.control.CoordinatorClient`.

Concurrent :meth:`PlanAsking.plan` calls of one job share one request: ranks calling in the same turn of the event
loop ride the same one, a rank calling later sends a new request for every rank still waiting (which replaces the
held one at the coordinator), and the coordinator answers with one reply covering them all, handed out to each
call (see the client's docstring for the plan socket's lifetime).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time

from snapshotd.proto import Error, PlanReply, PlanRequest, ProtocolError, decode, encode
from snapshotd.proto.limits import MAX_PLAN_RANKS
from snapshotd.transport import Pipe, TransportError

from .tasks import TaskTree

__all__ = ["PLAN_POLL_SECONDS", "PLAN_REQUEST_TIMEOUT", "CoordinatorUnavailable", "PlanAsking"]

log = logging.getLogger(__name__)

PLAN_POLL_SECONDS = 0.2
"""The least time between two plan requests of one rank: a coordinator that does not hold requests (one built
before long-polling) answers ``wait`` at once, and the rank then asks again after this pause, not in a busy loop."""
PLAN_REQUEST_TIMEOUT = 5.0
"""How long one plan request may go unanswered before it is sent again. Longer than the coordinator holds a
request that must wait (``CoordinatorConfig.plan_hold``, 3 s by default)."""

_GroupKey = tuple[str, int, str]  # (job, world_size, node)


class CoordinatorUnavailable(TimeoutError):
    """The coordinator did not answer in time."""


@dataclasses.dataclass(slots=True, eq=False)
class _Group:
    """The ranks of one job (and world size, and node) waiting for their plan: asked for together."""

    job: str
    world_size: int
    node: str
    waiters: dict[int, list[asyncio.Future[PlanReply]]] = dataclasses.field(default_factory=dict)
    dirty: bool = False  # ranks joined since the last request: send one for all of them now
    attempt: int = (
        0  # names the waiting calls in the requests (PlanRequest.attempt); 0: draw one at the next send
    )
    first: int = -1  # the first rank of the last request (a ``wait`` reply names only that one)
    resend_at: float = math.inf  # when to ask again (the last request timed out, or was answered ``wait``)
    answered: bool = False  # the last request was answered (``wait``)
    last: str = "no answer from the coordinator"  # why it still waits, for the timeout's message

    def request(self) -> list[PlanRequest]:
        """Requests for every waiting rank (one, unless the node has more than ``MAX_PLAN_RANKS`` waiting), under
        the :attr:`attempt` of the waiting calls (drawn now if a call joined since the last request)."""
        ranks = sorted(self.waiters)
        if not self.attempt:
            self.attempt = secrets.randbits(62) or 1
        return [
            PlanRequest(
                job=self.job,
                rank=part[0],
                world_size=self.world_size,
                node=self.node,
                ranks=tuple(part[1:]),
                attempt=self.attempt,
            )
            for part in (ranks[i : i + MAX_PLAN_RANKS] for i in range(0, len(ranks), MAX_PLAN_RANKS))
        ]


class PlanAsking:
    """The plan requests of a :class:`~.control.CoordinatorClient`, which sets the attributes below up."""

    endpoint: str
    tasks: TaskTree
    _plan: Pipe
    _tainted: bool
    _closed: bool
    _pump: asyncio.Task[None] | None
    _groups: dict[_GroupKey, _Group]
    _warned: bool

    def _socket(self) -> Pipe:
        raise NotImplementedError

    def _timed_out(self, timeout: float) -> CoordinatorUnavailable:
        raise NotImplementedError

    async def plan(self, req: PlanRequest, deadline: float) -> PlanReply:
        """The recovery plan of ``req.rank`` (``req.ranks`` must be empty), asked for until it is not ``wait``.

        Raises:
            CoordinatorUnavailable: no final answer before ``deadline`` (time.monotonic()); the message says how
                many ranks the coordinator was still waiting for.
            ProtocolError: the coordinator refused the request (naming this rank, or none).
            ValueError: ``req.ranks`` is not empty.
        """
        if req.ranks:
            raise ValueError("plan() asks for one rank; concurrent calls are asked for together")
        key = (req.job, req.world_size, req.node)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(req.job, req.world_size, req.node)
        answer: asyncio.Future[PlanReply] = asyncio.get_running_loop().create_future()
        group.waiters.setdefault(req.rank, []).append(answer)
        group.dirty, group.attempt = True, 0
        if self._pump is None or self._pump.done():
            self._pump = self.tasks.spawn(self._read_plans(self._plan), f"plan replies from {self.endpoint}")
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                # the other ranks asking in this turn of the loop ride the same request
                await asyncio.sleep(0)
                await self._flush(group)
                reply = await answer
        except TimeoutError:
            raise CoordinatorUnavailable(
                f"no recovery plan for job {req.job!r} rank {req.rank}: {group.last}"
            ) from None
        finally:
            self._forget(group, req.rank, answer)
        self._warned = False
        return reply

    def _forget(self, group: _Group, rank: int, answer: asyncio.Future[PlanReply]) -> None:
        """``answer`` is no longer awaited. With the last call, replace the plan socket and stop reading plan
        replies (see the class docstring). While other calls wait, replace it only if a request on it was asked
        again after a timeout, or a call gave up: an answer still to come could otherwise settle a later call of
        the same rank (restarted, asking anew); the waiting calls ask again on the fresh socket, under their
        attempts."""
        waiting = group.waiters.get(rank)
        if waiting is not None and answer in waiting:
            waiting.remove(answer)
            if not waiting:
                del group.waiters[rank]
        if not answer.done() or answer.cancelled():  # gave up: the coordinator may still answer its request
            self._tainted = True
        key = (group.job, group.world_size, group.node)
        last = False
        if not group.waiters and self._groups.get(key) is group:
            del self._groups[key]
            last = not self._groups
        if last or (self._tainted and self._groups):
            self._replace_plan_socket()

    def _replace_plan_socket(self) -> None:
        """Close the plan socket and its reader, and connect a fresh one: a new peer to the coordinator, which no
        reply to a request sent on the old one can reach. The groups still waiting ask again on it at once, under
        their attempts (their requests are held by the coordinator for the old peer, and answered to it)."""
        if self._closed:
            return
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        self._plan.close()
        try:
            self._plan, self._tainted = self._socket(), False
            if self._groups:
                for other in self._groups.values():
                    # answered: not a timeout
                    other.dirty, other.answered, other.resend_at = (
                        True,
                        True,
                        -math.inf,
                    )
                self._pump = self.tasks.spawn(
                    self._read_plans(self._plan), f"plan replies from {self.endpoint}"
                )
        # shutting down (the context or the task tree is gone): the calls end with it
        except Exception as exc:
            log.debug("no fresh plan socket to coordinator %s: %s", self.endpoint, exc)

    async def _flush(self, group: _Group, *, timed_out: bool = False) -> None:
        """Send one request for all of ``group``'s waiting ranks if any joined since the last one (or, with
        ``timed_out``, again: the last one went unanswered)."""
        # every call was answered: nothing to ask again (the group goes with its last call)
        if not group.waiters:
            group.resend_at = math.inf
            return
        if not group.dirty:
            return
        if timed_out:
            self._timed_out(PLAN_REQUEST_TIMEOUT)  # logged once
            self._tainted = True  # the first request may still be answered, and then this one
        group.dirty = False
        requests = group.request()
        group.first, group.answered = requests[0].rank, False
        group.resend_at = time.monotonic() + PLAN_REQUEST_TIMEOUT
        sock = self._plan
        try:
            for req in requests:
                await sock.send(encode(req))
        except (asyncio.CancelledError, TransportError):
            task = asyncio.current_task()
            if sock is self._plan or (task is not None and task.cancelling()):
                raise
            # the socket was replaced under this send (closing it ended the send): the group asks on the fresh one
            group.dirty, group.answered, group.resend_at = True, True, -math.inf

    async def _read_plans(self, sock: Pipe) -> None:
        """Route every reply on the plan socket; ask again for groups whose request timed out or must wait.

        Runs until cancelled (with the socket's replacement, see :meth:`_forget`); a bug fails every waiting call
        instead of leaving it to its deadline.
        """
        try:
            while True:
                now = time.monotonic()
                for group in list(self._groups.values()):
                    if now >= group.resend_at:
                        group.dirty = True
                        await self._flush(group, timed_out=not group.answered)
                soonest = min((g.resend_at for g in self._groups.values()), default=math.inf)
                wait_ms = math.ceil(max(0.0, min(1.0, soonest - time.monotonic())) * 1e3)
                if await sock.poll(wait_ms / 1e3):
                    self._route(await sock.recv(copy=True))
        except Exception as exc:
            log.exception("reading plan replies from coordinator %s failed", self.endpoint)
            for group in self._groups.values():
                for rank in list(group.waiters):
                    self._settle(group, rank, exc)

    def _route(self, frames: list[bytes]) -> None:
        """Hand a reply on the plan socket to the calls waiting for its ranks.

        A ``wait`` for the last request of a group makes it ask again after ``PLAN_POLL_SECONDS`` (a wait for an
        earlier one is left alone: the last is pending). An error naming a rank fails that rank's calls and asks
        again at once for the others of its request; one naming no rank fails every call of its job (every call
        when it names no job either). A reply nobody waits for any more is dropped.
        """
        try:
            reply = decode(frames)
        except ProtocolError as exc:
            log.warning("undecodable reply from coordinator %s: %s", self.endpoint, exc)
            return
        anyone = isinstance(reply, Error) and not reply.job
        groups = [g for g in self._groups.values() if anyone or g.job == reply.job]
        if isinstance(reply, PlanReply):
            self._warned = False
            if reply.status == "wait":
                for group in groups:
                    group.last = reply.reason or "waiting for the other ranks"
                    if reply.rank == group.first:
                        group.answered = True
                        group.resend_at = min(group.resend_at, time.monotonic() + PLAN_POLL_SECONDS)
                return
            for plan in reply.answers():
                for group in groups:
                    self._settle(group, plan.rank, PlanReply.of(reply.job, (plan,)))
        elif isinstance(reply, Error):
            refused = ProtocolError(f"coordinator refused plan_request: {reply.message}")
            for group in groups:
                for rank in [reply.rank] if reply.rank >= 0 else list(group.waiters):
                    if self._settle(group, rank, refused):
                        group.dirty, group.answered = True, True
                        group.resend_at = time.monotonic()
        else:
            log.warning("coordinator %s sent %s on the plan socket", self.endpoint, reply.TYPE)

    @staticmethod
    def _settle(group: _Group, rank: int, outcome: PlanReply | Exception) -> bool:
        """Give ``outcome`` to the calls of ``group`` waiting for ``rank``; whether there were any."""
        waiting = group.waiters.pop(rank, None)
        for answer in waiting or ():
            if not answer.done():
                if isinstance(outcome, Exception):
                    answer.set_exception(outcome)
                else:
                    answer.set_result(outcome)
        return bool(waiting)
