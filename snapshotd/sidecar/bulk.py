"""The bulk port: restoring ranks fetch copies held here straight from this sidecar's memory, and buddies push
the chunks of their streams straight into the buffers of the copies kept here (:mod:`snapshotd.proto.bulk`).

A pull through the data plane lands in the restoring node's sidecar, which then writes the bytes into the rank:
on a small host that second copy, not the network, bounds a restore. So the restoring sidecar asks each holder
for a ticket (:class:`~snapshotd.proto.TicketRequest`, answered by :meth:`BulkServer.grant` on the event loop)
and hands the tickets to its rank, which connects here and reads the chunks into its own tensors.

- A ticket pins one complete copy (never dropped or overwritten meanwhile) until its connection ends, or until it
  expires unused after ``ticket_ttl`` seconds. It admits one connection.
- Each connection is served on a thread of its own: ``sendall`` of zero-copy views of the copy, the kernel's copy
  beside the event loop, never on it. Every chunk is checked against the copy's seal before it goes out, as the
  data plane's pulls do; a copy that fails is dropped (on the event loop) and the connection told ``CORRUPT``.
- A push (:meth:`BulkServer.expect`, when a stream's begin asks for one) admits up to :data:`PUSH_CONNECTIONS`
  connections presenting its token until it ends (complete, aborted, failed) or, unused, expires. Each
  connection's thread receives its chunks straight into the copy's buffers, taking each chunk's checksum piece by
  piece as the bytes land (while they are in the CPU's caches), and tells the event loop of the chunks that
  passed in batches: when the sender ends its share of the push (``END``), and at least every
  :data:`LANDED_EVERY` seconds meanwhile (each wake of the event loop from a thread costs a context switch on a
  busy host). The first chunk that fails or does not fit the stream ends the push and closes the connection.
  After ``END`` the connection and its thread wait for the sender's next push (its hello) for up to
  :data:`PUSH_IDLE` seconds.
- The port serves only on a plaintext data plane (:attr:`~.config.SidecarConfig.serves_bulk`): a ticket or a push
  token is given only over the data plane, so the port admits no one the data plane would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from snapshotd.proto.bulk import (
    CHUNK,
    HELLO,
    MAGIC,
    PUSH_CHUNK,
    PUSH_MAGIC,
    PUSH_SUM,
    RANGE,
    TOKEN_BYTES,
    VERSION,
    Status,
    recv_checked,
    recv_exact,
)
from snapshotd.proto.codec import mismatch

from .integrity import CorruptCopy, Seal
from .local import SlotState
from .push import LANE_IDLE
from .store import StoredSnapshot

__all__ = ["BulkServer", "HeldCopy", "Push"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
"""Connections served at once; more are closed at once (each has a thread)."""
MAX_PER_HOST = 64
"""Connections from one host served at once (one per restoring rank of that node); more are closed at once."""
MAX_TICKETS = 1024
"""Tickets outstanding at once (each pins a copy until used or expired); more are refused."""
HELLO_TIMEOUT = 2.0
"""Seconds a new connection has to present its ticket: a rank sends it as it connects, so a connection that
stays silent is no rank and is closed."""
PUSH_CONNECTIONS = 16
"""Connections one push admits."""
LANDED_EVERY = 0.5
"""Seconds a push connection's thread may hold chunks that passed before it tells the event loop of them."""
PUSH_IDLE = 2 * LANE_IDLE
"""Seconds a push connection may wait for its next push before it is closed (the sender closes an idle one
first, after :data:`~.push.LANE_IDLE`)."""


@dataclasses.dataclass(slots=True)
class HeldCopy:
    """A complete copy held here, as a pull reads it."""

    table: bytes
    meta: bytes
    nbytes: int
    seal: Seal
    read: Callable[[int, int], memoryview]
    """``read(start, end)``: those bytes (zero-copy where they are contiguous here)."""
    holder: StoredSnapshot | SlotState
    """What to pin while reading (a pinned copy is never dropped or overwritten)."""
    drop: Callable[[], None]
    """Forget the copy (found corrupt): it is never served or reported again."""


@dataclasses.dataclass(slots=True)
class Push:
    """A stream whose sender pushes its chunks over this port (see the module docstring)."""

    what: str
    """The snapshot, for messages."""
    buffers: list[memoryview]
    """Where each chunk lands: one buffer per chunk, of exactly its length."""
    landed: Callable[[list[tuple[int, int]]], None]
    """Called on the event loop with ``(index, checksum)`` of chunks that landed whole and passed their check."""
    failed: Callable[[str], None]
    """Called on the event loop, at most once, with why the push failed."""
    claimed: set[int] = dataclasses.field(default_factory=set)
    connections: int = 0
    ended: bool = False


