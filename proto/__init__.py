"""snapshotd's wire protocol: typed messages, their limits and errors, the tensor table, and chunk codecs.

Pure: no asyncio, no sockets, no torch. See :mod:`.messages` for the message catalogue and :mod:`.errors` for
the exception tree.
"""

from __future__ import annotations

from .codec import breakeven_rate, checksum, compress_chunk, decompress_chunk, verify
from .errors import (
    ChecksumMismatch,
    CodecError,
    LimitExceeded,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
)
from .manifest import DTYPE_SIZES, TensorEntry, decode_table, encode_table, match_entries, table_data_bytes
from .messages import *  # noqa: F403
from .messages import __all__ as _messages_all

__all__ = [
    "DTYPE_SIZES",
    "ChecksumMismatch",
    "CodecError",
    "LimitExceeded",
    "MalformedMessage",
    "ProtocolError",
    "TensorEntry",
    "UnknownMessageType",
    "UnsupportedVersion",
    "breakeven_rate",
    "checksum",
    "compress_chunk",
    "decode_table",
    "decompress_chunk",
    "encode_table",
    "match_entries",
    "table_data_bytes",
    "verify",
    *_messages_all,
]
