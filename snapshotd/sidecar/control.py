"""The sidecar's side of the control plane: registration, heartbeats and recovery plans."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TypeVar

from snapshotd.proto import (
    Drain,
    DrainReply,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    MemberQuery,
    MemberReply,
    Message,
    PeerLostReply,
    PeerLostReport,
    ProtocolError,
    RegisterSidecar,
    SeatReply,
    SeatRequest,
    SidecarRegistered,
    decode,
    encode,
)
from snapshotd.transport import Network, Pipe, Role

from .plan_asking import PLAN_POLL_SECONDS, PLAN_REQUEST_TIMEOUT, CoordinatorUnavailable, PlanAsking
from .tasks import TaskTree

__all__ = [
    "PLAN_POLL_SECONDS",
    "PLAN_REQUEST_TIMEOUT",
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "Refused",
]

log = logging.getLogger(__name__)


_Reply = TypeVar("_Reply", bound=Message)


class Refused(ProtocolError):
    """The coordinator answered a request with an :class:`~snapshotd.proto.Error`; ``code`` says why."""

    def __init__(self, request: str, error: Error) -> None:
        super().__init__(f"coordinator refused {request}: {error.message}")
        self.code = error.code


class CoordinatorClient(PlanAsking):
    """Request/reply with the coordinator over client pipes; each request has its own deadline.

    Heartbeats and plan requests use separate sockets so that a slow plan never delays liveness. The plans of
    this sidecar's ranks are asked for together: concurrent :meth:`plan` calls of one job share one request
    (ranks calling in the same turn of the event loop ride the same one; a rank calling later sends a new
    request for every rank still waiting, which replaces the held one at the coordinator), and the coordinator
    answers it with one reply covering them all, handed out to each call. The coordinator holds a request that
    must wait (long-polling) and answers it the moment the job's round is decided. The task reading plan replies
    and asking again after a timeout or a ``wait`` runs only while some :meth:`plan` call runs; a request asked
    again carries the ``attempt`` of the first, so that a rank whose reply was lost or late gets its answer again
    instead of opening a new round (see :class:`~snapshotd.proto.PlanRequest`).

    The plan socket is connected from the start, and replaced by a fresh connected one when the last :meth:`plan`
    call ends: a recovery round is when the coordinator is busiest, and every sidecar of the fleet asks then, so
    none of them should make it set up a connection first (at 10,000 sidecars that is 10,000 TCP and ZMTP
    handshakes, CURVE ones with a secret, inside the round). The fresh socket is a new peer to the coordinator, so
    no answer to a request sent on the old one can reach a later call. An answer may still be due while other calls
    wait: to a request asked again after a timeout (answered twice), or to one whose call gave up. Once that
    happened, the next call that ends replaces the socket even while others wait (they ask again on the fresh one,
    under their attempts), so that the answer still due cannot settle a later call of the same rank. Between
    restores a sidecar holds two connections to the coordinator: both idle but for the heartbeats.
    """

    def __init__(self, network: Network, endpoint: str, *, tasks: TaskTree) -> None:
        self.network = network
        self.endpoint = endpoint
        self.tasks = tasks
        self._hb = self._socket()
        # replaced when the last plan call ends, or one ends after a timeout (_forget)
        self._plan = self._socket()
        self._tainted = (
            False  # a request on the plan socket was asked again after a timeout: two answers may come
        )
        self._closed = False
        self._pump: asyncio.Task[None] | None = None  # reads plan replies while plan calls run
        self._groups = {}
        self._warned = False

    def _socket(self) -> Pipe:
        return self.network.connect(self.endpoint, Role.COORDINATOR)

    async def watch(self) -> None:
        """Follow the heartbeat connection's handshakes until cancelled, so that a timeout says why (run it as a
        task beside the heartbeats; see :class:`~snapshotd.security.HandshakeWatch`)."""
        await self._hb.watch()

    def _timed_out(self, timeout: float) -> CoordinatorUnavailable:
        failure = self._hb.failure
        why = f" ({failure})" if failure else ""
        if not self._warned:
            log.warning("coordinator %s did not answer within %.1f s%s", self.endpoint, timeout, why)
            self._warned = True
        return CoordinatorUnavailable(
            f"coordinator {self.endpoint} did not answer within {timeout:.1f} s{why}"
        )

    async def _request(self, sock: Pipe, msg: Message, timeout: float) -> Message:
        while sock.recv_nowait() is not None:  # drop replies to earlier requests that timed out
            pass
        try:
            async with asyncio.timeout(timeout):
                await sock.send(encode(msg))
                reply = decode(await sock.recv(copy=True))
        except TimeoutError as exc:
            raise self._timed_out(timeout) from exc
        if isinstance(reply, Error):
            raise ProtocolError(f"coordinator refused {msg.TYPE}: {reply.message}")
        return reply

    async def register(self, msg: RegisterSidecar, timeout: float) -> SidecarRegistered:
        reply = await self._request(self._hb, msg, timeout)
        if not isinstance(reply, SidecarRegistered):
            raise ProtocolError(f"coordinator answered {reply.TYPE} to register_sidecar")
        self._warned = False
        return reply

    async def heartbeat(self, msg: Heartbeat, timeout: float) -> HeartbeatReply:
        """The coordinator's reply to ``msg``: replies to earlier heartbeats (answered late, or twice) are
        dropped, never taken for this one's.

        Raises:
            CoordinatorUnavailable: no reply to ``msg`` within ``timeout``.
            ProtocolError: the coordinator refused it or answered something else.
        """
        try:
            async with asyncio.timeout(timeout):
                reply = await self._request(self._hb, msg, timeout)
                while isinstance(reply, HeartbeatReply) and reply.seq != msg.seq:
                    reply = decode(await self._hb.recv(copy=True))
        except TimeoutError as exc:
            raise self._timed_out(timeout) from exc
        if isinstance(reply, Error):
            raise ProtocolError(f"coordinator refused heartbeat: {reply.message}")
        if not isinstance(reply, HeartbeatReply):
            raise ProtocolError(f"coordinator answered {reply.TYPE} to heartbeat")
        self._warned = False
        return reply

    async def is_member(self, host: str, timeout: float) -> bool:
        """Whether ``host`` is the host of a live member's data address (see :class:`~snapshotd.proto.MemberQuery`).

        Each question has a socket of its own: they are rare (a data-plane connection being set up) and may
        overlap.

        Raises:
            CoordinatorUnavailable: no answer within ``timeout``.
            ProtocolError: the coordinator refused the question or answered something else.
        """
        try:
            reply = await self._ask(MemberQuery(host=host), MemberReply, timeout)
        except TimeoutError:
            raise CoordinatorUnavailable(
                f"coordinator {self.endpoint} did not answer within {timeout:.1f} s"
            ) from None
        return reply.member

    async def seat(self, req: SeatRequest, deadline: float) -> SeatReply:
        """The node's seat in ``req.job`` (see :mod:`snapshotd.coordinator.seats`), asked again while the
        coordinator answers ``wait`` (it holds the request until a seat comes free, or a few seconds: see
        :mod:`snapshotd.coordinator.asks`; at most every ``PLAN_POLL_SECONDS``), until ``deadline`` (monotonic);
        the last ``wait`` when it passes. ``given`` and ``taken`` are final.

        Each request has a socket of its own (a node's ranks ask once, at their start).

        Raises:
            CoordinatorUnavailable: no answer before ``deadline``.
            ProtocolError: the coordinator refused the request or answered something else.
        """
        last: SeatReply | None = None
        while True:
            asked = time.monotonic()
            wait = max(0.0, min(deadline - asked, PLAN_REQUEST_TIMEOUT))
            try:  # timeout_s: how long this ask waits, so the coordinator answers within it
                reply = await self._ask(dataclasses.replace(req, timeout_s=wait), SeatReply, wait)
            except TimeoutError:
                if time.monotonic() < deadline:
                    continue
                if last is not None:  # answered before: the last answer stands
                    return last
                raise CoordinatorUnavailable(
                    f"coordinator {self.endpoint} did not answer the seat request of job "
                    f"{req.job} within {req.timeout_s:.0f} s"
                ) from None
            if reply.status != "wait" or time.monotonic() + PLAN_POLL_SECONDS >= deadline:
                return reply
            last = reply  # held while it waits (coordinator/asks.py): ask again at once, but not faster than this
            await asyncio.sleep(max(0.0, asked + PLAN_POLL_SECONDS - time.monotonic()))

    async def peer_lost(self, msg: PeerLostReport, timeout: float) -> PeerLostReply:
        """Tell the coordinator that a rank of this node lost a peer (it probes the job's other nodes).

        Raises:
            CoordinatorUnavailable: no answer within ``timeout``.
            ProtocolError: the coordinator refused it or answered something else.
        """
        try:
            return await self._ask(msg, PeerLostReply, timeout)
        except TimeoutError:
            raise CoordinatorUnavailable(
                f"coordinator {self.endpoint} did not answer within {timeout:.1f} s"
            ) from None

    async def drain(self, msg: Drain, timeout: float) -> DrainReply | None:
        """The coordinator's count of the snapshots this node holds that no node that stays holds (see
        :class:`~snapshotd.proto.Drain`); None when it does not know this node live now (it restarted: the
        heartbeat loop registers the node again).

        Raises:
            CoordinatorUnavailable: no answer within ``timeout``.
            ProtocolError: the coordinator refused it otherwise (one that predates draining does not serve it).
        """
        try:  # timeout_s: how long this ask waits, so the coordinator answers within it
            return await self._ask(dataclasses.replace(msg, timeout_s=timeout), DrainReply, timeout)
        except TimeoutError:
            raise CoordinatorUnavailable(
                f"coordinator {self.endpoint} did not answer within {timeout:.1f} s"
            ) from None
        except Refused as exc:
            if exc.code == ErrorCode.NOT_REGISTERED:
                return None
            raise

    async def _ask(self, msg: Message, answer: type[_Reply], timeout: float) -> _Reply:
        """``msg``'s answer, asked on a socket of its own, closed when answered.

        Raises:
            TimeoutError: no answer within ``timeout``.
            Refused: the coordinator refused ``msg``.
            ProtocolError: it answered something other than ``answer``.
        """
        sock = self._socket()
        try:
            async with asyncio.timeout(timeout):
                await sock.send(encode(msg))
                reply = decode(await sock.recv(copy=True))
        finally:
            sock.close()
        if isinstance(reply, Error):
            raise Refused(msg.TYPE, reply)
        if not isinstance(reply, answer):
            raise ProtocolError(f"coordinator answered {reply.TYPE} to {msg.TYPE}")
        return reply

    def close(self) -> None:
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        self._hb.close()
        self._plan.close()
