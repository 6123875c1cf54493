"""Chunk codecs: every codec round-trips every kind of data, raw is zero-copy, corruption is always caught."""

from __future__ import annotations

import math

import lz4.block
import numpy as np
import pytest
import xxhash

from snapshotd.proto import CODECS
from snapshotd.proto import limits as L
from snapshotd.proto.codec import breakeven_rate, checksum, compress_chunk, decompress_chunk, verify
from snapshotd.proto.errors import ChecksumMismatch, CodecError, ProtocolError

N = 1 << 16  # elements per generated tensor


def _fp32(seed: int, n: int = N) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)


def _bf16_bytes(x: np.ndarray) -> bytes:
    """bf16 is the top two bytes of an fp32 (little-endian: bytes 2 and 3)."""
    return np.ascontiguousarray(x.view(np.uint8).reshape(-1, 4)[:, 2:]).tobytes()


def _step(x: np.ndarray, seed: int) -> np.ndarray:
    """``x`` after a small optimizer-like update."""
    return x + (np.random.default_rng(seed).standard_normal(x.size) * 1e-5).astype(np.float32)


DATASETS = {
    "fp32": (_fp32(0).tobytes(), 4),
    "bf16": (_bf16_bytes(_fp32(1)), 2),
    "int64": (np.random.default_rng(2).integers(-1000, 1000, N, dtype=np.int64).tobytes(), 8),
    "bytes": (np.random.default_rng(3).integers(0, 256, 9999, dtype=np.uint8).tobytes(), 1),
}


def _roundtrip(codec: str, data: bytes, elem: int, base: bytes | None = None) -> tuple[str, int]:
    used, payload = compress_chunk(codec, memoryview(data), base=base, elem=elem)
    assert used in (codec, "raw")
    decoded = decompress_chunk(used, payload, len(data), base=base, elem=elem)
    assert decoded.format == "B" and decoded.nbytes == len(data)
    assert bytes(decoded) == data
    verify(decoded, checksum(data))
    return used, len(payload)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dataset", sorted(DATASETS))
@pytest.mark.parametrize("elem", [1, 2, 4, 8, 24])
def test_every_codec_roundtrips(codec: str, dataset: str, elem: int) -> None:
    data, _ = DATASETS[dataset]
    noise = np.random.default_rng(9).integers(0, 256, len(data), dtype=np.uint8)
    base = noise.tobytes() if codec == "delta-lz4" else None
    _roundtrip(codec, data, elem, base)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 4097])
@pytest.mark.parametrize("elem", [1, 2, 4, 8])
def test_odd_sizes_and_empty(codec: str, size: int, elem: int) -> None:
    data = bytes(range(size % 7, size % 7 + 1)) * size  # repetitive, so lz4 really encodes the larger ones
    base = bytes(reversed(data)) if codec == "delta-lz4" else None
    used, _ = _roundtrip(codec, data, elem, base)
    if size == 4097 and codec != "raw":
        assert used == codec


def test_shuffle_layout_is_byte_planes_with_the_tail_in_place() -> None:
    """The wire format: plane k holds byte k of every whole element; a partial element stays at the end."""
    data = bytes(range(10)) * 100 + b"\xaa\xbb\xcc"  # 1003 bytes: 250 elements of 4 + a 3-byte tail
    arr = np.frombuffer(data, dtype=np.uint8)
    shuffled = np.concatenate([arr[:1000].reshape(-1, 4).T.ravel(), arr[1000:]]).tobytes()
    payload = lz4.block.compress(shuffled, store_size=False)
    assert bytes(decompress_chunk("shuffle-lz4", payload, len(data), elem=4)) == data
    used, ours = compress_chunk("shuffle-lz4", memoryview(data), elem=4)
    assert used == "shuffle-lz4"
    assert lz4.block.decompress(ours, uncompressed_size=len(data)) == shuffled


def test_shuffle_helps_structured_data() -> None:
    data = np.arange(N, dtype=np.int64).tobytes()  # high bytes all zero
    _, plain = _roundtrip("lz4", data, 8)
    _, shuffled = _roundtrip("shuffle-lz4", data, 8)
    assert shuffled < plain < len(data)


