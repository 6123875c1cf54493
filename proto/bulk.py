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
2. then any number of :data:`CHUNK` headers with status :attr:`Status.OK`, each followed by its payload (a chunk
   of the stream's geometry, ``checksum`` its block's xxh3-64 from the slot's seal); it closes the connection
   after its last chunk. The buddy checks each chunk as it lands and answers over the data plane: a
   :class:`~snapshotd.proto.ChunkAck` once the copy is complete, an :class:`~snapshotd.proto.Error` (code
   ``bad_chunk``) for a chunk that fails its check or does not fit the stream.

Every integer is little-endian.
"""

from __future__ import annotations

import enum
import struct

__all__ = [
    "CHUNK",
    "HELLO",
    "MAGIC",
    "PUSH_MAGIC",
    "RANGE",
    "TOKEN_BYTES",
    "VERSION",
    "Status",
    "chunk_length",
]

MAGIC = b"SNPB"
"""A rank fetching a holder's copy."""
PUSH_MAGIC = b"SNPU"
"""A sidecar pushing a stream's chunks to its buddy."""
VERSION = 1
TOKEN_BYTES = 16

HELLO = struct.Struct("<4sB3x16s")
"""magic (:data:`MAGIC` or :data:`PUSH_MAGIC`), version, token."""
RANGE = struct.Struct("<II")
"""first chunk, count (``(0, 0)``: the client is done)."""
CHUNK = struct.Struct("<IIQB7x")
"""chunk index, payload length, xxh3-64 of the payload, :class:`Status`."""


class Status(enum.IntEnum):
    """How a holder answers one chunk."""

    OK = 0
    """The payload follows."""
    CORRUPT = 1
    """The holder's copy failed its check at this chunk: it dropped the copy. Take the chunk from another holder."""
    REFUSED = 2
    """A bad hello (wrong magic or version, an unknown or expired token) or a range outside the copy."""


def chunk_length(index: int, chunk_bytes: int, data_bytes: int) -> int:
    """The payload length of chunk ``index`` of a copy of ``data_bytes`` in chunks of ``chunk_bytes``."""
    return max(0, min(chunk_bytes, data_bytes - index * chunk_bytes))
