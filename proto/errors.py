"""The wire protocol's exception tree.

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
"""

from __future__ import annotations

__all__ = [
    "ChecksumMismatch",
    "CodecError",
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
