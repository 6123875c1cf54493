"""The bulk port's wire: a restoring rank fetching a holder's complete copy over one plain TCP connection.

A pull through the sidecars moves every byte three times on the new node (into the sidecar, through ZeroMQ's
framing, then into the rank with ``process_vm_writev``). The bulk port lets the rank itself read the bytes from
the socket straight into its tensors: one kernel copy on each side, the holder sending from the memory that holds
the copy. It runs only on a plaintext data plane (no secret, or ``members`` mode), and only for a connection that
presents a ticket the holder gave out over the data plane (:class:`~snapshotd.proto.Ticket`), so it admits no one
the data plane would not.

One connection serves one ticket:

1. the client sends :data:`HELLO`: :data:`MAGIC`, :data:`VERSION`, the ticket's :data:`TOKEN_BYTES`-byte token;
2. then any number of :data:`RANGE` requests, ``(first, count)``: chunks ``first .. first + count - 1``; ``(0, 0)``
   ends the conversation;
3. the holder answers each chunk of a range, in order, with a :data:`CHUNK` header ``(index, length, checksum,
   status)`` and, when ``status`` is :attr:`Status.OK`, ``length`` bytes of payload. ``checksum`` is the block's
   xxh3-64 from the copy's seal (as :class:`~snapshotd.proto.Chunk` carries it). Any other status ends the
   connection after its header.

A sidecar streaming a snapshot to its buddy *pushes* its chunks over the buddy's bulk port the same way, when the
buddy's :class:`~snapshotd.proto.StreamAccept` names a port and a token: the bytes go from the sender's shared
memory into the buffers that will hold the copy, one kernel copy on each side, and several connections may carry
one stream at once. A push connection:

1. the sender sends :data:`HELLO` with :data:`PUSH_MAGIC` and the token of the stream's accept;
2. then any number of chunks (of the stream's geometry), each a :data:`PUSH_CHUNK` header ``(index, length,
   status)`` with status :attr:`Status.OK`, ``length`` bytes of payload, and :data:`PUSH_SUM`, the payload's
   xxh3-64 (after the payload, so that the sender can take it piece by piece as the bytes go out, each piece
   while it is in the CPU's caches); after its last chunk a header with status :attr:`Status.END`. The buddy
   checks each chunk as it lands and answers over the data plane: a :class:`~snapshotd.proto.ChunkAck` once the
   copy is complete, an :class:`~snapshotd.proto.Error` (code ``bad_chunk``) for a chunk that fails its check or
   does not fit the stream, and closes the connection;
3. after ``END`` the connection may carry another push: from 1., with that push's token. Either side closes it
   when it stays idle (the sender first).

Every integer is little-endian.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct

from .codec import RunningChecksum
from .fields import Buffer

__all__ = [
    "CHUNK",
    "HELLO",
    "MAGIC",
    "PIECE_BYTES",
    "PUSH_CHUNK",
    "PUSH_MAGIC",
    "PUSH_SUM",
    "RANGE",
    "TOKEN_BYTES",
    "VERSION",
    "Status",
    "block_sends",
    "chunk_length",
    "recv_checked",
    "recv_exact",
    "recv_into",
    "send_all",
    "send_checked",
]

MAGIC = b"SNPB"
"""A rank fetching a holder's copy."""
PUSH_MAGIC = b"SNPU"
"""A sidecar pushing a stream's chunks to its buddy."""
VERSION = 3
TOKEN_BYTES = 16

HELLO = struct.Struct("<4sB3x16s")
"""magic (:data:`MAGIC` or :data:`PUSH_MAGIC`), version, token."""
RANGE = struct.Struct("<II")
"""first chunk, count (``(0, 0)``: the client is done)."""
CHUNK = struct.Struct("<IIQB7x")
"""A pulled chunk's header: chunk index, payload length, xxh3-64 of the payload, :class:`Status`."""
PUSH_CHUNK = struct.Struct("<IIB7x")
"""A push's chunk header: chunk index, payload length, :class:`Status`."""
PUSH_SUM = struct.Struct("<Q")
"""What follows a push chunk's payload: its xxh3-64."""
PIECE_BYTES = 1 << 20
"""The bytes :func:`send_checked` checksums just before they go out, and :func:`recv_checked` just after they land,
at a time: each piece is checksummed while it is in the CPU's caches, and the thread wakes and calls into the
kernel once per piece."""


