"""The coordinator process: one ROUTER socket in front of :class:`~.state.CoordinatorState`.

This module does socket I/O, the expiry timer and shutdown; every decision lives in the state. Requests are
handled in batches: each wake-up of the loop drains the socket without blocking (up to ``_BATCH`` messages),
answers each one at once, then yields, so the expiry timer and the ZAP handler run between batches and a plan
request waits behind at most one batch of heartbeats. Peers are DEALER sockets; a REQ peer (an empty delimiter
frame before the message) is answered with the same envelope.

Nothing a peer sends can crash or wedge the loop: undecodable frames get ``Error(code="bad_message")``, a
well-formed request that makes no sense (a rank outside its world size) the same, a message the coordinator does
not serve ``Error(code="unexpected")``, an ``Error`` sent to us is counted and dropped, and a bug while handling
one request answers ``Error(code="internal")`` and the loop goes on. Each problem is logged at most once per
peer per minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from snapshotd import security
from snapshotd.proto import (
    Error,
    Heartbeat,
    HeartbeatReply,
    Message,
    PlanRequest,
    ProtocolError,
    RegisterSidecar,
    StatusReply,
    StatusRequest,
    decode,
    encode,
)
from snapshotd.proto.limits import MAX_TEXT_LEN

from .config import CoordinatorConfig
from .replies import HeartbeatReplies
from .state import CoordinatorState

__all__ = ["run_coordinator"]

log = logging.getLogger(__name__)

_BATCH = 4096
"""Requests handled per wake-up before the loop gets a turn."""
_IDLE_POLL_MS = 100
"""How long an idle socket wait lasts before ``stop`` is checked again."""
_COMPLAIN_EVERY_S = 60.0


async def run_coordinator(
    cfg: CoordinatorConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve the control plane until ``stop`` is set, or SIGTERM / SIGINT arrives.

    Signal handlers are installed only when running in the main thread (and removed on exit). On stop, the
    requests already received are answered, then every socket is closed (linger 0), the ZAP handler stopped and
    the ZeroMQ context terminated.

    Args:
        cfg: the configuration; with ``cfg.secret`` the socket is a CURVE server that admits only job members.
        ready: called once with the bound endpoint (a port 0 in ``cfg.bind`` resolved to the real port).
        stop: set it to shut down; a private one is used when None.

    Raises:
        ValueError: a routable bind without a secret and without ``insecure``.
        OSError: the endpoint cannot be bound (in use, bad address).
    """
    security.check_bind(cfg.bind, cfg.secret, cfg.insecure)
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    auth = None
    handled: list[signal.Signals] = []
    try:
        sock.linger = 0
        auth = security.start_authenticator(ctx, cfg.secret)
        security.secure_server(sock, cfg.secret)
        try:
            sock.bind(cfg.bind)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot bind the coordinator to {cfg.bind}: {exc}") from exc
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        server = _Server(sock, CoordinatorState(cfg, time.monotonic()))
        log.info("coordinator on %s: replicas %d, heartbeat timeout %g s, %s", endpoint, cfg.replicas,
                 cfg.heartbeat_timeout, "CURVE" if cfg.secret else "no secret")  # fmt: skip
        if ready is not None:
            ready(endpoint)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server.serve(stop))
            tg.create_task(server.expire_forever(stop, min(0.1, cfg.heartbeat_timeout / 4)))
        log.info("coordinator on %s stopped", endpoint)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)


