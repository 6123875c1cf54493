"""Naming why a connecting socket's handshakes fail, instead of letting its requests time out unexplained."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = ["HandshakeWatch"]

log = logging.getLogger(__name__)


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class HandshakeWatch:
    """Follow the handshakes of a connecting socket, so that a peer refusing us is named instead of timing out.

    ZeroMQ hides a failed handshake: messages just wait. This reads the socket's monitor and keeps
    :attr:`failure`, a sentence saying why handshakes fail (None once one succeeds), for the owner to put in its
    timeout errors; each new reason is logged once. A failure ZeroMQ gives no detail for never replaces a named
    one seen since the last success: with a security mismatch the two alternate as ZeroMQ reconnects, depending
    on which side notices first. A refusal by the peer's member check (ZAP status
    400), after which ZeroMQ would never connect again, is retried every ``retry_s``: the peer may simply not
    have heard of this node yet (ZeroMQ retries a temporary failure, status 300, by itself). :meth:`run` is the
    watching task (start it beside the socket's reader); :meth:`close` before closing the socket.

    Args:
        sock: a connecting socket, before or after ``connect``.
        endpoint: what it connects to, exactly as passed to ``connect``.
        peer: how to name the peer in messages.
    """

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str, peer: str, *, retry_s: float = 1.0) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.peer = peer
        self.retry_s = retry_s
        self.failure: str | None = None
        self._monitor: zmq.asyncio.Socket | None = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self._logged: set[str] = set()

    async def run(self) -> None:
        """Read handshake events until cancelled (or :meth:`close`)."""
        while self._monitor is not None:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if self.note(
                event["event"], event["value"]
            ):  # ZeroMQ gives up on this connection: ask again later
                await asyncio.sleep(self.retry_s)
                self.sock.disconnect(self.endpoint)
                self.sock.connect(self.endpoint)

    def note(self, kind: int, value: int) -> bool:
        """Record one handshake event (a monitor event and its value); True when the peer's member check refused
        this node, after which ZeroMQ never connects again by itself."""
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failure = None
            return False
        reason, named = self._explain(kind, value)
        if named or self.failure is None:
            self.failure = reason
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("%s", reason)
        return kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == 400

    def _explain(self, kind: int, value: int) -> tuple[str, bool]:
        """Why a handshake failed, and whether ZeroMQ said (False: a guess)."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == 300:
            return (
                f"{self.peer} cannot check this node's membership now (its coordinator does not answer)",
                True,
            )
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"{self.peer} refused this node (status {value}): it does not know this host as a member of the "
                "job (--data-security members; check --advertise) or this node's key is not the job's"
            ), True
        if (
            kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            return (
                f"security mismatch with {self.peer}: one side uses CURVE and the other does not (is "
                "SNAPSHOTD_SECRET set on both, with the same --data-security?)"
            ), True
        return (
            f"handshake with {self.peer} failed, with no detail from ZeroMQ: SNAPSHOTD_SECRET differs between the "
            "two sides, or one side uses CURVE and the other does not (--data-security)?"
        ), False

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
