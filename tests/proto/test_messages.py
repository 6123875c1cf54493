"""Typed messages: every type round-trips, payload frames are never copied, limits hold both ways."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import snapshotd.proto
from snapshotd.proto import (
    MESSAGE_TYPES,
    Announce,
    Assignment,
    Chunk,
    ChunkAck,
    Drain,
    DrainReply,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    HoldersQuery,
    HoldersReply,
    InventoryItem,
    MemberQuery,
    MemberReply,
    Message,
    PeerLostReply,
    PeerLostReport,
    PlanReply,
    PlanRequest,
    PullManifest,
    PullRequest,
    RankInfo,
    RankPlan,
    RankRegistered,
    RegisterRank,
    RegisterSidecar,
    ReplicateTask,
    RestoreFetch,
    RestoreFetched,
    RestoreProgress,
    RestoreReply,
    RestoreRequest,
    SeatReply,
    SeatRequest,
    SidecarRegistered,
    SlotUpdate,
    StatusReply,
    StatusRequest,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    Ticket,
    TicketRequest,
    UnregisterRank,
    Watermark,
    decode,
    encode,
)
from snapshotd.proto import limits as L
from snapshotd.proto.errors import (
    LimitExceeded,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
)
from snapshotd.proto.manifest import CheckedTables, TensorEntry, decode_table, encode_table, table_data_bytes

TABLE = [
    TensorEntry("model/embed.weight", "bfloat16", (1000, 64), 0, 128_000),
    TensorEntry("optim/state.0.exp_avg", "float32", (1000, 64), 128_000, 256_000),
    TensorEntry("optim/state.0.step", "float32", (), 384_000, 4),
    TensorEntry("empty", "int64", (0, 3), 384_004, 0),
]
META = msgpack.packb({"sched": {"last_epoch": 7}, "rng": [1, 2, 3]})
ADDR = "tcp://10.0.0.2:41000"


def sample_messages() -> list[Message]:
    """One representative instance of every message type, with nested records and non-empty frames."""
    table = encode_table(TABLE)
    return [
        RegisterRank(job="run-42", rank=3, world_size=8, pid=4242, data_bytes=1 << 30, slots=2),
        RankRegistered(
            job="run-42", rank=3, arena="/dev/shm/snapshotd-run-42-3", slot_bytes=1 << 30, slots=2, pid=4242
        ),
        UnregisterRank(job="run-42", rank=3),
        Announce(
            job="run-42", rank=3, step=17, slot=1, table_id=2, step_seconds=0.25, table=table, meta=META
        ),
        SlotUpdate(job="run-42", rank=3, free_slots=(0, 1), durable_step=16, note="buddy slow"),
        RestoreRequest(job="run-42", rank=3, world_size=8, timeout_s=30.0, fetch=True),
        RestoreFetch(
            job="run-42",
            rank=3,
            step=17,
            fetch=(1 << 62) - 1,
            data_bytes=384_004,
            chunk_bytes=1 << 20,
            arena="/dev/shm/snapshotd-run-42-3b",
            slot_bytes=1 << 20,
            slots=2,
            slot=1,
            holders=("10.0.0.2:40001", "[fd00::3]:40002"),
            table=table,
            tokens=bytes(range(32)),
        ),
        RestoreFetched(
            job="run-42",
            rank=3,
            step=17,
            fetch=5,
            ok=True,
            direct=True,
            fetched=384_004,
            sums=(7).to_bytes(8, "little"),
        ),
        RestoreProgress(
            job="run-42",
            rank=3,
            step=17,
            done_bytes=1 << 19,
            total_bytes=1 << 20,
            source="pull",
            sources=("tcp://10.0.0.2:7071",),
        ),
        RestoreReply(
            job="run-42",
            rank=3,
            step=17,
            source="pull",
            arena="/dev/shm/snapshotd-run-42-3b",
            slot_bytes=1 << 20,
            slot=1,
            bytes_pulled=1 << 20,
            seconds=1.5,
            table=table,
            meta=META,
        ),
        StreamBegin(
            job="run-42",
            rank=3,
            step=17,
            src_node="node-a",
            data_bytes=384_004,
            chunk_bytes=1 << 20,
            digest=(1 << 64) - 1,
            table=table,
            meta=META,
        ),
        StreamAccept(job="run-42", rank=3, step=17, bases=(15, 16)),
        TicketRequest(job="run-42", rank=3, step=17),
        Ticket(job="run-42", rank=3, step=17, port=40001, expires_s=30.0, token=bytes(range(16))),
        Chunk(
            job="run-42",
            rank=3,
            step=17,
            index=5,
            codec="delta-lz4",
            raw_len=1 << 20,
            checksum=(1 << 64) - 1,
            base_step=16,
            elem=4,
            payload=b"\x01\x02\x03" * 100,
        ),
        ChunkAck(job="run-42", rank=3, step=17, index=5, complete=True),
        StreamAbort(job="run-42", rank=3, step=17, reason="memory limit"),
        PullManifest(job="run-42", rank=3, step=17),
        PullRequest(job="run-42", rank=3, step=17, first=8, count=16),
        RegisterSidecar(node="node-a", rack="r1", data_addr=ADDR, incarnation="b3f9"),
        SidecarRegistered(heartbeat_interval=0.5),
        Heartbeat(
            node="node-a",
            incarnation="b3f9",
            changed=True,
            ranks=(RankInfo("run-42", 3, 8, 4242, True), RankInfo("run-7", 0, 1, 99, False)),
            inventory=(InventoryItem("run-42", 3, 17, True), InventoryItem("run-42", 5, 16, False)),
            bytes_out=10**12,
            bytes_in=5,
            stored_bytes=1 << 40,
        ),
        HeartbeatReply(
            known=True,
            assignments=(Assignment("run-42", 3, (ADDR, "tcp://10.0.0.3:41000")),),
            watermarks=(Watermark("run-42", 16, 15), Watermark("run-7", -1, -1)),
            tasks=(ReplicateTask("run-42", 5, 16, (ADDR,)),),
        ),
        PlanRequest(job="run-42", rank=3, world_size=8, node="node-a", ranks=(2, 7)),
        PlanReply(
            job="run-42",
            rank=3,
            status="ready",
            step=16,
            local=False,
            sources=(ADDR,),
            reason="",
            plans=(RankPlan(2, "ready", 16, True, (), ""), RankPlan(7, "none", -1, False, (), "gone")),
        ),
        StatusRequest(),
        StatusReply(body=msgpack.packb({"nodes": ["node-a"]})),
        MemberQuery(host="10.0.0.2"),
        MemberReply(host="10.0.0.2", member=True, node="node-a"),
        HoldersQuery(job="run-42", step=16, first=0, count=2),
        HoldersReply(
            job="run-42",
            step=16,
            world_size=2,
            recoverable=17,
            durable=16,
            first=0,
            sources=((ADDR, "tcp://10.0.0.3:41000"), ()),
        ),
        SeatRequest(job="run-42", world_size=16, per_node=8, node="node-a", timeout_s=600.0),
        SeatReply(job="run-42", status="given", first=8),
        PeerLostReport(job="run-42", rank=3, node="node-a"),
        PeerLostReply(job="run-42", probed=2),
        Drain(node="node-a", incarnation="c0ffee"),
        DrainReply(remaining=3, unplaceable=1),
        Error(job="run-42", code="not_found", message="no such snapshot", rank=3, step=17),
    ]


SAMPLES = sample_messages()


def test_samples_cover_every_message_type() -> None:
    assert sorted(m.TYPE for m in SAMPLES) == sorted(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_roundtrip(msg: Message) -> None:
    frames = encode(msg)
    assert len(frames) == 1 + len(getattr(msg, "FRAMES", ()))
    assert decode(frames) == msg
    # As they arrive from a socket: bytes, or zmq.Frame objects.
    assert decode([bytes(f) for f in frames]) == msg
    assert decode([zmq.Frame(bytes(f)) for f in frames]) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_header_carries_version_type_and_job(msg: Message) -> None:
    header = msgpack.unpackb(encode(msg)[0])
    assert header["v"] == L.PROTOCOL_VERSION and header["type"] == msg.TYPE and header["job"] == msg.job


def test_defaults_may_be_left_out_on_the_wire() -> None:
    header = {
        "v": L.PROTOCOL_VERSION,
        "type": "chunk",
        "rank": 1,
        "step": 2,
        "index": 3,
        "raw_len": 4,
        "checksum": 5,
    }
    msg = decode([msgpack.packb(header), b"abcd"])
    assert isinstance(msg, Chunk)
    assert (msg.job, msg.codec, msg.base_step, msg.elem, bytes(msg.payload)) == ("", "raw", -1, 1, b"abcd")


def test_nchunks() -> None:
    begin = StreamBegin(rank=0, step=1, src_node="a", data_bytes=10, chunk_bytes=4, digest=0)
    assert begin.nchunks == 3
    assert dataclasses.replace(begin, data_bytes=8).nchunks == 2
    assert dataclasses.replace(begin, data_bytes=0).nchunks == 0


def test_payload_frames_are_not_copied() -> None:
    buf = bytearray(np.arange(1 << 20, dtype=np.float32).tobytes())
    msg = Chunk(rank=0, step=1, index=0, raw_len=len(buf), checksum=0, payload=memoryview(buf))
    frames = encode(msg)
    assert frames[1] is msg.payload
    got = decode(frames)
    assert isinstance(got, Chunk) and isinstance(got.payload, memoryview)
    assert np.shares_memory(np.frombuffer(got.payload, np.uint8), np.frombuffer(buf, np.uint8))
    buf[0] = 0xAB
    assert got.payload[0] == 0xAB
    # A zmq.Frame's buffer is not copied either.
    frame = zmq.Frame(buf)
    got = decode([frames[0], frame])
    assert isinstance(got, Chunk)
    assert np.shares_memory(np.frombuffer(got.payload, np.uint8), np.frombuffer(frame.buffer, np.uint8))


def test_payload_frames_of_any_buffer_format_become_byte_views() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = decode([encode(StatusReply())[0], memoryview(arr)])
    assert isinstance(got, StatusReply)
    assert got.body.format == "B" and got.body.nbytes == arr.nbytes  # type: ignore[union-attr]
    assert bytes(got.body) == arr.tobytes()


# ----------------------------------------------------------------------------------------- encode refuses


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        (ChunkAck(rank=-1, step=0, index=0), LimitExceeded),
        (ChunkAck(rank=L.MAX_RANKS, step=0, index=0), LimitExceeded),
        (ChunkAck(rank=0, step=L.MAX_STEP + 1, index=0), LimitExceeded),
        (ChunkAck(rank="0", step=0, index=0), MalformedMessage),  # type: ignore[arg-type]
        (ChunkAck(rank=0, step=0, index=0, complete=1), MalformedMessage),  # type: ignore[arg-type]
        (ChunkAck(rank=True, step=0, index=0), MalformedMessage),
        (ChunkAck(job="j" * (L.MAX_NAME_LEN + 1), rank=0, step=0, index=0), LimitExceeded),
        (Chunk(rank=0, step=0, index=0, raw_len=0, checksum=1 << 64), LimitExceeded),
        (Chunk(rank=0, step=0, index=0, raw_len=0, checksum=0, codec="zstd"), MalformedMessage),
        (Chunk(rank=0, step=0, index=0, raw_len=0, checksum=0, elem=0), LimitExceeded),
        (SlotUpdate(rank=0, free_slots=tuple(range(L.MAX_SLOTS + 1)), durable_step=0), LimitExceeded),
        (RestoreRequest(rank=0, world_size=1, timeout_s=float("nan")), MalformedMessage),
        (RestoreRequest(rank=0, world_size=1, timeout_s=-1.0), LimitExceeded),
        (PlanReply(rank=0, status="maybe"), MalformedMessage),
        (Error(code=ErrorCode.INTERNAL, message="m" * (L.MAX_TEXT_LEN + 1)), LimitExceeded),
        (Error(code="x"), MalformedMessage),  # type: ignore[arg-type]
        (RegisterSidecar(node="a", data_addr="t" * (L.MAX_ADDRESS_LEN + 1), incarnation="i"), LimitExceeded),
        (HeartbeatReply(watermarks=(Watermark("j", -2, 0),)), LimitExceeded),
        (Heartbeat(node="a", incarnation="i", ranks=(RankInfo("j", 0, 0, 1, True),)), LimitExceeded),
        (StreamBegin(rank=0, step=0, src_node="a", data_bytes=1, chunk_bytes=0, digest=0), LimitExceeded),
        (StreamBegin(rank=0, step=0, src_node="a", data_bytes=1, chunk_bytes=4095, digest=0), LimitExceeded),
    ],
)
def test_encode_refuses_out_of_limit_values(msg: Message, error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        encode(msg)


def test_encode_refuses_oversized_frames_and_headers() -> None:
    big = bytearray(L.MAX_CHUNK_BYTES + 1)  # untouched pages: cheap
    with pytest.raises(LimitExceeded):
        encode(Chunk(rank=0, step=0, index=0, raw_len=0, checksum=0, payload=big))
    items = tuple(InventoryItem("j" * L.MAX_NAME_LEN, 0, 0, False) for _ in range(L.MAX_HEADER_BYTES // 200))
    with pytest.raises(LimitExceeded):
        encode(Heartbeat(node="a", incarnation="i", inventory=items))


# ----------------------------------------------------------------------------------------- decode refuses


def _header(msg: Message) -> dict[str, Any]:
    return msgpack.unpackb(encode(msg)[0])


def _with(msg: Message, **changes: Any) -> list[bytes]:
    header = _header(msg) | changes
    return [msgpack.packb(header), *(bytes(f) for f in encode(msg)[1:])]


CHUNK = SAMPLES[[m.TYPE for m in SAMPLES].index("chunk")]


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([], MalformedMessage),
        ([b"\xc1"], MalformedMessage),  # not msgpack
        ([msgpack.packb([1, "chunk"])], MalformedMessage),  # not a map
        ([msgpack.packb({1: 2})], MalformedMessage),  # int keys
        (_with(CHUNK, v=L.PROTOCOL_VERSION + 1), UnsupportedVersion),
        (_with(CHUNK, v=True), UnsupportedVersion),
        (_with(CHUNK, v=float(L.PROTOCOL_VERSION)), UnsupportedVersion),
        (_with(CHUNK, type="nope"), UnknownMessageType),
        (_with(CHUNK, type=["chunk"]), UnknownMessageType),
        (_with(CHUNK, surprise=1), MalformedMessage),
        (_with(CHUNK, rank=-5), LimitExceeded),
        (_with(CHUNK, rank=(1 << 64) - 1), LimitExceeded),
        (_with(CHUNK, rank=None), MalformedMessage),
        (_with(CHUNK, codec=b"raw"), MalformedMessage),
        (_with(CHUNK, job="j" * 10_000), LimitExceeded),
        (_with(CHUNK, payload=b"in the header"), MalformedMessage),
        (encode(CHUNK)[:1], MalformedMessage),  # payload frame missing
        ([*encode(CHUNK), b"extra"], MalformedMessage),
        ([encode(CHUNK)[0], 42], MalformedMessage),  # not a buffer
        ([encode(CHUNK)[0], bytes(L.MAX_CHUNK_BYTES + 1)], LimitExceeded),
        ([b"\x00" * (L.MAX_HEADER_BYTES + 1)], LimitExceeded),
    ],
)
def test_decode_refuses(frames: list[Any], error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        decode(frames)


def test_decode_refuses_missing_required_field() -> None:
    header = _header(CHUNK)
    del header["checksum"]
    with pytest.raises(MalformedMessage, match="checksum"):
        decode([msgpack.packb(header), b""])


def test_decode_refuses_bad_nested_records() -> None:
    reply = SAMPLES[[m.TYPE for m in SAMPLES].index("heartbeat_reply")]
    header = _header(reply)
    for bad in ([["run-42", 3]], [["run-42", 3, "not a list"]], [{"job": "x"}], "x", [["j", 0, [1]]]):
        with pytest.raises(ProtocolError):
            decode([msgpack.packb(header | {"assignments": bad})])


# ------------------------------------------------------------------------------------------ tensor table


def test_table_roundtrip() -> None:
    buf = encode_table(TABLE)
    assert decode_table(buf) == TABLE
    assert decode_table(memoryview(buf), data_bytes=table_data_bytes(TABLE)) == TABLE
    assert table_data_bytes(TABLE) == 384_004
    assert decode_table(encode_table([])) == [] and table_data_bytes([]) == 0


def test_checked_tables_validate_a_table_once_and_refuse_what_decode_table_refuses() -> None:
    buf, other = encode_table(TABLE), encode_table(TABLE[:1])
    checked = CheckedTables(max_bytes=len(buf) + len(other))
    size = table_data_bytes(TABLE)
    checked.check(memoryview(buf), size)
    checked.check(buf, size)  # remembered: passes without a parse
    assert list(checked._seen) == [(buf, size)]
    with pytest.raises(MalformedMessage):  # the same table against a smaller buffer is checked anew
        checked.check(buf, size - 1)
    with pytest.raises(MalformedMessage):
        checked.check(buf[:-1], size)
    checked.check(other, size)
    checked.check(encode_table(TABLE[:2]), size)  # over max_bytes: the oldest goes
    assert (buf, size) not in checked._seen and (other, size) in checked._seen


@pytest.mark.parametrize(
    "raw",
    [
        [["a", "float33", [2], 0, 8]],  # unknown dtype
        [["a", "float32", [2], 0, 4]],  # nbytes != numel * size
        [["a", "float32", [2], -8, 8]],  # negative offset
        [["a", "float32", [2.0], 0, 8]],  # non-int dim
        [["a", "float32", [-2], 0, -8]],
        [["a", "float32", [1] * (L.MAX_TENSOR_NDIM + 1), 0, 4]],
        [["a", "float32", [2], 0]],  # short entry
        [[b"a", "float32", [2], 0, 8]],  # bytes path
        [["a", "float32", [2], 0, True]],
        ["a"],
        {"a": 1},
        "not a list",
    ],
)
def test_table_rejects_inconsistent_entries(raw: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_table(msgpack.packb(raw))


def test_table_rejects_ranges_past_the_data_and_garbage() -> None:
    buf = encode_table(TABLE)
    with pytest.raises(MalformedMessage, match="past the data buffer"):
        decode_table(buf, data_bytes=table_data_bytes(TABLE) - 1)
    with pytest.raises(MalformedMessage):
        decode_table(buf[:-1])
    with pytest.raises(LimitExceeded):
        decode_table(bytes(L.MAX_TABLE_BYTES + 1))


def test_public_names_exist() -> None:
    assert len(set(snapshotd.proto.__all__)) == len(snapshotd.proto.__all__)
    for name in snapshotd.proto.__all__:
        assert hasattr(snapshotd.proto, name), name
    wanted = {
        "checksum",
        "verify",
        "compress_chunk",
        "decompress_chunk",
        "breakeven_rate",
        "encode",
        "decode",
    }
    assert wanted <= set(snapshotd.proto.__all__)
    for cls in MESSAGE_TYPES.values():
        assert getattr(snapshotd.proto, cls.__name__) is cls and cls.__name__ in snapshotd.proto.__all__


# Fields that peers of an earlier build might not know were folded into their messages before the first release:
# each is an ordinary field, always in the header; a default lets a header leave it out.
FOLDED = [
    (Watermark, "unusable", ()),
    (RankRegistered, "pid", None),
    (RestoreReply, "direct", False),
    (StreamBegin, "window", 0),
    (ChunkAck, "count", 1),
    (HeartbeatReply, "heartbeat_interval", 0.0),
    (PlanRequest, "ranks", ()),
    (PlanReply, "plans", ()),
]


@pytest.mark.parametrize(("cls", "name", "default"), FOLDED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_folded_fields_are_ordinary_fields(cls: type, name: str, default: Any) -> None:
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    assert set(field.metadata) == {"spec"}
    if default is None:
        assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    else:
        assert field.default == default
    sample = next(m for m in SAMPLES if isinstance(m, cls) or any(isinstance(w, cls) for w in _records(m)))
    if isinstance(sample, cls):  # a message field: in the header even when it holds its default
        assert name in _header(sample)


def _records(msg: Message) -> list[Any]:
    return [
        r
        for f in dataclasses.fields(msg)
        for r in (getattr(msg, f.name) if type(getattr(msg, f.name)) is tuple else ())
    ]


def test_a_field_with_a_default_is_sent_and_may_be_left_out() -> None:
    plain = HeartbeatReply(watermarks=(Watermark(job="j", recoverable=3, durable=2),))
    header = msgpack.unpackb(bytes(encode(plain)[0]))
    assert header["heartbeat_interval"] == 0.0 and header["watermarks"] == [["j", 3, 2, []]]
    assert decode(encode(plain)) == plain
    del header["heartbeat_interval"]
    assert decode([msgpack.packb(header)]) == plain  # left out: the default
    stretched = dataclasses.replace(plain, heartbeat_interval=2.5)
    assert msgpack.unpackb(bytes(encode(stretched)[0]))["heartbeat_interval"] == 2.5
    assert decode(encode(stretched)) == stretched
    with pytest.raises(LimitExceeded):
        encode(dataclasses.replace(plain, heartbeat_interval=7200.0))


def test_a_rank_registered_without_the_sidecars_pid_is_refused() -> None:
    header = _header(SAMPLES[[m.TYPE for m in SAMPLES].index("rank_registered")])
    del header["pid"]
    with pytest.raises(MalformedMessage, match="pid"):
        decode([msgpack.packb(header)])


def test_a_plan_request_for_one_rank_and_its_reply() -> None:
    single = PlanRequest(job="j", rank=3, world_size=8, node="a")
    assert msgpack.unpackb(bytes(encode(single)[0]))["ranks"] == []
    assert single.all_ranks == (3,) and decode(encode(single)) == single
    reply = PlanReply(job="j", rank=3, status="ready", step=5, local=True)
    assert msgpack.unpackb(bytes(encode(reply)[0]))["plans"] == []
    assert reply.answers() == (RankPlan(3, "ready", 5, True, (), ""),)
    assert PlanReply.of("j", reply.answers()) == reply
    batch = PlanRequest(job="j", rank=3, world_size=8, node="a", ranks=(0, 1))
    assert msgpack.unpackb(bytes(encode(batch)[0]))["ranks"] == [0, 1] and batch.all_ranks == (3, 0, 1)
    many = PlanReply.of("j", [RankPlan(r, "ready", 5, r == 3, (ADDR,), "") for r in (3, 0, 1)])
    assert many.rank == 3 and [p.rank for p in many.plans] == [0, 1] and many.answers()[0].local


# ------------------------------------------------------------------------------------------- error codes


def test_every_error_code_round_trips_as_its_member() -> None:
    for code in ErrorCode:
        got = decode(encode(Error(code=code, message="m")))
        assert isinstance(got, Error) and got.code is code
        assert msgpack.unpackb(bytes(encode(got)[0]))["code"] == code.value  # a plain string on the wire
    assert decode(encode(Error(code="busy"))) == Error(code=ErrorCode.BUSY)  # type: ignore[arg-type]


def test_an_unknown_error_code_is_a_malformed_message() -> None:
    header = _header(Error(code=ErrorCode.NOT_FOUND))
    for bad in ("no_such_code", "", "BUSY", 3, None):
        with pytest.raises(MalformedMessage, match="code"):
            decode([msgpack.packb(header | {"code": bad})])


def test_error_codes_are_documented_and_cover_every_code_the_repository_sends() -> None:
    assert {c.value for c in ErrorCode} == {
        "bad_message",
        "unexpected",
        "internal",
        "busy",
        "not_registered",
        "plan_timeout",
        "not_recoverable",
        "pull_failed",
        "not_found",
        "memory_limit",
        "bad_chunk",
        "corrupt",
    }
    source = (Path(snapshotd.proto.__file__).parent / "errors.py").read_text()
    for code in ErrorCode:
        assert f'{code.name} = "{code.value}"\n    """' in source, f"{code.name} has no docstring"


