"""RestoreProgress, the sidecar's word on a restore under way, and the RestoreRequest field that asks for it."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from snapshotd.proto import (
    LimitExceeded,
    MalformedMessage,
    RestoreProgress,
    RestoreRequest,
    UnknownMessageType,
    decode,
    encode,
)

PULL = RestoreProgress(
    job="run-42",
    rank=3,
    step=17,
    done_bytes=3 << 20,
    total_bytes=8 << 20,
    source="pull",
    sources=("tcp://10.0.0.2:7071", "tcp://10.0.0.3:7071"),
)


def test_round_trip() -> None:
    frames = encode(PULL)
    assert len(frames) == 1  # a header only
    back = decode(frames)
    assert back == PULL and isinstance(back, RestoreProgress)
    local = RestoreProgress(job="j", rank=0, step=1, done_bytes=0, total_bytes=1 << 30, source="local")
    assert decode(encode(local)) == local and local.sources == ()


@pytest.mark.parametrize(
    "change",
    [
        {"source": "fresh"},  # a fresh job moves no bytes: never told
        {"source": "disk"},
        {"done_bytes": -1},
        {"total_bytes": (1 << 40) + 1},  # past the largest snapshot a rank may have
        {"sources": tuple(f"tcp://10.0.0.{i}:7071" for i in range(65))},
        {"sources": ("x" * 10_000,)},
        {"step": -1},
    ],
)
def test_limits(change: dict) -> None:
    with pytest.raises((LimitExceeded, MalformedMessage)):
        encode(dataclasses.replace(PULL, **change))
    header = msgpack.unpackb(bytes(encode(PULL)[0]))
    header.update({k: list(v) if isinstance(v, tuple) else v for k, v in change.items()})
    with pytest.raises((LimitExceeded, MalformedMessage)):
        decode([msgpack.packb(header)])


def test_a_request_asks_for_progress_only_when_told_and_an_older_clients_request_does_not() -> None:
    plain = RestoreRequest(job="j", rank=0, world_size=2, timeout_s=30.0)
    assert plain.progress is False
    asking = dataclasses.replace(plain, progress=True)
    assert decode(encode(asking)) == asking
    header = msgpack.unpackb(bytes(encode(asking)[0]))
    assert header["progress"] is True
    del header["progress"]  # what a client of the previous version sends
    assert decode([msgpack.packb(header), b"", b""]) == plain


def test_a_peer_without_the_type_refuses_it_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the sidecar sends progress only to a rank that asked: a client that does not know the type would take
    every progress message for a malformed one."""
    from snapshotd.proto import messages, wire

    frames = encode(PULL)
    monkeypatch.delitem(messages.MESSAGE_TYPES, "restore_progress")
    monkeypatch.delitem(wire._LAYOUTS, "restore_progress", raising=False)
    with pytest.raises(UnknownMessageType):
        decode(frames)
