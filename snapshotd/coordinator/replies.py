"""Heartbeat replies assembled from pieces packed once, and plan replies packed straight from their rows.

Nearly every heartbeat reply is the node's assignments (the same until membership changes) and the watermarks of
its jobs (the same for every node of a job until G or D moves). Encoding the whole reply per heartbeat would cost
more than everything else a heartbeat does, and every node's reply changes whenever its job's G moves. So frame 0
is joined from msgpack pieces instead: the assignments packed once per node (until they change), each job's
watermark packed once per job (until it changes), and the few scalar fields packed once per value; while none of
a node's pieces moved, its last frame goes out again as it is. The bytes are exactly those of
:func:`snapshotd.proto.encode`, and every piece passes the same spec checks before it is kept.

A plan reply for a sidecar's ranks (:func:`plan_frame`) is packed from the state's rows (the wire form of each
rank's plan) without building message objects: again exactly the bytes of :func:`~snapshotd.proto.encode`,
checked against the limits that values the coordinator made itself could break (the number of sources, the
header size); addresses and names were checked when they came in.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import msgpack

from snapshotd.proto import (
    PROTOCOL_VERSION,
    Assignment,
    HeartbeatReply,
    LimitExceeded,
    PlanReply,
    Watermark,
    omitted,
)
from snapshotd.proto.limits import MAX_HEADER_BYTES, MAX_PLAN_RANKS
from snapshotd.proto.schema import ListOf, Record, Spec

from .jobs import PlanRow

__all__ = ["HeartbeatReplies", "plan_frame"]

_SCALARS_KEPT = 64  # packed scalar values kept (job names, intervals): a handful in practice


def _spec(name: str) -> Spec:
    return HeartbeatReply.__dataclass_fields__[name].metadata["spec"]


class HeartbeatReplies:
    """Frame 0 of cacheable heartbeat replies, from per-node and per-job pieces.

    Not thread-safe: one instance per server loop.
    """

    def __init__(self) -> None:
        self._fields = [(f.name, f.metadata["spec"]) for f in dataclasses.fields(HeartbeatReply)]
        self._added = {f.name for f in dataclasses.fields(HeartbeatReply) if f.metadata.get("added")}
        packer = msgpack.Packer(use_bin_type=True)
        common = packer.pack("v") + packer.pack(PROTOCOL_VERSION) + packer.pack("type") + packer.pack(HeartbeatReply.TYPE)
        self._heads = [packer.pack_map_header(2 + n) + common for n in range(len(self._fields) + 1)]  # by field count
        self._keys = {name: packer.pack(name) for name, _ in self._fields}
        self._array_header = packer.pack_array_header
        self._assign_spec = _spec("assignments")
        self._mark_spec = _spec("watermarks")
        assert isinstance(self._mark_spec, ListOf) and isinstance(self._mark_spec.item, Record)
        self._mark_record: Record = self._mark_spec.item
        self._assignments: dict[str, tuple[tuple[Assignment, ...], bytes]] = {}  # node -> (value, packed)
        self._watermarks: dict[str, tuple[Watermark, bytes]] = {}  # job -> (value, packed record)
        self._scalars: dict[tuple[str, type, Any], bytes] = {}  # (field, type, value) -> packed value
        self._frames: dict[str, tuple[HeartbeatReply, bytes]] = {}  # node -> (last reply, its frame)

    def frame(self, node: str, reply: HeartbeatReply) -> bytes | None:
        """``encode(reply)[0]``, or None for a reply not worth caching (``known`` false, or carrying tasks).

        Raises:
            ProtocolError: a piece breaks its spec, or the header its limit (as :func:`encode` would).
        """
        if not reply.known or reply.tasks:
            return None
        last = self._frames.get(node)
        if last is not None and _same(last[0], reply):  # nothing moved since this node's last reply
            return last[1]
        pieces = [b""]  # the map header, once the fields are counted
        count = 0
        for name, spec in self._fields:
            if name in self._added and omitted(HeartbeatReply, name, getattr(reply, name)):
                continue
            count += 1
            pieces.append(self._keys[name])
            if name == "assignments":
                pieces.append(self._packed_assignments(node, reply.assignments))
            elif name == "watermarks":
                marks = reply.watermarks
                if len(marks) > self._mark_spec.max_items:
                    raise LimitExceeded(f"heartbeat_reply: {len(marks)} watermarks, at most {self._mark_spec.max_items}")
                pieces.append(self._array_header(len(marks)))
                pieces.extend(self._packed_watermark(w) for w in marks)
            else:
                pieces.append(self._packed_scalar(name, spec, getattr(reply, name)))
        pieces[0] = self._heads[count]
        frame = b"".join(pieces)
        if len(frame) > MAX_HEADER_BYTES:
            raise LimitExceeded(f"heartbeat_reply header is {len(frame)} bytes, at most {MAX_HEADER_BYTES}")
        self._frames[node] = (reply, frame)
        return frame

    def _packed_assignments(self, node: str, value: tuple[Assignment, ...]) -> bytes:
        hit = self._assignments.get(node)
        if hit is not None and (hit[0] is value or hit[0] == value):
            return hit[1]
        packed = _pack_checked(self._assign_spec, value, "heartbeat_reply.assignments")
        self._assignments[node] = (value, packed)
        return packed

    def _packed_watermark(self, mark: Watermark) -> bytes:
        hit = self._watermarks.get(mark.job)
        if hit is not None and (hit[0] is mark or hit[0] == mark):
            return hit[1]
        packed = _pack_checked(self._mark_record, mark, "heartbeat_reply.watermarks")
        self._watermarks[mark.job] = (mark, packed)
        return packed

    def _packed_scalar(self, name: str, spec: Spec, value: Any) -> bytes:
        key = (name, type(value), value)
        packed = self._scalars.get(key)
        if packed is None:
            packed = _pack_checked(spec, value, f"heartbeat_reply.{name}")
            if len(self._scalars) >= _SCALARS_KEPT:
                self._scalars.clear()
            self._scalars[key] = packed
        return packed


def _same(last: HeartbeatReply, reply: HeartbeatReply) -> bool:
    """Whether two cacheable replies hold the very same pieces: the state hands out the same assignment tuple
    and watermark objects while nothing moved, so identity (not equality, which costs as much as packing) says
    the frame is unchanged."""
    return (last.assignments is reply.assignments and last.heartbeat_interval == reply.heartbeat_interval
            and len(last.watermarks) == len(reply.watermarks)
            and all(map(operator.is_, last.watermarks, reply.watermarks)))  # fmt: skip


def _pack_checked(spec: Spec, value: Any, name: str) -> bytes:
    dumped = spec.dump(value)
    spec.check(dumped, name)
    return msgpack.packb(dumped, use_bin_type=True)


_SOURCES = PlanReply.__dataclass_fields__["sources"].metadata["spec"]
assert isinstance(_SOURCES, ListOf)
_MAX_SOURCES = _SOURCES.max_items


def plan_frame(job: str, rows: list[PlanRow]) -> bytes:
    """``encode(reply)[0]`` of the :class:`~snapshotd.proto.PlanReply` of ``job`` that carries ``rows``: the
    first as its own fields, the others as ``plans``.

    Raises:
        LimitExceeded: too many rows or sources, or a header over its limit (as :func:`encode` would).
    """
    if not 1 <= len(rows) <= MAX_PLAN_RANKS:
        raise LimitExceeded(f"plan_reply: {len(rows)} ranks, at least 1 and at most {MAX_PLAN_RANKS}")
    if max([len(row[4]) for row in rows]) > _MAX_SOURCES:
        raise LimitExceeded(f"plan_reply: a rank with more than {_MAX_SOURCES} sources")
    rank, status, step, local, sources, reason = rows[0]
    header = {"v": PROTOCOL_VERSION, "type": PlanReply.TYPE, "job": job, "rank": rank, "status": status,
              "step": step, "local": local, "sources": sources, "reason": reason}  # fmt: skip
    if len(rows) > 1:
        header["plans"] = rows[1:]
    frame: bytes = msgpack.packb(header, use_bin_type=True)
    if len(frame) > MAX_HEADER_BYTES:
        raise LimitExceeded(f"plan_reply header is {len(frame)} bytes, at most {MAX_HEADER_BYTES}")
    return frame
