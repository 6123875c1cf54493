"""The ZeroMQ transport: ROUTER sockets for server pipes, DEALER sockets for client pipes.

:class:`ZmqNetwork` makes the pipes of one daemon on one asyncio ZeroMQ context and sets each socket up for its
role: high-water marks and ``ROUTER_MANDATORY`` (a reply to a peer that left is refused, not queued), the
owner-only ipc endpoint (mode 0600, a stale socket file replaced), CURVE on every TCP socket with a secret (the
context's ZAP handler admits only the job's key), or, in ``members`` mode, plaintext data-plane connections that
only the hosts of the job's live sidecars may open (:class:`~snapshotd.security.MembersGate`) and that leave
from this node's advertised address. Client pipes follow their handshakes
(:class:`~snapshotd.security.HandshakeWatch`), so that a peer refusing us is named instead of timing out.

:class:`ZmqThreadPipe` is the blocking DEALER of a training process's channel to its sidecar.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from snapshotd.security import (
    DATA_DOMAIN,
    HandshakeWatch,
    MembersGate,
    secure_client,
    secure_server,
    start_authenticator,
)

from .base import Frames, Network, Pipe, Role, Security, ThreadPipe, TransportError

__all__ = ["ZmqNetwork", "ZmqPipe", "ZmqThreadPipe"]

_MORE = zmq.SNDMORE | zmq.NOBLOCK
_HWM = 4096
_COORDINATOR_BACKLOG = 4096
"""Connections the coordinator's listening socket queues before accepting them (the kernel caps it at
``somaxconn``): a fleet connects at once after a coordinator restart, and beyond ZeroMQ's default of 100 the
kernel drops connection attempts, which then wait for TCP's retransmission."""


