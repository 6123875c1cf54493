"""The message catalogue: every message type and its header fields.

Every message is a ZeroMQ multipart message. Frame 0 is a msgpack map with ``v`` (the protocol version),
``type`` and ``job`` plus the message's header fields; each further frame is a raw payload (a chunk of tensor
bytes, an encoded tensor table, a msgpack blob of non-tensor state). :mod:`.wire` encodes and decodes them.

Three conversations use these messages:

- ipc, a training rank and its node's sidecar: :class:`RegisterRank`, :class:`RankRegistered`,
  :class:`UnregisterRank`, :class:`Announce`, :class:`SlotUpdate`, :class:`RestoreRequest`, :class:`RestoreProgress`,
  :class:`RestoreFetch`, :class:`RestoreFetched`, :class:`RestoreReply`, and :class:`SeatRequest`,
  :class:`SeatReply`, :class:`PeerLostReport`, :class:`PeerLostReply` (also sidecar to coordinator).
- data plane, sidecar to sidecar: :class:`StreamBegin`, :class:`StreamAccept`, :class:`Chunk`,
  :class:`ChunkAck`, :class:`StreamAbort`, :class:`PullManifest`, :class:`PullRequest`, :class:`TicketRequest`,
  :class:`Ticket` (the bytes a ticket admits to go over a holder's bulk port instead: :mod:`.bulk`).
- control plane, sidecar to coordinator: :class:`RegisterSidecar`, :class:`SidecarRegistered`,
  :class:`Heartbeat`, :class:`HeartbeatReply`, :class:`PlanRequest`, :class:`PlanReply`,
  :class:`StatusRequest`, :class:`StatusReply`, :class:`MemberQuery`, :class:`MemberReply`, :class:`Drain`,
  :class:`DrainReply`; and from
  ``snapshotd export``: :class:`HoldersQuery`, :class:`HoldersReply`.

Any side may answer with :class:`Error`. A header field with a default may be left out of a header; every other
field must be there. A rank numbers its ipc requests that await an answer (:class:`RegisterRank`,
:class:`RestoreRequest`, :class:`SeatRequest`: ``request_id``), and the answer, reply or :class:`Error`, carries
the number back, so that the rank pairs them whatever else the sidecar sends meanwhile.
"""

from __future__ import annotations

from .control import (
    Drain,
    DrainReply,
    Error,
    Heartbeat,
    HeartbeatReply,
    HoldersQuery,
    HoldersReply,
    MemberQuery,
    MemberReply,
    PeerLostReply,
    PeerLostReport,
    PlanReply,
    PlanRequest,
    RegisterSidecar,
    SeatReply,
    SeatRequest,
    SidecarRegistered,
    StatusReply,
    StatusRequest,
)
from .dataplane import (
    Chunk,
    ChunkAck,
    PullManifest,
    PullRequest,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    Ticket,
    TicketRequest,
)
from .ipc import (
    Announce,
    RankRegistered,
    RegisterRank,
    RestoreFetch,
    RestoreFetched,
    RestoreProgress,
    RestoreReply,
    RestoreRequest,
    SlotUpdate,
    UnregisterRank,
)
from .message import Message

__all__ = [
    "MESSAGE_TYPES",
    "Message",
    "Announce",
    "Chunk",
    "ChunkAck",
    "Drain",
    "DrainReply",
    "Error",
    "Heartbeat",
    "HeartbeatReply",
    "HoldersQuery",
    "HoldersReply",
    "MemberQuery",
    "MemberReply",
    "PeerLostReply",
    "PeerLostReport",
    "PlanReply",
    "PlanRequest",
    "PullManifest",
    "PullRequest",
    "RankRegistered",
    "RegisterRank",
    "RegisterSidecar",
    "RestoreFetch",
    "RestoreFetched",
    "RestoreProgress",
    "RestoreReply",
    "RestoreRequest",
    "SeatReply",
    "SeatRequest",
    "SidecarRegistered",
    "SlotUpdate",
    "StatusReply",
    "StatusRequest",
    "StreamAbort",
    "StreamAccept",
    "StreamBegin",
    "Ticket",
    "TicketRequest",
    "UnregisterRank",
]

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        RegisterRank,
        RankRegistered,
        UnregisterRank,
        Announce,
        SlotUpdate,
        RestoreRequest,
        RestoreProgress,
        RestoreReply,
        RestoreFetch,
        RestoreFetched,
        StreamBegin,
        StreamAccept,
        Chunk,
        ChunkAck,
        StreamAbort,
        PullManifest,
        PullRequest,
        TicketRequest,
        Ticket,
        RegisterSidecar,
        SidecarRegistered,
        Heartbeat,
        HeartbeatReply,
        PlanRequest,
        PlanReply,
        StatusRequest,
        StatusReply,
        MemberQuery,
        MemberReply,
        HoldersQuery,
        HoldersReply,
        SeatRequest,
        SeatReply,
        PeerLostReport,
        PeerLostReply,
        Drain,
        DrainReply,
        Error,
    )
}
