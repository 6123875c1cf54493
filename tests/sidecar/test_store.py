"""The buddy store: memory reservation, chunk verification and adoption, completion, abort, retention, the limit."""

from __future__ import annotations

import time

import numpy as np
import pytest

from snapshotd.proto import ChecksumMismatch, CodecError, ProtocolError, blob_digest, checksum, compress_chunk
from snapshotd.sidecar.chunks import ADOPT_MIN_BYTES
from snapshotd.sidecar.integrity import Seal
from snapshotd.sidecar.store import MemoryLimitReached, SnapshotStore, UnknownSnapshot

JOB = "job"
CHUNK = 4096


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def begin(store: SnapshotStore, step: int, data_bytes: int, *, rank: int = 0, job: str = JOB) -> None:
    store.begin(
        job,
        rank,
        step,
        src_node="A",
        data_bytes=data_bytes,
        chunk_bytes=CHUNK,
        table=b"t" * 10,
        meta=b"m" * 6,
        digest=blob_digest(b"t" * 10, b"m" * 6),
    )


def put(store: SnapshotStore, step: int, data: np.ndarray, index: int, *, rank: int = 0) -> bool:
    part = data.data[index * CHUNK : (index + 1) * CHUNK]
    return store.put_chunk(
        JOB,
        rank,
        step,
        index,
        codec_name="raw",
        payload=part,
        raw_len=part.nbytes,
        checksum=checksum(part),
        base_step=-1,
        elem=1,
    )


