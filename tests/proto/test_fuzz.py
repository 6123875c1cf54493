"""Property tests: whatever bytes a peer sends, the parsers raise only their own errors, and promptly.

``decode`` may raise :class:`ProtocolError` and nothing else; ``decode_table`` likewise; ``decompress_chunk``
only :class:`CodecError`. Anything ``decode`` accepts must be a message we would send ourselves: it re-encodes
and decodes to the same value. Examples are derandomized (the same on every run) and bounded in time.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import lz4.block
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotd.proto import CODECS, MESSAGE_TYPES, Message, decode, encode
from snapshotd.proto import limits as L
from snapshotd.proto.codec import checksum, compress_chunk, decompress_chunk
from snapshotd.proto.errors import CodecError, ProtocolError
from snapshotd.proto.manifest import decode_table, encode_table

from .test_messages import SAMPLES, TABLE

FUZZ = settings(
    max_examples=150,
    deadline=timedelta(milliseconds=200),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Values a hostile header may hold: every msgpack type, edge-of-range ints, and strings past every limit.
_HUGE_STRINGS = ["x" * (L.MAX_NAME_LEN + 1), "y" * (L.MAX_TEXT_LEN * 4 + 1), "z" * 300_000]
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.sampled_from([0, -1, 1 << 31, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(_HUGE_STRINGS),
    st.sampled_from(sorted(MESSAGE_TYPES) + list(CODECS)),
    st.binary(max_size=20),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_SAMPLE = st.sampled_from(SAMPLES)


def _check_decode(frames: list[Any]) -> None:
    """``decode`` either refuses with a ProtocolError or returns a message that survives a round trip."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert decode(encode(msg)) == msg


def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _frames_of(msg: Message, header: dict[str, Any]) -> list[Any]:
    return [_pack(header), *encode(msg)[1:]]


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=5))
def test_random_bytes_as_frames(frames: list[bytes]) -> None:
    _check_decode(frames)


@FUZZ
@given(st.dictionaries(st.text(max_size=12), _VALUES, max_size=8), _SAMPLE, st.integers(0, 3))
def test_random_headers(extra: dict[str, Any], sample: Message, nframes: int) -> None:
    header = {"v": L.PROTOCOL_VERSION, "type": sample.TYPE, **extra}
    _check_decode([_pack(header), *([b"payload"] * nframes)])


@FUZZ
@given(_SAMPLE, st.data())
def test_fields_replaced_deleted_or_added(sample: Message, data: st.DataObject) -> None:
    header = msgpack.unpackb(encode(sample)[0])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        op = data.draw(st.sampled_from(["replace", "delete", "add"]), label="op")
        key = data.draw(st.sampled_from(sorted(header)), label="key") if header else "v"
        if op == "replace":
            header[key] = data.draw(_VALUES, label="value")
        elif op == "delete":
            header.pop(key, None)
        else:
            header[data.draw(st.text(max_size=10), label="new key")] = data.draw(_VALUES, label="value")
    _check_decode(_frames_of(sample, header))


@FUZZ
@given(_SAMPLE, _VALUES, _VALUES)
def test_wrong_versions_and_types(sample: Message, version: Any, mtype: Any) -> None:
    header = msgpack.unpackb(encode(sample)[0])
    _check_decode(_frames_of(sample, header | {"v": version}))
    _check_decode(_frames_of(sample, header | {"type": mtype}))


@FUZZ
@given(_SAMPLE, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=6))
def test_flipped_header_bytes(sample: Message, flips: list[tuple[int, int]]) -> None:
    frames = list(encode(sample))
    head = bytearray(frames[0])
    for pos, mask in flips:
        head[pos % len(head)] ^= mask
    _check_decode([bytes(head), *frames[1:]])


@FUZZ
@given(_SAMPLE, st.integers(0, 1 << 20), st.integers(0, 4), st.lists(st.binary(max_size=50), max_size=3))
def test_truncated_headers_and_frame_lists(sample: Message, cut: int, keep: int, extra: list[bytes]) -> None:
    frames = list(encode(sample))
    _check_decode([frames[0][: cut % (len(frames[0]) + 1)], *frames[1:]])
    _check_decode(frames[:keep])
    _check_decode(frames + extra)


_ODD_FRAMES = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=10),
    st.lists(st.integers(0, 255), max_size=4),
    st.builds(lambda n: np.arange(n, dtype=np.float64), st.integers(0, 16)),
    st.builds(lambda n: np.zeros((n, 3), dtype=np.int16), st.integers(1, 5)),
)


@FUZZ
@given(_SAMPLE, _ODD_FRAMES, st.booleans())
def test_frames_of_odd_types(sample: Message, odd: Any, as_header: bool) -> None:
    frames: list[Any] = list(encode(sample))
    if as_header:
        frames[0] = odd
    else:
        frames.append(odd)
        if len(frames) > 2:
            del frames[1]
    _check_decode(frames)


def test_non_contiguous_frames_are_refused() -> None:
    header = encode(MESSAGE_TYPES["status_reply"]())[0]
    for frame in (np.zeros((4, 4), np.float32)[:, ::2], memoryview(b"abcd")[::2], np.zeros((0, 3), np.int16)):
        with pytest.raises(ProtocolError):
            decode([header, frame])


