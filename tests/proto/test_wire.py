"""FramePacker: frame 0 from pieces packed ahead, or from values without a message, is byte for byte what
``encode`` makes of the same message, and refuses exactly what ``encode`` refuses.

Messages are drawn field by field from each field's spec, with values inside and just outside its limits, and
records given either as objects or in their wire form.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotd.proto import (
    MESSAGE_TYPES,
    FramePacker,
    HeartbeatReply,
    LimitExceeded,
    MalformedMessage,
    Message,
    PlanReply,
    PlanReplyPacker,
    ProtocolError,
    RankPlan,
    Watermark,
    encode,
)
from snapshotd.proto import limits as L
from snapshotd.proto.compound import ListOf, Record
from snapshotd.proto.schema import Bool, Bytes, Enum, Float, Frame, Int, Opt, Spec, Str

PROPS = settings(
    max_examples=200,
    deadline=timedelta(milliseconds=500),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_PACKERS = {name: FramePacker(cls) for name, cls in MESSAGE_TYPES.items()}


def values(spec: Spec) -> st.SearchStrategy[Any]:
    """Python values of ``spec``: mostly valid, now and then just outside its limits or of another type."""
    if isinstance(spec, Int):
        edges = [spec.lo, spec.hi, spec.lo - 1, spec.hi + 1]
        return st.one_of(st.integers(max(spec.lo, -5), min(spec.hi, 1 << 40)), st.sampled_from(edges))
    if isinstance(spec, Float):
        return st.one_of(
            st.floats(spec.lo, min(spec.hi, 1e6)), st.sampled_from([spec.hi * 2, -1.0, float("nan")])
        )
    if isinstance(spec, Bool):
        return st.booleans()
    if isinstance(spec, Str):
        return st.one_of(st.text(max_size=12), st.just("s" * (spec.max_len + 1)))
    if isinstance(spec, Bytes):
        return st.one_of(st.binary(max_size=spec.max_len), st.just(b"b" * (spec.max_len + 1)))
    if isinstance(spec, Enum):
        return st.sampled_from([*spec.values, "bogus"])
    if isinstance(spec, Opt):
        return st.one_of(st.none(), values(spec.inner))
    if isinstance(spec, ListOf):
        most = min(spec.max_items, 4)
        small = st.lists(values(spec.item), max_size=most).map(tuple)
        return (
            small
            if spec.max_items > 8
            else st.one_of(
                small,
                st.lists(values(spec.item), min_size=spec.max_items + 1, max_size=spec.max_items + 1).map(
                    tuple
                ),
            )
        )
    if isinstance(spec, Record):
        return st.builds(spec.cls, *(values(s) for _, s in spec.fields))
    raise AssertionError(f"no strategy for {spec!r}")


def messages(cls: type[Message]) -> st.SearchStrategy[Message]:
    fields = {
        f.name: values(f.metadata["spec"])
        for f in dataclasses.fields(cls)
        if not isinstance(f.metadata["spec"], Frame)
    }
    return st.builds(cls, **fields)


_MESSAGES = st.sampled_from(sorted(MESSAGE_TYPES)).flatmap(lambda t: messages(MESSAGE_TYPES[t]))


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except ProtocolError as exc:
        return ("error", type(exc))


def header_values(msg: Message) -> dict[str, Any]:
    return {
        f.name: getattr(msg, f.name)
        for f in dataclasses.fields(msg)
        if not isinstance(f.metadata["spec"], Frame)
    }


def from_pieces(packer: FramePacker, msg: Message, *, items: bool) -> bytes:
    """Frame 0 of ``msg`` joined from a piece per field (list fields from their items' pieces with ``items``)."""
    pieces = {}
    for name, value in header_values(msg).items():
        if items and type(value) is tuple:
            pieces[name] = packer.items(name, [packer.piece(name + "[]", v) for v in value])
        else:
            pieces[name] = packer.piece(name, value)
    return packer.frame(pieces)


def wire_form(msg: Message) -> dict[str, Any]:
    """The header values of ``msg`` with records (and lists of records) in their wire form."""
    out = {}
    for f in dataclasses.fields(msg):
        spec = f.metadata["spec"]
        if isinstance(spec, ListOf) and isinstance(spec.item, Record):
            out[f.name] = [
                spec.item.dump(v) if dataclasses.is_dataclass(v) else v for v in getattr(msg, f.name)
            ]
        elif not isinstance(spec, Frame):
            out[f.name] = getattr(msg, f.name)
    return out


@PROPS
@given(_MESSAGES, st.booleans())
def test_frames_from_pieces_are_the_encoded_header(msg: Message, items: bool) -> None:
    packer = _PACKERS[msg.TYPE]
    expected = outcome(lambda: bytes(encode(msg)[0]))
    assert outcome(lambda: from_pieces(packer, msg, items=items)) == expected
    assert outcome(lambda: packer.pack(header_values(msg))) == expected
    assert outcome(lambda: packer.pack(wire_form(msg))) == expected


@PROPS
@given(_MESSAGES)
def test_fields_left_out_hold_their_defaults(msg: Message) -> None:
    packer = _PACKERS[msg.TYPE]
    given_values = {
        f.name: getattr(msg, f.name)
        for f in dataclasses.fields(msg)
        if not isinstance(f.metadata["spec"], Frame)
        and (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    }
    defaults = type(msg)(**given_values)  # type: ignore[arg-type]
    expected = outcome(lambda: bytes(encode(defaults)[0]))
    assert outcome(lambda: packer.pack(given_values)) == expected
    try:
        pieces = {name: packer.piece(name, v) for name, v in given_values.items()}
    except ProtocolError:
        assert expected[0] == "error"
    else:
        assert outcome(lambda: packer.frame(pieces)) == expected


def test_a_field_without_a_default_must_be_given() -> None:
    packer = FramePacker(PlanReply)
    with pytest.raises(MalformedMessage, match="'rank'"):
        packer.pack({"job": "j", "status": "wait"})
    with pytest.raises(MalformedMessage, match="'status'"):
        packer.frame({"rank": packer.piece("rank", 0)})


def test_pieces_name_the_field_and_items_keep_the_limit() -> None:
    packer = FramePacker(HeartbeatReply)
    with pytest.raises(LimitExceeded, match="heartbeat_reply.watermarks"):
        packer.piece("watermarks[]", Watermark("j", -2, 0))
    mark = packer.piece("watermarks[]", Watermark("j", 3, 2))
    assert packer.items("watermarks", [mark, mark]) == msgpack.packb([["j", 3, 2, []]] * 2)
    plans = FramePacker(PlanReply)
    row = [1, "ready", 5, True, ["tcp://a:1"], ""]
    with pytest.raises(LimitExceeded, match="plan_reply.plans"):
        plans.pack({"rank": 0, "status": "ready", "plans": [row] * L.MAX_PLAN_RANKS})
    with pytest.raises(MalformedMessage, match=r"plan_reply.plans\[0\].status"):
        plans.pack({"rank": 0, "status": "ready", "plans": [[1, "wait", 5, True, [], ""]]})
    assert plans.pack({"job": "j", "rank": 0, "status": "ready", "plans": [row]}) == bytes(
        encode(
            PlanReply(
                job="j", rank=0, status="ready", plans=(RankPlan(1, "ready", 5, True, ("tcp://a:1",), ""),)
            )
        )[0]
    )


_RANK_PLAN = Record(RankPlan)


def _fields(plan: RankPlan) -> tuple[Any, ...]:
    return tuple(getattr(plan, name) for name, _ in _RANK_PLAN.fields)


@PROPS
@given(st.lists(st.tuples(values(Str(L.MAX_NAME_LEN)), st.lists(values(_RANK_PLAN), max_size=4)), max_size=5))
def test_plan_replies_packed_together_are_each_the_encoded_header(
    replies: list[tuple[str, list[RankPlan]]],
) -> None:
    packer = PlanReplyPacker()
    frames = packer.pack_many([(job, [_fields(p) for p in plans]) for job, plans in replies])
    assert len(frames) == len(replies)
    for (job, plans), frame in zip(replies, frames, strict=True):
        got = ("error", type(frame)) if isinstance(frame, ProtocolError) else ("ok", frame)
        if not plans:
            assert got == ("error", LimitExceeded)
            continue
        expected = outcome(lambda job=job, plans=plans: bytes(encode(PlanReply.of(job, plans))[0]))
        assert got == expected
        assert outcome(lambda job=job, plans=plans: packer.pack(job, [_fields(p) for p in plans])) == expected


def test_a_reply_that_breaks_a_limit_does_not_keep_the_others_from_being_packed() -> None:
    good = [(1, "ready", 5, True, ("tcp://a:1",), ""), (2, "none", -1, False, (), "gone")]
    crowded = [(3, "ready", 5, False, tuple(f"tcp://n{i}:1" for i in range(65)), "")]
    first, bad, last = PlanReplyPacker().pack_many([("j", good), ("j", crowded), ("k", good[:1])])
    assert first == bytes(encode(PlanReply.of("j", [RankPlan(*p) for p in good]))[0])
    assert isinstance(bad, LimitExceeded) and "sources" in str(bad)
    assert last == bytes(encode(PlanReply.of("k", [RankPlan(*good[0])]))[0])
    wait = PlanReplyPacker().wait("j", 4, "3 of 8 ranks accounted for")
    assert wait == bytes(
        encode(PlanReply(job="j", rank=4, status="wait", reason="3 of 8 ranks accounted for"))[0]
    )