@pytest.mark.parametrize("elem", [1, 2, 4])
def test_delta_against_previous_step_compresses(elem: int) -> None:
    prev = _fp32(5)
    cur = _step(prev, 6)
    data, base = (cur.tobytes(), prev.tobytes()) if elem != 2 else (_bf16_bytes(cur), _bf16_bytes(prev))
    used, size = _roundtrip("delta-lz4", data, elem, base)
    assert used == "delta-lz4"
    # The shuffled XOR of one small step is well under the raw size (DESIGN.md: 0.6 fp32, 0.2-0.4 bf16).
    if elem > 1:
        assert size < 0.8 * len(data)


def test_delta_of_identical_chunk_is_tiny() -> None:
    data = _fp32(7).tobytes()
    used, size = _roundtrip("delta-lz4", data, 4, data)
    assert used == "delta-lz4" and size < len(data) // 100


def test_incompressible_data_falls_back_to_raw_without_copy() -> None:
    data = bytearray(np.random.default_rng(8).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    view = memoryview(data)
    for codec in ("lz4", "shuffle-lz4"):
        used, payload = compress_chunk(codec, view, elem=4)
        assert used == "raw" and payload is view


def test_raw_is_zero_copy_both_ways() -> None:
    data = bytearray(b"x" * 1000)
    view = memoryview(data)
    used, payload = compress_chunk("raw", view)
    assert used == "raw" and payload is view
    decoded = decompress_chunk("raw", payload, len(data))
    assert np.shares_memory(np.frombuffer(decoded, np.uint8), np.frombuffer(data, np.uint8))
    data[0] = ord("y")
    assert decoded[0] == ord("y")


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_out(codec: str) -> None:
    prev = _fp32(10, 4096)
    data = _step(prev, 11).tobytes()
    base = prev.tobytes() if codec == "delta-lz4" else None
    used, payload = compress_chunk(codec, memoryview(data), base=base, elem=4)
    out = bytearray(len(data))
    decoded = decompress_chunk(used, payload, len(data), base=base, elem=4, out=memoryview(out))
    assert bytes(out) == data
    assert np.shares_memory(np.frombuffer(decoded, np.uint8), np.frombuffer(out, np.uint8))


@pytest.mark.parametrize("elem", [1, 4])
def test_delta_may_decode_over_its_own_base(elem: int) -> None:
    prev = _fp32(12, 4096)
    cur = prev.copy()
    cur[::10] += 1e-3  # a sparse change, so the XOR compresses even unshuffled
    data = cur.tobytes()
    used, payload = compress_chunk("delta-lz4", memoryview(data), base=prev.tobytes(), elem=elem)
    assert used == "delta-lz4"
    inplace = bytearray(prev.tobytes())
    decompress_chunk(used, payload, len(data), base=inplace, elem=elem, out=inplace)
    assert bytes(inplace) == data


def test_checksum_is_xxh3_64_and_buffer_type_independent() -> None:
    data = b"snapshotd" * 100
    want = xxhash.xxh3_64_intdigest(data)
    assert checksum(data) == checksum(bytearray(data)) == checksum(memoryview(data)) == want
    assert checksum(np.frombuffer(data, np.uint8)) == want
    verify(memoryview(data), want)


def test_corrupted_raw_payload_is_caught_by_checksum() -> None:
    data = bytearray(_fp32(14, 1024).tobytes())
    expected = checksum(data)
    data[100] ^= 0x01
    decoded = decompress_chunk("raw", data, len(data))
    with pytest.raises(ChecksumMismatch) as info:
        verify(decoded, expected)
    assert isinstance(info.value, ProtocolError)


def test_corrupted_lz4_payload_never_passes() -> None:
    """Every single-byte flip of a compressed chunk is a CodecError or a checksum mismatch: never silent."""
    data = (b"abcdefgh" * 64) + bytes(range(256)) * 4
    expected = checksum(data)
    used, payload = compress_chunk("lz4", memoryview(data))
    assert used == "lz4"
    caught_by_codec = caught_by_checksum = 0
    for i in range(len(payload)):
        bad = bytearray(payload)
        bad[i] ^= 0x55
        try:
            decoded = decompress_chunk("lz4", bad, len(data))
        except CodecError:
            caught_by_codec += 1
            continue
        with pytest.raises(ChecksumMismatch):
            verify(decoded, expected)
        caught_by_checksum += 1
    assert caught_by_codec > 0 and caught_by_checksum > 0


@pytest.mark.parametrize(
    ("payload", "raw_len"),
    [(b"", 10), (b"\xff" * 32, 100), (b"\x00", 5), (b"\xf0" + b"a" * 20, 1000)],
)
def test_bad_lz4_block_is_codec_error(payload: bytes, raw_len: int) -> None:
    for codec in ("lz4", "shuffle-lz4"):
        with pytest.raises(CodecError):
            decompress_chunk(codec, payload, raw_len, elem=4)


def test_wrong_lengths_are_codec_errors() -> None:
    data = b"q" * 4096
    used, payload = compress_chunk("lz4", memoryview(data))
    assert used == "lz4"
    for raw_len in (4095, 4097, 10**6, -1, L.MAX_CHUNK_BYTES + 1, 1 << 80):
        with pytest.raises(CodecError):
            decompress_chunk("lz4", payload, raw_len)
    with pytest.raises(CodecError):
        decompress_chunk("lz4", payload[:-3], len(data))
    with pytest.raises(CodecError):
        decompress_chunk("raw", data, len(data) + 1)


def test_bad_arguments_to_decode_are_codec_errors() -> None:
    data = _fp32(15, 1024).tobytes()
    used, payload = compress_chunk("delta-lz4", memoryview(data), base=bytes(len(data)), elem=4)
    assert used == "delta-lz4"
    bad_calls = [
        {"base": None},
        {"base": bytes(len(data) - 1)},
        {"elem": 0},
        {"elem": -3},
        {"out": bytearray(len(data) + 1)},
        {"out": bytes(len(data))},  # read-only
        {"out": "not a buffer"},
        {"base": 12345},
    ]
    for extra in bad_calls:
        kwargs = {"base": bytes(len(data)), "elem": 4, **extra}
        with pytest.raises(CodecError):
            decompress_chunk("delta-lz4", payload, len(data), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        decompress_chunk("zstd", payload, len(data))
    with pytest.raises(CodecError):
        decompress_chunk("lz4", 3.5, 10)  # type: ignore[arg-type]


def test_bad_arguments_to_encode_are_value_errors() -> None:
    view = memoryview(b"abcd" * 10)
    with pytest.raises(ValueError):
        compress_chunk("zstd", view)
    with pytest.raises(ValueError):
        compress_chunk("shuffle-lz4", view, elem=0)
    with pytest.raises(ValueError):
        compress_chunk("delta-lz4", view)
    with pytest.raises(ValueError):
        compress_chunk("delta-lz4", view, base=b"abc")


def test_breakeven_rate() -> None:
    # ratio 0.5, 1 GB/s each way: 0.5 / (1e-9 + 1e-9) = 2.5e8 B/s.
    assert breakeven_rate(0.5, 1e9, 1e9) == pytest.approx(2.5e8)
    assert breakeven_rate(0.0, 2e9, 2e9) == pytest.approx(1e9)
    assert breakeven_rate(1.0, 1e9, 1e9) == 0.0
    assert breakeven_rate(1.3, 1e9, 1e9) == 0.0
    assert breakeven_rate(0.5, math.inf, math.inf) == math.inf
    # At the break-even rate the encoded transfer takes exactly as long as the raw one.
    ratio, enc, dec = 0.3, 2e9, 5e9
    rate = breakeven_rate(ratio, enc, dec)
    assert 1 / enc + 1 / dec + ratio / rate == pytest.approx(1 / rate)
    for bad in [(-0.1, 1e9, 1e9), (0.5, 0.0, 1e9), (0.5, 1e9, -1.0), (math.nan, 1e9, 1e9)]:
        with pytest.raises(ValueError):
            breakeven_rate(*bad)
