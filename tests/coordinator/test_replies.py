"""Heartbeat replies joined from cached pieces are byte for byte what ``encode`` produces, and track changes."""

from __future__ import annotations

import pytest

from snapshotd.coordinator.replies import HeartbeatReplies
from snapshotd.proto import (
    Assignment,
    HeartbeatReply,
    ProtocolError,
    ReplicateTask,
    Watermark,
    decode,
    encode,
)
from snapshotd.proto import limits as L


def assignments(node: int, ranks: int = 8) -> tuple[Assignment, ...]:
    return tuple(
        Assignment(job="j", rank=node * ranks + r, buddies=(f"tcp://10.0.0.{node + 1}:7071",))
        for r in range(ranks)
    )


def check(replies: HeartbeatReplies, node: str, reply: HeartbeatReply) -> bytes:
    frame = replies.frame(node, reply)
    assert frame is not None and frame == bytes(encode(reply)[0])
    assert decode([frame]) == reply
    return frame


def test_pieces_join_to_the_encoded_reply_as_watermarks_and_assignments_move() -> None:
    replies = HeartbeatReplies()
    for step in range(3):
        for node in range(4):  # every node of the job gets the job's new watermark, packed once
            marks = (
                Watermark(job="j", recoverable=step, durable=step - 1),
                Watermark(job="k", recoverable=-1, durable=-1),
            )
            check(replies, f"n{node}", HeartbeatReply(assignments=assignments(node), watermarks=marks))
    moved = HeartbeatReply(
        assignments=assignments(2, ranks=3), watermarks=(Watermark(job="j", recoverable=5, durable=4),)
    )
    check(replies, "n0", moved)  # new assignments for n0
    check(replies, "n0", HeartbeatReply())  # nothing assigned, no job
    many = tuple(Watermark(job=f"job-{i}", recoverable=i, durable=i) for i in range(40))  # array16 header
    check(replies, "n1", HeartbeatReply(assignments=assignments(1, ranks=20), watermarks=many))
    check(replies, "n1", HeartbeatReply(job="j", watermarks=many[:15]))


def test_equal_but_new_objects_reuse_the_pieces() -> None:
    replies = HeartbeatReplies()
    first = check(
        replies, "n", HeartbeatReply(assignments=assignments(0), watermarks=(Watermark("j", 3, 2),))
    )
    again = replies.frame("n", HeartbeatReply(assignments=assignments(0), watermarks=(Watermark("j", 3, 2),)))
    assert again == first


def test_unknown_replies_and_replies_with_tasks_are_not_joined() -> None:
    replies = HeartbeatReplies()
    assert replies.frame("n", HeartbeatReply(known=False)) is None
    task = ReplicateTask(job="j", rank=1, step=2, sources=("tcp://a:1",))
    assert replies.frame("n", HeartbeatReply(assignments=assignments(0), tasks=(task,))) is None


def test_a_piece_that_breaks_its_spec_raises_like_encode() -> None:
    replies = HeartbeatReplies()
    bad = HeartbeatReply(watermarks=(Watermark(job="x" * (L.MAX_NAME_LEN + 1), recoverable=1, durable=1),))
    with pytest.raises(ProtocolError):
        encode(bad)
    with pytest.raises(ProtocolError):
        replies.frame("n", bad)
    too_far = HeartbeatReply(assignments=(Assignment(job="j", rank=L.MAX_RANKS, buddies=()),))
    with pytest.raises(ProtocolError):
        replies.frame("n", too_far)
    check(replies, "n", HeartbeatReply(assignments=assignments(0)))  # nothing bad was kept


def test_a_reply_of_the_same_pieces_is_the_nodes_last_frame_and_any_new_piece_makes_a_new_one() -> None:
    replies = HeartbeatReplies()
    placed, mark = assignments(0), Watermark("j", 3, 2)
    check(replies, "n", HeartbeatReply(assignments=placed, watermarks=(mark,), seq=1))
    joined = replies._frames["n"]
    # only seq differs
    check(replies, "n", HeartbeatReply(assignments=placed, watermarks=(mark,), seq=1 << 40))
    assert replies._frames["n"] is joined  # its pieces were not joined again
    check(replies, "n", HeartbeatReply(assignments=placed, watermarks=(mark,), heartbeat_interval=2.5))
    check(replies, "n", HeartbeatReply(assignments=placed, watermarks=(Watermark("j", 4, 2),)))
    check(replies, "n", HeartbeatReply(assignments=placed, watermarks=(mark, Watermark("k", 1, 1))))
    check(replies, "n", HeartbeatReply(assignments=assignments(0, ranks=2), watermarks=(mark,)))
    check(replies, "m", HeartbeatReply(assignments=placed, watermarks=(mark,)))  # per node
