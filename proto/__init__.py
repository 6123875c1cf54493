"""snapshotd's wire protocol: typed messages, their limits and errors, the tensor table, and chunk codecs.

Pure: no asyncio, no sockets, no torch. See :mod:`.messages` for the message catalogue, :mod:`.wire` for their
encoding (and the fast path of replies sent over and over), and :mod:`.errors` for the exception
tree and the error codes.
"""

from __future__ import annotations

from .codec import blob_digest, breakeven_rate, checksum, compress_chunk, decompress_chunk, verify
from .errors import (
    ChecksumMismatch,
    CodecError,
    ErrorCode,
    LimitExceeded,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
)
from .fields import CODECS
from .limits import PROTOCOL_VERSION
from .manifest import (
    DTYPE_SIZES,
    CheckedTables,
    TensorEntry,
    decode_table,
    encode_table,
    landing_segments,
    match_entries,
    table_data_bytes,
)
from .messages import *  # noqa: F403
from .messages import __all__ as _messages_all
from .records import (
    Assignment,
    HeldSeat,
    InventoryItem,
    PathTrouble,
    RankInfo,
    RankPlan,
    RankPlanFields,
    ReplicateTask,
    Watermark,
)
from .wire import FramePacker, PlanReplyPacker, decode, encode

__all__ = [
    "CODECS",
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "Assignment",
    "ChecksumMismatch",
    "CodecError",
    "ErrorCode",
    "FramePacker",
    "HeldSeat",
    "PathTrouble",
    "InventoryItem",
    "LimitExceeded",
    "MalformedMessage",
    "PlanReplyPacker",
    "ProtocolError",
    "RankInfo",
    "RankPlan",
    "RankPlanFields",
    "ReplicateTask",
    "TensorEntry",
    "UnknownMessageType",
    "UnsupportedVersion",
    "Watermark",
    "blob_digest",
    "breakeven_rate",
    "checksum",
    "CheckedTables",
    "compress_chunk",
    "decode",
    "decode_table",
    "decompress_chunk",
    "encode",
    "encode_table",
    "landing_segments",
    "match_entries",
    "table_data_bytes",
    "verify",
    *_messages_all,
]