def test_plan_batches_are_bounded() -> None:
    too_many = tuple(range(L.MAX_PLAN_RANKS))  # with ``rank``, one more than a request may carry
    with pytest.raises(LimitExceeded):
        encode(PlanRequest(job="j", rank=0, world_size=L.MAX_RANKS, node="a", ranks=too_many))
    header = msgpack.unpackb(
        bytes(encode(PlanRequest(job="j", rank=0, world_size=8, node="a", ranks=(1,)))[0])
    )
    header["ranks"] = list(too_many)
    with pytest.raises(LimitExceeded):
        decode([msgpack.packb(header)])
    with pytest.raises(MalformedMessage):
        decode(
            encode(
                PlanReply(job="j", rank=0, status="ready", plans=(RankPlan(1, "wait", -1, False, (), ""),))
            )
        )


WIRE_FINGERPRINTS = {2: "e56fb00ca401741a"}
"""The wire of each protocol version (:func:`~snapshotd.proto.wire.wire_fingerprint`)."""


def test_the_wire_changes_only_with_a_new_protocol_version() -> None:
    from snapshotd.proto.wire import wire_fingerprint

    assert WIRE_FINGERPRINTS.get(L.PROTOCOL_VERSION) == wire_fingerprint(), (
        "the messages' fields changed: bump PROTOCOL_VERSION in proto/limits.py and record the new fingerprint "
        "in WIRE_FINGERPRINTS (peers of the old build then refuse this one by name)"
    )


def test_a_message_of_another_protocol_version_is_refused_naming_both() -> None:
    frames = encode(UnregisterRank(job="j", rank=0))
    header = msgpack.unpackb(frames[0])
    header["v"] = L.PROTOCOL_VERSION - 1
    with pytest.raises(
        ProtocolError,
        match=rf"protocol version {L.PROTOCOL_VERSION - 1}; this build speaks {L.PROTOCOL_VERSION}",
    ):
        decode([msgpack.packb(header), *frames[1:]])
