"""Frame 0 of the coordinator's hot replies: heartbeat replies joined from pieces packed once, plan answers packed
without building messages. Both go through :mod:`snapshotd.proto`'s fast paths (:class:`~snapshotd.proto.FramePacker`,
:class:`~snapshotd.proto.PlanReplyPacker`), so each is byte for byte what :func:`snapshotd.proto.encode` makes of
the same reply, after the same checks.

Nearly every heartbeat reply is the node's assignments (the same until membership changes) and the watermarks of
its jobs (the same for every node of a job until G or D moves). Encoding the whole reply per heartbeat would cost
more than everything else a heartbeat does, and every node's reply changes whenever its job's G moves. So frame 0
is joined from pieces instead: the assignments packed once per node (until they change), each job's watermark
packed once per job (until it changes), and the few scalar fields packed once per value; while none of a node's
pieces moved, its last frame goes out again as it is.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from snapshotd.proto import Assignment, FramePacker, HeartbeatReply, PlanReplyPacker, ProtocolError, Watermark
from snapshotd.proto.limits import MAX_HEADER_BYTES

from .plans import PlanAnswer

__all__ = ["HeartbeatReplies", "PlanReplies"]

_SCALARS_KEPT = 64  # packed scalar values kept (job names, intervals): a handful in practice


class HeartbeatReplies:
    """Frame 0 of cacheable heartbeat replies, from per-node and per-job pieces.

    Not thread-safe: one instance per server loop.
    """

    def __init__(self) -> None:
        self._packer = FramePacker(HeartbeatReply)
        self._assignments: dict[str, tuple[tuple[Assignment, ...], bytes]] = {}  # node -> (value, piece)
        self._watermarks: dict[str, tuple[Watermark, bytes]] = {}  # job -> (value, item piece)
        self._scalars: dict[tuple[str, type, Any], bytes] = {}  # (field, type, value) -> piece
        self._frames: dict[str, tuple[HeartbeatReply, bytes]] = {}  # node -> (last reply, its frame)
        self._no_seq = self._packer.piece("seq", 0)  # how a frame of pieces ends: ``seq`` is the last field

    def frame(self, node: str, reply: HeartbeatReply) -> bytes | None:
        """``encode(reply)[0]``, or None for a reply not worth caching (``known`` false, or carrying tasks) or
        over the header limit.

        Raises:
            ProtocolError: a piece breaks its spec, or the header its limit (as :func:`encode` would).
        """
        if not reply.known or reply.tasks:
            return None
        frame = self._frame(node, reply)[: -len(self._no_seq)] + self._packer.piece("seq", reply.seq)
        return frame if len(frame) <= MAX_HEADER_BYTES else None  # encode() then names what is over

    def _frame(self, node: str, reply: HeartbeatReply) -> bytes:
        """The frame of ``reply`` with ``seq`` at its default (the last field, replaced per reply)."""
        last = self._frames.get(node)
        if last is not None and _same(last[0], reply):  # nothing moved since this node's last reply
            return last[1]
        packer = self._packer
        frame = packer.frame(
            {  # ``known`` and ``tasks`` hold their defaults: true, none
                "job": self._scalar("job", reply.job),
                "assignments": self._packed_assignments(node, reply.assignments),
                "watermarks": packer.items(
                    "watermarks", [self._packed_watermark(w) for w in reply.watermarks]
                ),
                "heartbeat_interval": self._scalar("heartbeat_interval", reply.heartbeat_interval),
            }
        )
        self._frames[node] = (reply, frame)
        return frame

    def _packed_assignments(self, node: str, value: tuple[Assignment, ...]) -> bytes:
        hit = self._assignments.get(node)
        if hit is not None and (hit[0] is value or hit[0] == value):
            return hit[1]
        packed = self._packer.piece("assignments", value)
        self._assignments[node] = (value, packed)
        return packed

    def _packed_watermark(self, mark: Watermark) -> bytes:
        hit = self._watermarks.get(mark.job)
        if hit is not None and (hit[0] is mark or hit[0] == mark):
            return hit[1]
        packed = self._packer.piece("watermarks[]", mark)
        self._watermarks[mark.job] = (mark, packed)
        return packed

    def _scalar(self, name: str, value: Any) -> bytes:
        key = (name, type(value), value)
        packed = self._scalars.get(key)
        if packed is None:
            packed = self._packer.piece(name, value)
            if len(self._scalars) >= _SCALARS_KEPT:
                self._scalars.clear()
            self._scalars[key] = packed
        return packed


def _same(last: HeartbeatReply, reply: HeartbeatReply) -> bool:
    """Whether two cacheable replies hold the very same pieces: the state hands out the same assignment tuple
    and watermark objects while nothing moved, so identity (not equality, which costs as much as packing) says
    the frame is unchanged."""
    return (
        last.assignments is reply.assignments
        and last.heartbeat_interval == reply.heartbeat_interval
        and last.job == reply.job
        and len(last.watermarks) == len(reply.watermarks)
        and all(map(operator.is_, last.watermarks, reply.watermarks))
    )


class PlanReplies:
    """Frame 0 of plan replies, from the state's answers (see :class:`~snapshotd.proto.PlanReplyPacker`).

    Not thread-safe: one instance per server loop.
    """

    def __init__(self) -> None:
        self._packer = PlanReplyPacker()

    def frame(self, answer: PlanAnswer) -> bytes:
        """``encode(answer.reply())[0]``, packed from the answer's plans without building the reply.

        Raises:
            ProtocolError: the reply breaks a limit (too many ranks or sources, a header over its limit), as
                :func:`encode` would say.
        """
        if answer.waiting:
            return self._packer.wait(answer.job, answer.rank, answer.reason)
        return self._packer.pack(answer.job, answer.plans)

    def frames(self, answers: Sequence[PlanAnswer]) -> list[bytes | ProtocolError]:
        """:meth:`frame` of each of ``answers`` (none of them waiting), checked together, which costs less than
        one by one; an answer whose reply breaks a limit gets the error :meth:`frame` raises for it."""
        return self._packer.pack_many([(answer.job, answer.plans) for answer in answers])