class ZmqPipe(Pipe):
    """A ZeroMQ socket as a pipe (a ROUTER for a server, a DEALER for a client)."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        address: str,
        *,
        server: bool,
        handshakes: HandshakeWatch | None = None,
    ) -> None:
        self.sock = sock
        # the same socket, for non-blocking I/O
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.address = address
        self.server = server
        self.handshakes = handshakes

    @property
    def failure(self) -> str | None:
        return self.handshakes.failure if self.handshakes is not None else None

    async def recv(self, *, copy: bool = False) -> Frames:
        frames = await self.sock.recv_multipart(copy=copy)
        return self._identity_bytes(frames)

    def recv_nowait(self, *, copy: bool = True) -> Frames | None:
        try:
            frames = self.raw.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return None
        finally:
            self._rearm()
        return self._identity_bytes(frames)

    def _identity_bytes(self, frames: list[Any]) -> Frames:
        if self.server and frames and not isinstance(frames[0], bytes):
            frames[0] = frames[0].bytes
        return frames

    async def poll(self, timeout: float) -> bool:
        try:
            return bool(await self.sock.poll(timeout=max(0, int(timeout * 1000))))
        finally:
            self._rearm()  # pyzmq's own poll ends in a zmq_poll that does not reschedule the socket's waiters

    async def send(self, frames: Frames) -> None:
        try:
            await self.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"{self.address}: {exc}") from exc

    def send_nowait(self, frames: Frames) -> bool:
        raw = self.raw
        try:
            for part in frames[:-1]:
                raw.send(part, _MORE, copy=False)
            raw.send(frames[-1], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise TransportError(f"{self.address}: {exc}") from exc
        finally:
            self._rearm()
        return True

    def _rearm(self) -> None:
        """Wake this socket's waiting ``recv``, ``poll`` and ``send`` calls for what a call on :attr:`raw` (or a
        ``zmq_poll``) made ready. ZeroMQ signals readiness on an edge-triggered descriptor, and such a call may
        consume the edge a waiter sleeps on (it processes the socket's pending commands): the waiter would then
        sleep until some later edge, for instance a new connection. Reading ``EVENTS`` through the asyncio
        socket schedules every waiter whose event is ready, as pyzmq does after its own calls."""
        if not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):  # its context is being torn down
                self.sock.get(zmq.EVENTS)

    async def watch(self) -> None:
        if self.handshakes is None:
            await super().watch()
        else:
            await self.handshakes.run()

    def close(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        self.sock.close(linger=0)


class ZmqNetwork(Network):
    """The ZeroMQ pipes of one daemon (see the module docstring).

    Args:
        security: the job's secret and data-plane mode.
        is_member: ``members`` mode: asks the coordinator whether a host is a live member's (for the data plane's
            member check); required with a secret in that mode.
    """

    def __init__(self, security: Security, is_member: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.security = security
        self.ctx = zmq.asyncio.Context()
        self._members = security.secret is not None and security.data_security == "members"
        self._gate: MembersGate | None = None
        if self._members:
            if is_member is None:
                raise ValueError("members mode needs is_member, the coordinator's member check")
            self._gate = MembersGate(self.ctx, is_member)
        self._auth = None if self._members else start_authenticator(self.ctx, security.secret)

    def serve(self, address: str, role: Role) -> Pipe:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if role is Role.CONTROL:
                sock.setsockopt(zmq.BACKLOG, _COORDINATOR_BACKLOG)
                secure_server(sock, self.security.secret)
            else:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                sock.setsockopt(zmq.RCVHWM, _HWM)
                sock.setsockopt(zmq.SNDHWM, _HWM)
            if role is Role.DATA:
                if self._members:
                    sock.zap_domain = DATA_DOMAIN
                    # no ZAP handler answering: refuse, never admit
                    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                else:
                    secure_server(sock, self.security.secret)
            if role is Role.IPC:
                _bind_owner_only(sock, address)
            else:
                sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {address}: {exc}") from exc
        except BaseException:
            sock.close(linger=0)
            raise
        return ZmqPipe(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), server=True)

    def connect(self, address: str, role: Role, *, source: str | None = None) -> Pipe:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        endpoint = address
        if role is Role.PEER:
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
            sock.setsockopt(zmq.SNDHWM, 256)
            sock.setsockopt(zmq.RCVHWM, _HWM)
            if self._members:  # plaintext, from the address members are known by
                endpoint = _from(source, address) if source else address
            else:
                secure_client(sock, self.security.secret)
        else:
            secure_client(sock, self.security.secret)
        handshakes = HandshakeWatch(sock, endpoint, f"{role.value} {address}")  # before its first handshake
        sock.connect(endpoint)
        return ZmqPipe(sock, address, server=False, handshakes=handshakes)

    async def run(self) -> None:
        if self._gate is not None:
            await self._gate.run()
        else:
            await super().run()

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self.ctx.destroy(linger=0)


class ZmqThreadPipe(ThreadPipe):
    """A blocking DEALER on a context of its own (a CURVE client with ``secret``); :meth:`wait` polls it beside
    the read end of an OS pipe that :meth:`wake` writes a byte to.

    Raises:
        ValueError: ``address`` is not an endpoint.
    """

    def __init__(self, address: str, *, secret: str | None = None) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._waker = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # (read end, write end)
        self._waker_lock = threading.Lock()  # wake() never writes to a descriptor close() released
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._waker[0], zmq.POLLIN)
        secure_client(self._sock, secret)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot connect to {address!r}: {exc}") from exc

    def send_nowait(self, frames: Frames) -> bool:
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def recv_nowait(self, *, copy: bool = False) -> Frames | None:
        try:
            return self._sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return None

    def wait(self, timeout: float) -> bool:
        ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._waker[0] in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._waker[0], 4096):  # every wake() so far is answered by this return
                    pass
        return self._sock in ready

    def wake(self) -> None:
        with self._waker_lock:
            if self._waker[1] >= 0:
                with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
                    os.write(self._waker[1], b"\0")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        with self._waker_lock:
            read_end, write_end = self._waker
            self._waker = (-1, -1)
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


def _bind_owner_only(sock: zmq.asyncio.Socket, address: str) -> None:
    """Bind ``ipc://PATH`` readable and writable by this user alone (a stale socket file is replaced)."""
    path = address.removeprefix("ipc://")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old_umask = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)


def _from(source: str, addr: str) -> str:
    """ZeroMQ's ``tcp://SOURCE:0;HOST:PORT``: connect to ``addr`` from the address ``source``."""
    host = f"[{source}]" if ":" in source else source
    return f"tcp://{host}:0;{addr.removeprefix('tcp://')}"
