"""The sidecar's side of the control plane: registration, heartbeats and recovery plans."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from snapshotd.proto import (
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


class CoordinatorUnavailable(TimeoutError):
    """The coordinator did not answer in time."""


class CoordinatorClient:
    """Request/reply with the coordinator over a DEALER socket; each request has its own deadline.

    Heartbeats and plan polls use separate sockets so that a slow plan never delays liveness.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, secret: str | None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.secret = secret
        self._hb = self._socket()
        self._warned = False

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self.secret)
        sock.connect(self.endpoint)
        return sock

    async def _request(self, sock: zmq.asyncio.Socket, msg: Message, timeout: float) -> Message:
        while await sock.poll(0):  # drop replies to earlier requests that timed out
            await sock.recv_multipart()
        try:
            async with asyncio.timeout(timeout):
                await sock.send_multipart(encode(msg))
                while True:
                    reply = decode(await sock.recv_multipart())
                    if reply.TYPE == "error":
                        raise ProtocolError(f"coordinator refused {msg.TYPE}: {getattr(reply, 'message', '')}")
                    return reply
        except TimeoutError as exc:
            if not self._warned:
                log.warning("coordinator %s did not answer within %.1f s", self.endpoint, timeout)
                self._warned = True
            raise CoordinatorUnavailable(f"coordinator {self.endpoint} did not answer within {timeout:.1f} s") from exc

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
        """Poll for the recovery plan until it is not ``wait``.

        Raises:
            CoordinatorUnavailable: no final answer before ``deadline`` (time.monotonic()); the message says how
                many ranks the coordinator was still waiting for.
        """
        sock = self._socket()
        last = "no answer from the coordinator"
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CoordinatorUnavailable(f"no recovery plan for job {req.job!r} rank {req.rank}: {last}")
                try:
                    reply = await self._request(sock, req, min(left, 2.0))
                except CoordinatorUnavailable:
                    continue
                if not isinstance(reply, PlanReply):
                    raise ProtocolError(f"coordinator answered {reply.TYPE} to plan_request")
                if reply.status != "wait":
                    return reply
                last = reply.reason or "waiting for the other ranks"
                await asyncio.sleep(min(PLAN_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._hb.close(linger=0)