def fill(store: SnapshotStore, step: int, data: np.ndarray, *, rank: int = 0) -> None:
    begin(store, step, data.nbytes, rank=rank)
    nchunks = -(-data.nbytes // CHUNK)
    done = [put(store, step, data, i, rank=rank) for i in range(nchunks)]
    assert done == [False] * (nchunks - 1) + [True]


def test_snapshot_is_complete_only_when_every_chunk_is_verified() -> None:
    changes: list[int] = []
    store = SnapshotStore(1 << 20, on_change=lambda: changes.append(1))
    data = payload(3 * CHUNK + 100, 1)  # a short last chunk
    begin(store, 5, data.nbytes)
    assert store.used_bytes == data.nbytes + 16
    for i in (2, 0, 3):  # out of order, and one chunk twice: neither completes it early
        assert put(store, 5, data, i) is False
    assert put(store, 5, data, 0) is False
    with pytest.raises(UnknownSnapshot, match="not complete"):
        store.get(JOB, 0, 5)
    assert store.steps(JOB, 0) == [] and store.complete_keys() == [] and not changes
    assert put(store, 5, data, 1) is True
    assert changes == [1]  # the set of complete copies changed: once
    snap = store.get(JOB, 0, 5)
    assert snap.complete and snap.nchunks == 4 and snap.missing == 0
    assert snap.data.tobytes() == data.tobytes()
    assert (snap.table, snap.meta, snap.src_node) == (b"t" * 10, b"m" * 6, "A")
    assert store.steps(JOB, 0) == [5] and store.complete_keys() == [(JOB, 0, 5)]
    assert changes == [1]
    assert put(store, 5, data, 1) is False  # a late duplicate after completion changes nothing


def test_zero_byte_snapshot_is_complete_at_begin() -> None:
    store = SnapshotStore(1 << 20)
    begin(store, 1, 0)
    snap = store.get(JOB, 0, 1)
    assert snap.complete and snap.nchunks == 0 and snap.data_bytes == 0
    assert store.used_bytes == 16


def test_bad_chunks_are_refused_and_never_count() -> None:
    store = SnapshotStore(1 << 20)
    data = payload(2 * CHUNK, 2)
    begin(store, 1, data.nbytes)
    good = data.data[:CHUNK]

    def put_raw(index: int, part: memoryview, digest: int, raw_len: int | None = None) -> bool:
        size = part.nbytes if raw_len is None else raw_len
        return store.put_chunk(
            JOB,
            0,
            1,
            index,
            codec_name="raw",
            payload=part,
            checksum=digest,
            raw_len=size,
            base_step=-1,
            elem=1,
        )

    with pytest.raises(ChecksumMismatch):
        put_raw(0, good, checksum(good) ^ 1)
    with pytest.raises(ProtocolError, match="outside"):
        put_raw(2, good, checksum(good))
    with pytest.raises(ProtocolError, match="expected 4096 B"):
        put_raw(0, good[:100], checksum(good[:100]))
    with pytest.raises(CodecError):
        store.put_chunk(
            JOB,
            0,
            1,
            0,
            codec_name="lz4",
            payload=memoryview(b"\xff" * 64),
            raw_len=CHUNK,
            checksum=0,
            base_step=-1,
            elem=1,
        )
    snap = store.get(JOB, 0, 1, complete=False)
    assert snap.missing == 2 and not snap.received.any()
    # a retry with the right bytes still completes it
    assert put(store, 1, data, 0) is False and put(store, 1, data, 1) is True


def test_chunk_for_unknown_or_aborted_stream_is_refused() -> None:
    store = SnapshotStore(1 << 20)
    data = payload(CHUNK, 3)
    with pytest.raises(UnknownSnapshot, match="not held"):
        put(store, 1, data, 0)
    begin(store, 1, data.nbytes)
    store.abort(JOB, 0, 1)
    assert len(store) == 0 and store.used_bytes == 0
    with pytest.raises(UnknownSnapshot):
        put(store, 1, data, 0)


def test_abort_keeps_complete_snapshots() -> None:
    store = SnapshotStore(1 << 20)
    data = payload(CHUNK, 4)
    fill(store, 1, data)
    store.abort(JOB, 0, 1)
    assert store.steps(JOB, 0) == [1]


def test_begin_replaces_an_incomplete_copy_and_keeps_a_complete_one() -> None:
    store = SnapshotStore(1 << 20)
    data = payload(2 * CHUNK, 5)
    begin(store, 1, data.nbytes)
    put(store, 1, data, 0)
    begin(store, 1, data.nbytes)  # the sender restarted the stream: nothing of the old one counts
    assert store.get(JOB, 0, 1, complete=False).missing == 2
    assert store.used_bytes == data.nbytes + 16
    put(store, 1, data, 0)
    put(store, 1, data, 1)
    before = store.get(JOB, 0, 1)
    begin(store, 1, 999)
    assert store.get(JOB, 0, 1) is before and store.used_bytes == data.nbytes + 16


def test_memory_limit_refuses_new_streams_and_keeps_what_is_held() -> None:
    store = SnapshotStore(3 * CHUNK + 100)
    data = payload(2 * CHUNK, 6)
    fill(store, 1, data)
    with pytest.raises(MemoryLimitReached, match=r"memory limit 12388 B reached.*step 2 needs"):
        begin(store, 2, 2 * CHUNK)
    assert store.steps(JOB, 0) == [1] and len(store) == 1
    assert store.get(JOB, 0, 1).data.tobytes() == data.tobytes()
    begin(store, 2, CHUNK)  # a smaller one still fits
    assert store.used_bytes == 3 * CHUNK + 32


def test_drop_unneeded_follows_the_watermark_and_spares_pinned_and_other_jobs() -> None:
    store = SnapshotStore(1 << 20)
    data = payload(CHUNK, 7)
    for step in (1, 2, 3, 4, 5):
        fill(store, step, data)
    fill(store, 1, data, rank=1)
    begin(store, 4, data.nbytes, rank=1)
    begin(store, 4, data.nbytes, job="other")
    store.get(JOB, 0, 1).pins = 1
    assert store.drop_unneeded(JOB, -1) == 0
    freed = store.drop_unneeded(JOB, 3, frozenset({4}))
    assert freed == 3 * (CHUNK + 16)  # steps 2 and 4 of rank 0 and step 1 of rank 1; pinned step 1 stays
    assert store.steps(JOB, 0) == [1, 3, 5] and store.steps(JOB, 1) == []
    assert store.get(JOB, 1, 4, complete=False) is not None  # still arriving: it completes first
    store.get(JOB, 0, 1).pins = 0
    store.drop_unneeded(JOB, 3)
    assert store.steps(JOB, 0) == [3, 5]
    assert store.get("other", 0, 4, complete=False) is not None
    store.drop_unneeded(JOB, 1 << 40)  # every step of the job below D: all of it
    assert [s.job for s in store] == ["other"] and store.used_bytes == CHUNK + 16


def test_delta_chunk_decodes_against_the_held_base() -> None:
    store = SnapshotStore(1 << 20)
    base = payload(CHUNK, 8)
    fill(store, 1, base)
    new = base.copy()
    new[::97] ^= 0x5A
    used, packed = compress_chunk("delta-lz4", new, base=base, elem=4)
    assert used == "delta-lz4"
    begin(store, 2, new.nbytes)
    done = store.put_chunk(
        JOB,
        0,
        2,
        0,
        codec_name="delta-lz4",
        payload=memoryview(packed),
        raw_len=CHUNK,
        checksum=checksum(new),
        base_step=1,
        elem=4,
    )
    assert done and store.get(JOB, 0, 2).data.tobytes() == new.tobytes()


def test_delta_chunk_without_its_base_is_refused() -> None:
    store = SnapshotStore(1 << 20)
    base = payload(CHUNK, 9)
    _, packed = compress_chunk("delta-lz4", base, base=np.zeros(CHUNK, np.uint8), elem=1)
    begin(store, 2, CHUNK)
    begin(store, 1, CHUNK)  # the base exists but is not complete: no better than missing
    for base_step in (0, 1):
        with pytest.raises(ProtocolError, match=f"delta base step {base_step} is not held"):
            store.put_chunk(
                JOB,
                0,
                2,
                0,
                codec_name="delta-lz4",
                payload=memoryview(packed),
                raw_len=CHUNK,
                checksum=checksum(base),
                base_step=base_step,
                elem=1,
            )
    assert store.get(JOB, 0, 2, complete=False).missing == 1


def test_mark_complete_after_a_pull_filled_the_buffer() -> None:
    changes: list[int] = []
    store = SnapshotStore(1 << 20, on_change=lambda: changes.append(1))
    data = payload(3 * CHUNK, 10)
    begin(store, 7, data.nbytes)
    store.get(JOB, 0, 7, complete=False).data.land(0, data.data)
    sums = {i: checksum(data.data[i * CHUNK : (i + 1) * CHUNK]) for i in range(3)}
    seal = Seal(CHUNK, blob_digest(b"t" * 10, b"m" * 6), sums)
    store.mark_complete(JOB, 0, 7, seal)
    store.mark_complete(JOB, 0, 7, seal)  # idempotent
    assert store.steps(JOB, 0) == [7] and changes == [1]
    assert store.get(JOB, 0, 7).data.tobytes() == data.tobytes()
    with pytest.raises(UnknownSnapshot):
        store.mark_complete(JOB, 0, 8, seal)


def test_unknown_snapshot_message_names_the_key() -> None:
    store = SnapshotStore(1 << 20)
    with pytest.raises(UnknownSnapshot) as info:
        store.get(JOB, 3, 9)
    assert str(info.value) == "snapshot of job 'job' rank 3 step 9 is not held here"


def test_large_raw_chunks_are_held_uncopied_and_only_once_verified() -> None:
    store = SnapshotStore(1 << 24)
    big = ADOPT_MIN_BYTES
    data = payload(2 * big, 9)
    store.begin(
        JOB,
        0,
        1,
        src_node="A",
        data_bytes=data.nbytes,
        chunk_bytes=big,
        table=b"",
        meta=b"",
        digest=blob_digest(b"", b""),
    )
    first, second = data.data[:big], data.data[big:]
    with pytest.raises(ChecksumMismatch):
        store.put_chunk(
            JOB,
            0,
            1,
            0,
            codec_name="raw",
            payload=first,
            raw_len=big,
            checksum=checksum(first) ^ 1,
            base_step=-1,
            elem=1,
        )
    snap = store.get(JOB, 0, 1, complete=False)
    assert snap.missing == 2
    for index, part in enumerate((first, second)):
        store.put_chunk(
            JOB,
            0,
            1,
            index,
            codec_name="raw",
            payload=part,
            raw_len=big,
            checksum=checksum(part),
            base_step=-1,
            elem=1,
        )
    assert snap.complete and snap.data.tobytes() == data.tobytes()
    assert np.shares_memory(np.frombuffer(snap.data.view(0, big), dtype=np.uint8), data)


def test_decoded_chunks_of_a_dropped_snapshot_are_reused_and_shed_under_the_limit() -> None:
    store = SnapshotStore(4 * CHUNK + 64)
    data = (np.arange(2 * CHUNK) % 7).astype(np.uint8)  # compressible

    def fill_lz4(step: int) -> None:
        begin(store, step, data.nbytes)
        for index in range(2):
            part = data.data[index * CHUNK : (index + 1) * CHUNK]
            used, packed = compress_chunk("lz4", part)
            assert used == "lz4"
            store.put_chunk(
                JOB,
                0,
                step,
                index,
                codec_name=used,
                payload=memoryview(packed),
                raw_len=CHUNK,
                checksum=checksum(part),
                base_step=-1,
                elem=1,
            )

    fill_lz4(1)
    buffers = [np.frombuffer(part, dtype=np.uint8) for _, part in store.get(JOB, 0, 1).data.parts()]
    store.drop_unneeded(JOB, 2)
    assert store.spare_bytes == 2 * CHUNK and store.used_bytes == 0
    fill_lz4(2)  # its chunks land in the dropped snapshot's buffers
    assert store.spare_bytes == 0 and store.get(JOB, 0, 2).data.tobytes() == data.tobytes()
    assert all(any(np.shares_memory(b, s) for s in buffers) for _, b in store.get(JOB, 0, 2).data.parts())
    store.drop_unneeded(JOB, 3)
    begin(store, 3, 4 * CHUNK - 16)  # fits only once the spares are freed
    assert store.spare_bytes == 0 and store.used_bytes == 4 * CHUNK


def test_an_idle_stream_gives_its_reservation_up_to_one_that_would_not_fit() -> None:
    """A stream begun and never continued held its reservation forever, refusing every real snapshot."""
    store = SnapshotStore(4 * CHUNK, idle_after=30.0)
    begin(store, 1, 3 * CHUNK)  # never continued
    with pytest.raises(MemoryLimitReached):
        begin(store, 2, 3 * CHUNK)  # idle for less than idle_after: it may still come
    begin(store, 3, 0)  # complete at once: never idle
    store.get(JOB, 0, 1, complete=False).touched -= 60
    begin(store, 2, 3 * CHUNK)  # fits now: step 1's stream gave its reservation up
    assert not store.holds(JOB, 0, 1) and store.holds(JOB, 0, 3)
    put(store, 2, payload(3 * CHUNK, 12), 0)  # a chunk keeps a stream alive
    assert store.abort_idle(time.monotonic() - 1) == []
    store.get(JOB, 0, 2, complete=False).touched -= 60
    store.get(JOB, 0, 2, complete=False).pins += 1  # and so does a pull landing into it (re-replication)
    assert store.abort_idle(time.monotonic() - 30) == []