class Status(enum.IntEnum):
    """How a holder answers one chunk."""

    OK = 0
    """The payload follows."""
    CORRUPT = 1
    """The holder's copy failed its check at this chunk: it dropped the copy. Take the chunk from another holder."""
    REFUSED = 2
    """A bad hello (wrong magic or version, an unknown or expired token) or a range outside the copy."""
    END = 3
    """A push connection's sender sent its last chunk of the push (no payload follows)."""


def chunk_length(index: int, chunk_bytes: int, data_bytes: int) -> int:
    """The payload length of chunk ``index`` of a copy of ``data_bytes`` in chunks of ``chunk_bytes``."""
    return max(0, min(chunk_bytes, data_bytes - index * chunk_bytes))


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        EOFError: the peer closed first.
    """
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"the peer closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``.

    Raises:
        EOFError: the peer closed first.
    """
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_checked(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``, taking its checksum piece by piece as the bytes land; the checksum.

    The thread wakes only once a whole piece (:data:`PIECE_BYTES`, or the rest) is in (``SO_RCVLOWAT``), not for
    every segment the kernel queues: fewer wakes and system calls at both ends of the connection. ``sock`` keeps
    Python's timeout (a poll before each receive): a blocking receive that has taken part of a piece would be
    woken for the rest only once a whole piece more is queued, which may never come.

    Raises:
        EOFError: the peer closed first.
    """
    running = RunningChecksum()
    got, n = 0, view.nbytes
    lowat = min(PIECE_BYTES, n)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
    try:
        while got < n:
            if n - got < lowat:  # the rest: wait for no more than it
                lowat = n - got
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            k = sock.recv_into(view[got:], min(PIECE_BYTES, n - got))
            if k == 0:
                raise EOFError(f"the peer closed after {got} of {n} bytes of a chunk")
            running.update(view[got : got + k])
            got += k
    finally:
        with contextlib.suppress(OSError):  # what follows is read as soon as any of it is in
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return running.value()


def block_sends(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking, its sends under the kernel's own timeout (``SO_SNDTIMEO``): each send of a piece is
    one system call, with no poll before it, and fails with ``BlockingIOError`` once the peer has taken no byte
    for ``seconds`` (a peer that keeps taking bytes, however slowly, is waited for). For a sender only: see
    :func:`recv_checked` for why a receiver keeps Python's timeout.

    Raises:
        ValueError: ``seconds`` is not positive (a zero timeout is the kernel's "never").
    """
    if not seconds > 0:
        raise ValueError(f"a send timeout must be positive, got {seconds}")
    sock.settimeout(None)
    whole = int(seconds)
    limit = struct.pack("ll", whole, max(1, int((seconds - whole) * 1e6)))  # struct timeval, 64-bit Linux
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


def send_checked(sock: socket.socket, header: bytes, view: memoryview) -> int:
    """Send ``header``, ``view`` and :data:`PUSH_SUM` of ``view``, taking the checksum piece by piece
    (:data:`PIECE_BYTES`) just before each piece goes out, so that the kernel copies it from the CPU's caches; the
    checksum.

    Raises:
        OSError: as :func:`send_all`; part of the chunk may have gone out, so the connection is done for.
    """
    running = RunningChecksum()
    n = view.nbytes
    head: list[Buffer] = [header]
    lo = 0
    while True:
        piece = view[lo : lo + PIECE_BYTES]
        running.update(piece)
        lo += piece.nbytes
        if lo >= n:
            value = running.value()
            send_all(sock, [*head, piece, PUSH_SUM.pack(value)])
            return value
        send_all(sock, [*head, piece])
        head = []


def send_all(sock: socket.socket, buffers: list[Buffer]) -> None:
    """Send every byte of ``buffers``, in order, in as few system calls as the kernel allows (``sendmsg``).

    Raises:
        OSError: the peer closed or reset the connection; ``BlockingIOError`` on a socket of :func:`block_sends`
            whose peer took no byte for its timeout, ``TimeoutError`` on one with Python's timeout.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
