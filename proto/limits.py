"""Explicit limits on every field a peer controls.

They bound what one message can make a process allocate or loop over before anything acts on it. The numbers
are generous for real jobs (a 1,000-layer model has ~10^4 tensors) and small enough that a hostile peer cannot
exhaust memory with one message.
"""

from __future__ import annotations

PROTOCOL_VERSION = 2
"""The wire protocol's version, in every message's header: a peer speaking another is refused, naming both. It changes
whenever the wire does (``tests/proto/test_messages.py`` pins :func:`~snapshotd.proto.wire.wire_fingerprint` to it)."""

MAX_HEADER_BYTES = 1 << 20
"""Frame 0 (the msgpack header) of any message."""

MAX_NAME_LEN = 256
"""Job names, node names, racks, codec names, error codes."""

MAX_ADDRESS_LEN = 512
"""ZeroMQ endpoints and ipc paths."""

MAX_TEXT_LEN = 4096
"""Free-text fields such as error messages."""


def clip_text(text: str) -> str:
    """``text`` cut to :data:`MAX_TEXT_LEN` characters (ending in "..." when cut)."""
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."


MIN_CHUNK_BYTES = 4096
"""The smallest chunk of a stream or pull: a receiver keeps a few bytes of bookkeeping per chunk, sized before
any data arrives, so a tiny chunk would multiply a snapshot's memory."""

MAX_CHUNK_BYTES = 64 << 20
"""One chunk payload, compressed or not."""

MAX_TABLE_BYTES = 64 << 20
"""One encoded tensor table (manifest)."""

MAX_META_BYTES = 64 << 20
"""One msgpack blob of non-tensor state."""

MAX_TENSORS = 1_000_000
"""Entries in one tensor table."""

MAX_TENSOR_NDIM = 32

MAX_SNAPSHOT_BYTES = 1 << 40
"""Tensor bytes of one rank's snapshot (1 TiB)."""

MAX_RANKS = 1 << 20
"""World size and rank numbers."""

MAX_STEP = (1 << 63) - 1

MAX_PID = 1 << 22
"""Process ids: Linux's ``PID_MAX_LIMIT`` on 64-bit kernels, so every pid a peer sends is one ``os.kill`` takes."""

MAX_PLAN_RANKS = 1024
"""Ranks of one node asking for their recovery plans in one request (and answered in one reply)."""

MAX_LIST_ITEMS = 1 << 20
"""Inventory entries, rank lists, assignment lists in one message."""

MAX_SLOTS = 16
"""Shared-memory slots per rank."""

MAX_UNUSABLE_STEPS = 64
"""Steps a watermark names as unusable (a sidecar holds a rank's copies of a few steps above D)."""
MAX_ANNOUNCED_STEPS = 64
"""Step durations one announce carries for the pacer (the steps since the previous announce, newest kept)."""
