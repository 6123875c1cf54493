"""Messages to frames and back: :func:`encode`, :func:`decode`, and :class:`FramePacker` for hot replies.

:func:`encode` and :func:`decode` never copy a payload frame: memoryviews go in and memoryviews come out, so a
4 MiB chunk costs the same to encode as a 16-byte one. Both run the same field checks: a process never sends what
its peer would refuse.

:func:`encode` checks and packs every field of a message each time. A process that sends the same field values
again and again (the coordinator's heartbeat replies: a node's buddy assignments until membership changes, a
job's watermark until it moves, to every node of the job) packs each value once with :meth:`FramePacker.piece`
and joins frame 0 from those pieces with :meth:`FramePacker.frame`; one that has the values but not the message
(the coordinator's plan answers) packs them with :meth:`FramePacker.pack`, which builds no message and no
records. Every value passes the checks that :func:`encode` runs on it, and every frame is byte for byte
``encode(msg)[0]`` of the message holding those values. A value is given as a message holds it; a record, or a
list of records, may also be given in its wire form (a list of its field values, as a peer sends it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from . import limits as L
from .compound import ListOf, Record
from .errors import LimitExceeded, MalformedMessage, ProtocolError, UnknownMessageType, UnsupportedVersion
from .fields import Buffer
from .messages import MESSAGE_TYPES, Message, PlanReply
from .records import RankPlanFields
from .schema import Frame, Spec

__all__ = ["FramePacker", "PlanReplyPacker", "decode", "encode", "wire_fingerprint"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    """How one message type sits on the wire.

    ``header``: the header fields in field order (the order :func:`encode` packs them in); ``frames``: the payload
    frames in order; ``defaults``: the value of each header field a header may leave out.
    """

    header: tuple[tuple[str, Spec], ...]
    frames: tuple[tuple[str, Frame], ...]
    defaults: dict[str, Any]
    allowed: frozenset[str]  # keys a header may carry


def _layout(cls: type[Message]) -> _Layout:
    header: list[tuple[str, Spec]] = []
    frames: list[tuple[str, Frame]] = []
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata["spec"]
        if isinstance(spec, Frame):
            frames.append((f.name, spec))
            continue
        header.append((f.name, spec))
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    names = {name for name, _ in header}
    return _Layout(tuple(header), tuple(frames), defaults, frozenset(names | {"v", "type"}))


_LAYOUTS = {name: _layout(cls) for name, cls in MESSAGE_TYPES.items()}


def wire_fingerprint() -> str:
    """A digest of every message type's fields (name, type, header or payload frame, in wire order): it changes
    whenever the wire does, and ``tests/proto/test_messages.py`` pins it to :data:`PROTOCOL_VERSION`, so that a
    change of the wire comes with a new version (and peers of different builds refuse each other by name)."""
    parts = [
        f"{name}:"
        + ",".join(f"{f.name}/{f.type}/{type(f.metadata['spec']).__name__}" for f in dataclasses.fields(cls))
        for name, cls in sorted(MESSAGE_TYPES.items())
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


_ABSENT: Any = object()


class FramePacker:
    """Packs pieces of one message type's header and joins them into frame 0.

    Args:
        cls: the message type.
    """

    def __init__(self, cls: type[Message]) -> None:
        lay = _LAYOUTS[cls.TYPE]
        packer = msgpack.Packer(use_bin_type=True)
        self._pack = packer.pack
        self._array_header = packer.pack_array_header
        self._type = cls.TYPE
        self._specs: dict[str, Spec] = {}
        self._max_items: dict[str, int] = {}
        for name, spec in lay.header:
            self._specs[name] = spec
            if isinstance(spec, ListOf):
                self._specs[name + "[]"] = spec.item
                self._max_items[name] = spec.max_items
        self._keys = tuple((name, self._pack(name)) for name, _ in lay.header)
        self._head = (
            packer.pack_map_header(2 + len(lay.header))
            + self._pack("v")
            + self._pack(L.PROTOCOL_VERSION)
            + self._pack("type")
            + self._pack(cls.TYPE)
        )
        self._header = tuple((name, spec, f"{cls.TYPE}.{name}") for name, spec in lay.header)
        self._names = {name: f"{cls.TYPE}.{name}" for name in self._specs}
        self._defaults = {name: self.piece(name, value) for name, value in lay.defaults.items()}
        self._default_values = lay.defaults

    def pack(self, values: Mapping[str, Any]) -> bytes:
        """Frame 0 of the message whose header fields hold ``values`` (their defaults where ``values`` has none),
        each checked as :func:`encode` checks it; builds no message.

        Raises:
            ProtocolError: a value breaks its field's spec, a field without a default has no value, or the header
                is over :data:`~.limits.MAX_HEADER_BYTES`.
        """
        header: dict[str, Any] = {"v": L.PROTOCOL_VERSION, "type": self._type}
        for name, spec, path in self._header:
            value = values.get(name, _ABSENT)
            if value is _ABSENT:
                value = self._default_values.get(name, _ABSENT)
                if value is _ABSENT:
                    raise MalformedMessage(f"{self._type}: missing field {name!r}")
            dumped = spec.dump(value)
            spec.verify(dumped, path)
            header[name] = dumped
        frame: bytes = msgpack.packb(header, use_bin_type=True)
        if len(frame) > L.MAX_HEADER_BYTES:
            raise LimitExceeded(f"{self._type} header is {len(frame)} bytes, at most {L.MAX_HEADER_BYTES}")
        return frame

    def piece(self, field: str, value: Any) -> bytes:
        """``value`` of header field ``field`` (or, as ``field[]``, one item of list field ``field``), checked as
        :func:`~.wire.encode` checks it, and packed.

        Raises:
            ProtocolError: ``value`` breaks the field's spec.
            KeyError: the message has no such field.
        """
        spec = self._specs[field]
        dumped = spec.dump(value)
        spec.verify(dumped, self._names[field])
        packed: bytes = self._pack(dumped)
        return packed

    def items(self, field: str, pieces: Sequence[bytes]) -> bytes:
        """The piece of list field ``field`` holding the items packed as ``pieces`` (see :meth:`piece`), in order.

        Raises:
            LimitExceeded: more items than the field holds.
        """
        limit = self._max_items[field]
        if len(pieces) > limit:
            raise LimitExceeded(f"field '{self._type}.{field}': {len(pieces)} items, at most {limit}")
        return self._array_header(len(pieces)) + b"".join(pieces)

    def frame(self, pieces: Mapping[str, bytes]) -> bytes:
        """Frame 0 of the message whose header fields hold the values of ``pieces``, and their defaults where
        ``pieces`` has none.

        Raises:
            MalformedMessage: a field without a default has no piece.
            LimitExceeded: the header is over :data:`~.limits.MAX_HEADER_BYTES`.
        """
        parts = [self._head]
        for name, key in self._keys:
            piece = pieces.get(name)
            if piece is None:
                piece = self._defaults.get(name)
                if piece is None:
                    raise MalformedMessage(f"{self._type}: missing field {name!r}")
            parts.append(key)
            parts.append(piece)
        frame = b"".join(parts)
        if len(frame) > L.MAX_HEADER_BYTES:
            raise LimitExceeded(f"{self._type} header is {len(frame)} bytes, at most {L.MAX_HEADER_BYTES}")
        return frame


_PACKERS = {name: FramePacker(cls) for name, cls in MESSAGE_TYPES.items()}
_PLAN_FIELDS = 6  # the fields of a RankPlan


class PlanReplyPacker:
    """Frame 0 of :class:`~.messages.PlanReply` messages from their ranks' plans: the reply a recovery round sends
    by the thousand.

    A frame is ``encode(PlanReply.of(job, [RankPlan(*p) for p in plans]))[0]`` after the same checks, without
    building the reply or its records: every plan, the first too, is checked as a record of the reply's ``plans``
    (one pass per field over all of them), which covers the first plan's top-level fields as well, since each
    :class:`~.records.RankPlan` field's spec admits no more than the top-level field of the same name.
    :meth:`pack_many` checks the plans of many replies in those same passes, which is what makes a reply cheap.
    """

    def __init__(self) -> None:
        self._generic = _PACKERS[PlanReply.TYPE]
        header = dict(_LAYOUTS[PlanReply.TYPE].header)
        plans, self._job = header["plans"], header["job"]
        assert isinstance(plans, ListOf) and isinstance(plans.item, Record)
        self._record: Record = plans.item

    def pack(self, job: str, plans: Sequence[RankPlanFields]) -> bytes:
        """Frame 0 of the reply of ``job`` carrying ``plans``: the first in the top-level fields, the others in
        ``plans``.

        Args:
            plans: at least one; each rank's plan as the fields of a :class:`~.records.RankPlan`.

        Raises:
            ProtocolError: the reply breaks a limit or a field its spec, as :func:`encode` would say.
        """
        (frame,) = self.pack_many([(job, plans)])
        if isinstance(frame, ProtocolError):
            raise frame
        return frame

    def pack_many(
        self, replies: Sequence[tuple[str, Sequence[RankPlanFields]]]
    ) -> list[bytes | ProtocolError]:
        """:meth:`pack` of each ``(job, plans)`` of ``replies``, in order; a reply that breaks a limit or a spec
        gets the error :meth:`pack` raises for it, and does not keep the others from being packed."""
        checked = (
            all([1 <= len(plans) <= L.MAX_PLAN_RANKS for _, plans in replies])
            and self._job.valid_column([job for job, _ in replies])
            and self._record.valid_column(list(itertools.chain.from_iterable(plans for _, plans in replies)))
        )
        out: list[bytes | ProtocolError] = []
        for job, plans in replies:
            if checked:
                frame: bytes = msgpack.packb(
                    {"v": L.PROTOCOL_VERSION, "type": PlanReply.TYPE, **self._fields(job, plans)},
                    use_bin_type=True,
                )
                if len(frame) <= L.MAX_HEADER_BYTES:
                    out.append(frame)
                    continue
            try:  # raises the precise error, or packs what the checks above could not vouch for (a ``wait``)
                out.append(self._generic.pack(self._values(job, plans)))
            except ProtocolError as exc:
                out.append(exc)
        return out

    def wait(self, job: str, rank: int, reason: str) -> bytes:
        """Frame 0 of the reply telling the request whose first rank is ``rank`` to wait, and why."""
        return self._generic.pack({"job": job, "rank": rank, "status": "wait", "reason": reason})

    @staticmethod
    def _values(job: str, plans: Sequence[RankPlanFields]) -> dict[str, Any]:
        if not plans:
            raise LimitExceeded("plan_reply: no plans; a reply carries at least one rank's plan")
        first = plans[0]
        if len(first) != _PLAN_FIELDS:
            raise MalformedMessage(f"plan_reply: a plan has {len(first)} fields, not {_PLAN_FIELDS}")
        return PlanReplyPacker._fields(job, plans)

    @staticmethod
    def _fields(job: str, plans: Sequence[RankPlanFields]) -> dict[str, Any]:
        """The header fields of a reply of ``plans`` (at least one, each of the right length)."""
        rank, status, step, local, sources, reason = plans[0]
        return {
            "job": job,
            "rank": rank,
            "status": status,
            "step": step,
            "local": local,
            "sources": sources,
            "reason": reason,
            "plans": plans[1:],
        }


def encode(msg: Message) -> list[Buffer]:
    """The frames of ``msg``: a msgpack header holding every header field, then each payload frame as given
    (never copied).

    Raises:
        ProtocolError: a field violates its spec (we never send what we would refuse to receive).
    """
    layout = _LAYOUTS[msg.TYPE]
    out: list[Buffer] = [_PACKERS[msg.TYPE].pack({name: getattr(msg, name) for name, _ in layout.header})]
    for name, fspec in layout.frames:
        value = getattr(msg, name)
        fspec.check(value, name)
        out.append(value)
    return out


def _as_view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is None:
        buf = frame
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
    except TypeError as exc:
        raise MalformedMessage(f"frame of type {type(frame).__name__} is not a buffer") from exc
    if not view.c_contiguous:
        raise MalformedMessage("frame is not a contiguous buffer")
    if view.ndim != 1 or view.itemsize != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise MalformedMessage(f"frame cannot be read as bytes: {exc}") from exc
    return view


def decode(frames: Sequence[Any]) -> Message:
    """Parse and validate one multipart message.

    Args:
        frames: bytes, memoryviews or ``zmq.Frame`` objects; payload frames come back as memoryviews of them.

    Raises:
        ProtocolError: and nothing else, for any input.
    """
    if not isinstance(frames, Sequence) or len(frames) == 0:
        raise MalformedMessage("a message needs at least a header frame")
    head = _as_view(frames[0])
    if head.nbytes > L.MAX_HEADER_BYTES:
        raise LimitExceeded(f"header frame is {head.nbytes} bytes, at most {L.MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=L.MAX_TEXT_LEN * 4,
            max_bin_len=L.MAX_HEADER_BYTES,
            max_array_len=L.MAX_LIST_ITEMS,
            max_map_len=1024,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError, TypeError ...)
        raise MalformedMessage(f"header is not a valid msgpack map: {exc}") from exc
    if type(header) is not dict:
        raise MalformedMessage(f"header is a msgpack {type(header).__name__}, not a map")
    version = header.get("v")
    if version != L.PROTOCOL_VERSION or type(version) is not int:
        raise UnsupportedVersion(f"protocol version {version!r}; this build speaks {L.PROTOCOL_VERSION}")
    mtype = header.get("type")
    if type(mtype) is not str or mtype not in MESSAGE_TYPES:
        raise UnknownMessageType(f"unknown message type {mtype!r}")
    cls = MESSAGE_TYPES[mtype]
    layout = _LAYOUTS[mtype]
    if len(frames) != 1 + len(layout.frames):
        raise MalformedMessage(f"{mtype} has {len(layout.frames)} payload frames, got {len(frames) - 1}")
    if not header.keys() <= layout.allowed:
        unknown = header.keys() - layout.allowed
        raise MalformedMessage(f"{mtype}: unknown header fields {sorted(map(str, unknown))[:5]}")
    kwargs: dict[str, Any] = {}
    for name, spec in layout.header:
        value = header.get(name, _ABSENT)
        if value is not _ABSENT:
            kwargs[name] = spec.check(value, name)
        elif name not in layout.defaults:
            raise MalformedMessage(f"{mtype}: missing field {name!r}")
    for (name, fspec), frame in zip(layout.frames, frames[1:], strict=True):
        kwargs[name] = fspec.check(_as_view(frame), name)
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except Exception as exc:  # defensive: a dataclass should never refuse validated values
        raise MalformedMessage(f"{mtype}: {exc}") from exc