class _Server:
    def __init__(self, sock: zmq.asyncio.Socket, state: CoordinatorState) -> None:
        self.sock = sock
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # the same socket, for non-blocking batch I/O
        self.state = state
        self._complaints: dict[Any, float] = {}
        self.replies = HeartbeatReplies()

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer requests in batches until ``stop``; then answer what already arrived and return."""
        while not stop.is_set():
            if await self.sock.poll(timeout=_IDLE_POLL_MS):
                self.handle_batch()
                await asyncio.sleep(0)
        self.handle_batch()

    async def expire_forever(self, stop: asyncio.Event, period: float) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period):
                    await stop.wait()
            try:
                self.state.expire(time.monotonic())
            except Exception:  # a bug must not stop failure detection for every other node
                self.complain("expiry", "expiry failed", exc_info=True)

    def handle_batch(self) -> None:
        for _ in range(_BATCH):
            try:
                frames = self.raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.complain("recv", "receive failed: %s", exc)
                return
            self.handle(frames, time.monotonic())

    def handle(self, frames: list[bytes], now: float) -> None:
        peer = frames[0]
        split = 2 if len(frames) > 2 and not frames[1] else 1  # a REQ peer's empty delimiter
        envelope, body = frames[:split], frames[split:]
        try:
            msg = decode(body)
        except ProtocolError as exc:
            self.state.bad_messages += 1
            self.complain(peer, "bad message from peer %s: %s", peer.hex(), exc)
            self.send(envelope, Error(code="bad_message", message=_clip(str(exc))))
            return
        try:
            reply = self.dispatch(msg, now)
        except ValueError as exc:
            self.state.bad_messages += 1
            self.complain(peer, "refused %s from peer %s: %s", msg.TYPE, peer.hex(), exc)
            reply = Error(job=msg.job, code="bad_message", message=_clip(str(exc)))
        except Exception as exc:
            self.complain(peer, "failed to handle %s from peer %s", msg.TYPE, peer.hex(), exc_info=True)
            reply = Error(job=msg.job, code="internal", message=_clip(f"{type(exc).__name__}: {exc}"))
        if reply is not None:
            self.send(envelope, reply, msg.node if isinstance(msg, Heartbeat) else None)

    def dispatch(self, msg: Message, now: float) -> Message | None:
        if isinstance(msg, Heartbeat):
            return self.state.heartbeat(msg, now)
        if isinstance(msg, PlanRequest):
            return self.state.plan(msg, now)
        if isinstance(msg, RegisterSidecar):
            return self.state.register(msg, now)
        if isinstance(msg, StatusRequest):
            return StatusReply(body=msgpack.packb(self.state.status(now), use_bin_type=True))
        self.state.bad_messages += 1
        if isinstance(msg, Error):  # never answer an error with an error
            return None
        return Error(job=msg.job, code="unexpected", message=f"the coordinator does not serve {msg.TYPE!r}")

    def send(self, envelope: list[bytes], reply: Message, node: str | None = None) -> None:
        """Encode and send ``reply``; a heartbeat reply to ``node`` is joined from cached pieces (see replies.py)."""
        try:
            head = self.replies.frame(node, reply) if node and isinstance(reply, HeartbeatReply) else None
            frames = encode(reply) if head is None else [head]
        except ProtocolError as exc:  # our answer broke a limit (e.g. a status document over 64 MiB)
            self.complain("encode", "cannot encode %s: %s", reply.TYPE, exc)
            frames = encode(Error(code="internal", message=_clip(f"the {reply.TYPE} broke a limit: {exc}")))
        try:
            self.raw.send_multipart([*envelope, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a ROUTER drops on a full pipe; anything else is worth a line
            self.complain("send", "send failed: %s", exc)

    def complain(self, key: Any, fmt: str, *args: Any, exc_info: bool = False) -> None:
        """Log a problem, at most once a minute per ``key`` (a peer's routing id, or a name)."""
        now = time.monotonic()
        last = self._complaints.get(key)
        if last is not None and now - last < _COMPLAIN_EVERY_S:
            return
        if len(self._complaints) > 10_000:
            self._complaints = {k: t for k, t in self._complaints.items() if now - t < _COMPLAIN_EVERY_S}
        self._complaints[key] = now
        log.warning(fmt + " (logged at most once a minute)", *args, exc_info=exc_info)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."
