"""The field specs that messages and records share, and the value sets they draw from.

Each names one kind of value a peer controls (a job name, an address, a rank, a step) with its limits from
:mod:`.limits`, so that every field of that kind is checked alike wherever it appears.
"""

from __future__ import annotations

from . import limits as L
from .schema import Float, Int, Str

__all__ = [
    "ADDR",
    "CODECS",
    "JOB",
    "NAME",
    "NBYTES",
    "PID",
    "RANK",
    "SECONDS",
    "SLOT",
    "STEP",
    "STEP_OR_NONE",
    "TEXT",
    "WORLD",
    "Buffer",
]

Buffer = bytes | bytearray | memoryview
"""What a payload frame may be given as."""

CODECS = ("raw", "lz4", "shuffle-lz4", "delta-lz4")
"""The codecs a chunk may be encoded with (see :mod:`.codec`)."""

JOB = Str(L.MAX_NAME_LEN)
NAME = Str(L.MAX_NAME_LEN)
ADDR = Str(L.MAX_ADDRESS_LEN)
TEXT = Str(L.MAX_TEXT_LEN)
RANK = Int(0, L.MAX_RANKS - 1)
WORLD = Int(1, L.MAX_RANKS)
STEP = Int(0, L.MAX_STEP)
STEP_OR_NONE = Int(-1, L.MAX_STEP)
"""A step, or -1 for none."""
SLOT = Int(0, L.MAX_SLOTS - 1)
NBYTES = Int(0, L.MAX_SNAPSHOT_BYTES)
PID = Int(0, L.MAX_PID)
SECONDS = Float(0.0, 1e9)
REQUEST_ID = Int(0, (1 << 31) - 1)
"""The number a rank gives an ipc request, which its answer (reply or Error) carries back: 0 for none (messages
that answer no request, as slot updates and refusals of one-way messages)."""
