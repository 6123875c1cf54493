"""The wire protocol's errors: the exceptions raised for what a peer sent, and the codes of an ``Error`` reply.

Every error that bytes from a peer can cause is a :class:`ProtocolError`, which subclasses ``ValueError`` so
that callers who only know "bad input" can catch it as such::

    ValueError
     +-- ProtocolError                 anything a peer sent that we refuse to act on
          +-- MalformedMessage         not a multipart message of the expected shape / types
          +-- UnsupportedVersion       frame 0 names a protocol version we do not speak
          +-- UnknownMessageType       frame 0 names a message type we do not know
          +-- LimitExceeded            a size, count or length over the explicit limits in limits.py
          +-- ChecksumMismatch         a payload whose xxh3-64 does not match its header
          +-- CodecError               a payload that its codec cannot decode (bad lz4 block, wrong length,
                                       missing base buffer)

``decode`` raises these and nothing else, whatever the input.

A process that refuses a request answers with an :class:`~snapshotd.proto.Error` message whose ``code`` is an
:class:`ErrorCode`: a closed set, checked on receipt like every other field, so that a peer can act on the code
and leave the free-text ``message`` to people. An unknown code is a :class:`MalformedMessage`, as any value
outside its field's set is; the protocol version, not the code, is what changes when codes are added.
"""

from __future__ import annotations

import enum

__all__ = [
    "ChecksumMismatch",
    "CodecError",
    "ErrorCode",
    "LimitExceeded",
    "MalformedMessage",
    "ProtocolError",
    "UnknownMessageType",
    "UnsupportedVersion",
]


class ProtocolError(ValueError):
    """Base of every error caused by what a peer sent."""


class MalformedMessage(ProtocolError):
    """The frames do not form a valid message (bad msgpack, wrong types, missing fields, wrong frame count)."""


class UnsupportedVersion(ProtocolError):
    """The header's ``v`` is not a protocol version this build speaks."""


class UnknownMessageType(ProtocolError):
    """The header's ``type`` names no known message."""


class LimitExceeded(ProtocolError):
    """A field, frame or count is larger than the protocol allows."""


class ChecksumMismatch(ProtocolError):
    """A payload's xxh3-64 over its uncompressed bytes differs from the one in its header."""


class CodecError(ProtocolError):
    """A payload cannot be decoded by the codec its header names."""


class ErrorCode(enum.StrEnum):
    """Why a request was refused: the ``code`` of an :class:`~snapshotd.proto.Error` message."""

    BAD_MESSAGE = "bad_message"
    """The request could not be decoded, or makes no sense (a rank outside its world size, a rank asked for twice
    in one plan request, an ipc request announcing a step that is not newer): sending it again will not help."""

    UNEXPECTED = "unexpected"
    """A well-formed message that this process does not serve on this socket (e.g. a chunk sent to the
    coordinator)."""

    INTERNAL = "internal"
    """The process failed while answering (a bug, or an answer that broke a protocol limit); the message says
    what. The process goes on; asking again may work."""

    BUSY = "busy"
    """The process has too many such requests in progress (the coordinator's status documents); ask again
    shortly."""

    NOT_REGISTERED = "not_registered"
    """A rank asked its sidecar for something before registering with it (ipc); or a sidecar asked the
    coordinator (a :class:`~snapshotd.proto.Drain`) under a node or incarnation it does not know live now."""

    PLAN_TIMEOUT = "plan_timeout"
    """The sidecar got no recovery plan from the coordinator: none came in time, or the coordinator refused the
    request (ipc, answering a restore request); or no answer to a seat request came in time."""

    NOT_RECOVERABLE = "not_recoverable"
    """No step is recoverable for every rank of the job: restore from a disk checkpoint (ipc, answering a
    restore request; the message says which ranks stand in the way)."""

    PULL_FAILED = "pull_failed"
    """The plan's step could not be pulled from any of its sources (ipc, answering a restore request)."""

    NOT_FOUND = "not_found"
    """The snapshot (or the stream of it) named by a data-plane request is not held here."""

    MEMORY_LIMIT = "memory_limit"
    """The receiver refused a stream: keeping it would pass its ``--memory-limit``; the sender skips the step.
    On ipc, answering a registration: the node has no room for the rank's arena (the message says why)."""

    BAD_CHUNK = "bad_chunk"
    """A data-plane message the receiver refused: a chunk failing its checksum or its codec, outside its
    snapshot, or a stream whose tensor table does not fit its data."""

    CORRUPT = "corrupt"
    """A copy failed its end-to-end check: on the data plane, the holder's own copy of the requested snapshot
    (it drops it and never serves it again: take the bytes from another holder); on ipc, answering a restore
    request, every copy of some chunk of the rank's recoverable step (the message names rank, step and
    chunk)."""
