"""The sidecar's side of the control plane: registration, heartbeats and recovery plans."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from snapshotd.proto import (
    Error,
    Heartbeat,
    HeartbeatReply,
    Message,
    PlanReply,
    PlanRequest,
    ProtocolError,
    RegisterSidecar,
    SidecarRegistered,
    decode,
    encode,
)
from snapshotd.security import secure_client

__all__ = ["CoordinatorClient", "CoordinatorUnavailable"]

log = logging.getLogger(__name__)

PLAN_POLL_SECONDS = 0.2
"""The least time between two plan requests of one rank: a coordinator that does not hold requests (one built
before long-polling) answers ``wait`` at once, and the rank then asks again after this pause, not in a busy loop."""
PLAN_REQUEST_TIMEOUT = 5.0
"""How long one plan request may go unanswered before it is sent again. Longer than the coordinator holds a
request that must wait (``CoordinatorConfig.plan_hold``, 1.5 s by default)."""

_PlanKey = tuple[str, int]  # (job, rank)


class CoordinatorUnavailable(TimeoutError):
    """The coordinator did not answer in time."""


class CoordinatorClient:
    """Request/reply with the coordinator over DEALER sockets; each request has its own deadline.

    Heartbeats and plan requests use separate sockets so that a slow plan never delays liveness. Every plan
    request of this sidecar shares one socket: requests carry their job and rank, replies are routed to the
    waiting call by ``(job, rank)``, so any number of local ranks may ask at once. The coordinator holds a
    request that must wait (long-polling) and answers it the moment the job's round is decided. The plan socket
    is open only while some :meth:`plan` call runs: a fleet between restores holds one connection per sidecar
    to the coordinator, not two.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, secret: str | None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.secret = secret
        self._hb = self._socket()
        self._plan: zmq.asyncio.Socket | None = None  # open while plan calls run
        self._plan_calls = 0
        self._waiters: dict[_PlanKey, list[asyncio.Future[Message]]] = {}
        self._warned = False

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self.secret)
        sock.connect(self.endpoint)
        return sock

    def _timed_out(self, timeout: float) -> CoordinatorUnavailable:
        if not self._warned:
            log.warning("coordinator %s did not answer within %.1f s", self.endpoint, timeout)
            self._warned = True
        return CoordinatorUnavailable(f"coordinator {self.endpoint} did not answer within {timeout:.1f} s")

    async def _request(self, sock: zmq.asyncio.Socket, msg: Message, timeout: float) -> Message:
        while await sock.poll(0):  # drop replies to earlier requests that timed out
            await sock.recv_multipart()
        try:
            async with asyncio.timeout(timeout):
                await sock.send_multipart(encode(msg))
                reply = decode(await sock.recv_multipart())
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
        reply = await self._request(self._hb, msg, timeout)
        if not isinstance(reply, HeartbeatReply):
            raise ProtocolError(f"coordinator answered {reply.TYPE} to heartbeat")
        self._warned = False
        return reply

    async def plan(self, req: PlanRequest, deadline: float) -> PlanReply:
        """Ask for the recovery plan until it is not ``wait``.

        Raises:
            CoordinatorUnavailable: no final answer before ``deadline`` (time.monotonic()); the message says how
                many ranks the coordinator was still waiting for.
            ProtocolError: the coordinator refused the request.
        """
        last = "no answer from the coordinator"
        self._plan_calls += 1
        try:
            while True:
                sent = time.monotonic()
                left = deadline - sent
                if left <= 0:
                    raise CoordinatorUnavailable(f"no recovery plan for job {req.job!r} rank {req.rank}: {last}")
                try:
                    reply = await self._plan_once(req, min(left, PLAN_REQUEST_TIMEOUT))
                except CoordinatorUnavailable:
                    continue
                if reply.status != "wait":
                    return reply
                last = reply.reason or "waiting for the other ranks"
                pause = PLAN_POLL_SECONDS - (time.monotonic() - sent)
                if pause > 0:
                    await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        finally:
            self._plan_calls -= 1
            if not self._plan_calls and self._plan is not None:
                self._plan.close(linger=0)
                self._plan = None

    async def _plan_once(self, req: PlanRequest, timeout: float) -> PlanReply:
        """Send one plan request on the shared socket and wait for the reply routed to it.

        Every waiting call keeps one receive pending; whichever receives a reply hands it to the call it belongs
        to, so replies reach their callers whatever order they come in, with no reader task of its own.
        """
        if self._plan is None:
            self._plan = self._socket()
        sock = self._plan
        key = (req.job, req.rank)
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(answer)
        try:
            async with asyncio.timeout(timeout):
                await sock.send_multipart(encode(req))
                while not answer.done():
                    received: asyncio.Future[list[bytes]] = asyncio.ensure_future(sock.recv_multipart())
                    try:
                        await asyncio.wait((answer, received), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        if not received.done():
                            received.cancel()
                    if received.done() and not received.cancelled():
                        self._route(received.result())
        except TimeoutError as exc:
            raise self._timed_out(timeout) from exc
        finally:
            waiting = self._waiters[key]
            waiting.remove(answer)
            if not waiting:
                del self._waiters[key]
        self._warned = False
        reply = answer.result()
        if isinstance(reply, Error):
            raise ProtocolError(f"coordinator refused plan_request: {reply.message}")
        if not isinstance(reply, PlanReply):
            raise ProtocolError(f"coordinator answered {reply.TYPE} to plan_request")
        return reply

    def _route(self, frames: list[bytes]) -> None:
        """Hand a reply on the plan socket to every call waiting for its ``(job, rank)``.

        An error that names no rank goes to every call of its job (to every call when it names no job either);
        a reply nobody waits for any more (its request timed out) is dropped.
        """
        try:
            reply = decode(frames)
        except ProtocolError as exc:
            log.warning("undecodable reply from coordinator %s: %s", self.endpoint, exc)
            return
        if isinstance(reply, PlanReply) or (isinstance(reply, Error) and reply.rank >= 0):
            keys = [(reply.job, reply.rank)]  # type: ignore[attr-defined]
        elif isinstance(reply, Error):
            keys = [k for k in self._waiters if not reply.job or k[0] == reply.job]
        else:
            log.warning("coordinator %s sent %s on the plan socket", self.endpoint, reply.TYPE)
            return
        for key in keys:
            for waiter in self._waiters.get(key, ()):
                if not waiter.done():
                    waiter.set_result(reply)

    def close(self) -> None:
        self._hb.close(linger=0)
        if self._plan is not None:
            self._plan.close(linger=0)