@dataclasses.dataclass(slots=True)
class _Ticket:
    copy: HeldCopy
    what: str
    expires: float
    corrupt: Callable[[CorruptCopy], None]


class BulkServer:
    """Serves tickets' copies on a TCP port (see the module docstring). Made on the event loop, it listens at once;
    :meth:`close` it when the sidecar stops.

    Args:
        host: the address to listen on (the data plane's bind host).
        port: the port (0: a free one; :attr:`port` says which).
        served: called on the event loop with the payload bytes of each chunk sent.
        ticket_ttl: seconds a ticket waits for its connection.
        timeout: seconds a connection may stay silent (or blocked) before it is closed.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        served: Callable[[int], None],
        ticket_ttl: float = 30.0,
        timeout: float = 10.0,
    ) -> None:
        self.ticket_ttl = ticket_ttl
        self.timeout = timeout
        self._served = served
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        self._pushes: dict[bytes, Push] = {}
        self._conns: dict[socket.socket, str] = {}  # -> the peer's host
        self._threads: set[threading.Thread] = set()
        self.accepted = 0
        """Connections accepted so far."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(MAX_CONNECTIONS)
        except BaseException:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="snapshotd-bulk-accept", daemon=True)
        self._acceptor.start()

    # on the event loop

    def grant(self, copy: HeldCopy, what: str, corrupt: Callable[[CorruptCopy], None]) -> bytes | None:
        """Pin ``copy`` (``what``, for messages) for one connection that presents the returned token within
        :attr:`ticket_ttl` seconds; None when :data:`MAX_TICKETS` are outstanding. ``corrupt`` is called on the
        event loop should the copy fail its check."""
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            if len(self._tickets) >= MAX_TICKETS:
                return None
            self._tickets[token] = _Ticket(copy, what, time.monotonic() + self.ticket_ttl, corrupt)
        copy.holder.pins += 1
        self._loop.call_later(self.ticket_ttl, self._expire, token)
        return token

    def expect(self, push: Push) -> bytes:
        """Admit connections pushing ``push``'s chunks while it lasts (until :meth:`end`); the token they present.
        A push no connection came for within :attr:`ticket_ttl` seconds ends by itself."""
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            self._pushes[token] = push
        self._loop.call_later(self.ticket_ttl, self._expire_push, token)
        return token

    def end(self, token: bytes) -> None:
        """End a push: its connections stop at their next chunk, and new ones are refused."""
        with self._lock:
            push = self._pushes.pop(token, None)
            if push is not None:
                push.ended = True

    def _expire_push(self, token: bytes) -> None:
        with self._lock:
            push = self._pushes.get(token)
            if push is None or push.connections:
                return
        self.end(token)

    def _expire(self, token: bytes) -> None:
        with self._lock:
            ticket = self._tickets.pop(token, None)
        if ticket is not None:
            ticket.copy.holder.pins -= 1

    def close(self) -> None:
        """Stop listening, cut every connection, wait briefly for their threads, release every ticket."""
        with self._lock:
            conns, tickets = list(self._conns), list(self._tickets.values())
            self._tickets.clear()
            for push in self._pushes.values():
                push.ended = True
            self._pushes.clear()
        _shut(self._listener)
        self._listener.close()
        for conn in conns:  # each thread closes its own
            _shut(conn)
        self._acceptor.join(self.timeout)
        for thread in list(self._threads):
            thread.join(self.timeout)
        for ticket in tickets:
            ticket.copy.holder.pins -= 1

    # threads

    def _on_loop(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the sidecar is gone, and its pins with it
            self._loop.call_soon_threadsafe(fn, *args)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed
                return
            host = str(peer[0])
            with self._lock:
                if (
                    len(self._conns) >= MAX_CONNECTIONS
                    or sum(h == host for h in self._conns.values()) >= MAX_PER_HOST
                ):
                    conn.close()
                    continue
                self._conns[conn] = host
                self.accepted += 1
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="snapshotd-bulk", daemon=True
                )
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        ticket: _Ticket | None = None
        try:
            conn.settimeout(HELLO_TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            magic, version, token = HELLO.unpack(recv_exact(conn, HELLO.size))
            conn.settimeout(self.timeout)
            if magic == PUSH_MAGIC and version == VERSION:
                while self._push(conn, token):  # the sender ended its share: its next push may follow
                    conn.settimeout(PUSH_IDLE)
                    hello = _recv_header(conn, HELLO.size)
                    if hello is None:
                        return
                    conn.settimeout(self.timeout)
                    magic, version, token = HELLO.unpack(hello)
                    if magic != PUSH_MAGIC or version != VERSION:
                        return
                return
            if magic == MAGIC and version == VERSION:
                with self._lock:
                    ticket = self._tickets.pop(token, None)
            if ticket is None or ticket.expires < time.monotonic():
                conn.sendall(CHUNK.pack(0, 0, 0, Status.REFUSED))
                return
            self._send_ranges(conn, ticket)
        except (OSError, EOFError) as exc:
            log.info("bulk connection ended: %s", exc)
        finally:
            if ticket is not None:
                self._on_loop(_unpin, ticket.copy)
            with self._lock:
                self._conns.pop(conn, None)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _send_ranges(self, conn: socket.socket, ticket: _Ticket) -> None:
        copy = ticket.copy
        block = copy.seal.block_bytes
        nchunks = -(-copy.nbytes // block)
        while True:
            first, count = RANGE.unpack(recv_exact(conn, RANGE.size))
            if count == 0:
                return
            if first + count > nchunks:
                conn.sendall(CHUNK.pack(first, 0, 0, Status.REFUSED))
                return
            for index in range(first, first + count):
                part = copy.read(index * block, min((index + 1) * block, copy.nbytes))
                try:
                    checksum = copy.seal.check_block(index, part, ticket.what)
                except CorruptCopy as exc:
                    self._on_loop(ticket.corrupt, exc)
                    conn.sendall(CHUNK.pack(index, 0, 0, Status.CORRUPT))
                    return
                conn.sendall(CHUNK.pack(index, part.nbytes, checksum, Status.OK))
                conn.sendall(part)
                self._on_loop(self._served, part.nbytes)

    def _push(self, conn: socket.socket, token: bytes) -> bool:
        """Receive one connection's chunks of the push ``token`` admits (see the module docstring); whether the
        sender ended its share with ``END`` (else the connection is to be closed)."""
        with self._lock:
            push = self._pushes.get(token)
            if push is None or push.connections >= PUSH_CONNECTIONS:
                return False  # closing the connection refuses it: the sender's stream fails
            push.connections += 1
        landed: list[tuple[int, int]] = []
        reported = time.monotonic()
        why = None
        try:
            while True:
                header = _recv_header(conn, PUSH_CHUNK.size)
                if header is None:  # the sender closed the connection
                    return False
                index, length, status = PUSH_CHUNK.unpack(header)
                if status == Status.END:
                    return True
                if push.ended:  # it stops here: what the sender sends after is never read
                    return False
                with self._lock:
                    bad = _misfit(push, index, length, status)
                    if bad is None:
                        push.claimed.add(index)
                if bad is not None:
                    why = f"{push.what}: {bad}"
                    return False
                buf = push.buffers[index]
                actual = recv_checked(conn, buf)
                (checksum,) = PUSH_SUM.unpack(recv_exact(conn, PUSH_SUM.size))
                if actual != checksum:
                    why = (
                        f"chunk {index} of {push.what} failed its end-to-end check: "
                        f"{mismatch(buf.nbytes, actual, checksum)}"
                    )
                    return False
                landed.append((index, checksum))
                if time.monotonic() - reported >= LANDED_EVERY:
                    self._on_loop(push.landed, landed)
                    landed, reported = [], time.monotonic()
        finally:  # the chunks that passed count, whatever ends the connection
            if landed:
                self._on_loop(push.landed, landed)
            if why is not None:
                self._fail(push, why)

    def _fail(self, push: Push, why: str) -> None:
        with self._lock:
            if push.ended:
                return
            push.ended = True
        self._on_loop(push.failed, why)


def _misfit(push: Push, index: int, length: int, status: int) -> str | None:
    """Why a chunk header does not fit ``push``, or None."""
    if status != Status.OK:
        return f"a chunk header with status {status}"
    if not 0 <= index < len(push.buffers):
        return f"chunk {index} is outside 0..{len(push.buffers) - 1}"
    if length != push.buffers[index].nbytes:
        return f"chunk {index} is {length} B, expected {push.buffers[index].nbytes} B"
    if index in push.claimed:
        return f"chunk {index} arrived twice"
    return None


def _recv_header(conn: socket.socket, size: int) -> bytes | None:
    """The next ``size``-byte header, or None when the peer closed the connection before it."""
    first = conn.recv(size)
    if not first:
        return None
    return first + recv_exact(conn, size - len(first)) if len(first) < size else first


def _unpin(copy: HeldCopy) -> None:
    copy.holder.pins -= 1


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