@pytest.mark.parametrize(
    "header",
    [
        {
            "v": L.PROTOCOL_VERSION,
            "type": "heartbeat",
            "node": "a",
            "incarnation": "i",
            "inventory": [None] * (L.MAX_HEADER_BYTES - 100),
        },
        {
            "v": L.PROTOCOL_VERSION,
            "type": "heartbeat",
            "node": "a",
            "incarnation": "i",
            "inventory": [["j", 0, 0, False]] * 150_000,
        },
        {"v": L.PROTOCOL_VERSION, "type": "heartbeat_reply", "tasks": [["j", 0, 0, ["x" * 200] * 64]] * 60},
        {
            "v": L.PROTOCOL_VERSION,
            "type": "error",
            "code": "internal",
            "message": "m" * (L.MAX_HEADER_BYTES - 100),
        },
    ],
    ids=["million-nils", "150k-records", "max-nested", "huge-text"],
)
def test_worst_case_headers_are_handled_promptly(header: dict[str, Any]) -> None:
    head = _pack(header)
    assert len(head) <= L.MAX_HEADER_BYTES
    start = time.perf_counter()
    with contextlib.suppress(ProtocolError):
        decode([head])
    # linear in the header's size, never worse (loose: CI shares 2 cores)
    assert time.perf_counter() - start < 10.0


def test_deep_nesting_is_refused_promptly() -> None:
    head = b"\x91" * (L.MAX_HEADER_BYTES // 2) + b"\xc0"  # half a million nested one-element arrays
    start = time.perf_counter()
    with pytest.raises(ProtocolError):
        decode([head])
    assert time.perf_counter() - start < 2.0


# -------------------------------------------------------------------------------------------- tensor table

_ENTRY = [list(e) for e in msgpack.unpackb(encode_table(TABLE))]


@FUZZ
@given(st.binary(max_size=400), st.one_of(st.none(), st.integers(0, 1 << 41)))
def test_table_random_bytes(buf: bytes, data_bytes: int | None) -> None:
    with contextlib.suppress(ProtocolError):
        decode_table(buf, data_bytes)


@FUZZ
@given(st.data())
def test_table_mutated_entries(data: st.DataObject) -> None:
    raw = [list(e) for e in _ENTRY]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        entry = data.draw(st.sampled_from(raw), label="entry")
        field = data.draw(st.integers(0, 4), label="field")
        entry[field] = data.draw(_VALUES, label="value")
    data_bytes = data.draw(st.one_of(st.none(), st.integers(0, 1 << 20)), label="data_bytes")
    try:
        entries = decode_table(_pack_table(raw), data_bytes)
    except ProtocolError:
        return
    assert decode_table(encode_table(entries), data_bytes) == entries


def _pack_table(raw: Any) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


# ------------------------------------------------------------------------------------------------- codecs

_BASE = np.tile(np.arange(64, dtype=np.float32), 32).tobytes()  # compresses under every codec and elem
_DATA = (np.frombuffer(_BASE, np.float32) + np.float32(0.5)).tobytes()


def _check_decompress(codec: Any, payload: Any, raw_len: Any, **kwargs: Any) -> memoryview | None:
    try:
        out = decompress_chunk(codec, payload, raw_len, **kwargs)
    except CodecError:
        return None
    assert isinstance(out, memoryview) and out.nbytes == raw_len
    return out


@FUZZ
@given(
    st.one_of(st.sampled_from(CODECS), st.text(max_size=12)),
    st.binary(max_size=300),
    st.one_of(st.integers(-10, 5000), st.sampled_from([L.MAX_CHUNK_BYTES + 1, 1 << 70, -(1 << 70)])),
    st.one_of(st.integers(-2, 20), st.sampled_from([33, 1 << 20, 1 << 40])),
    st.one_of(st.none(), st.binary(max_size=300)),
    st.booleans(),
)
def test_decompress_random_input(
    codec: str, payload: bytes, raw_len: int, elem: int, base: bytes | None, with_out: bool
) -> None:
    out = bytearray(raw_len) if with_out and 0 <= raw_len <= 5000 else None
    _check_decompress(codec, payload, raw_len, elem=elem, base=base, out=out)


@FUZZ
@given(
    st.sampled_from(["lz4", "shuffle-lz4", "delta-lz4"]),
    st.sampled_from([1, 2, 4]),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=4),
    st.integers(0, 1 << 20),
)
def test_decompress_mutated_payloads(codec: str, elem: int, flips: list[tuple[int, int]], cut: int) -> None:
    used, payload = compress_chunk(codec, memoryview(_DATA), base=_BASE, elem=elem)
    assert used == codec
    bad = bytearray(payload)
    for pos, mask in flips:
        bad[pos % len(bad)] ^= mask
    bad = bad[: len(bad) - cut % 8]
    decoded = _check_decompress(codec, bytes(bad), len(_DATA), base=_BASE, elem=elem)
    if decoded is not None and bytes(bad) == payload:
        assert checksum(decoded) == checksum(_DATA)


def test_lz4_block_that_claims_more_than_raw_len_is_refused() -> None:
    payload = lz4.block.compress(b"\x00" * 10_000, store_size=False)
    with pytest.raises(CodecError):
        decompress_chunk("lz4", payload, 100)
