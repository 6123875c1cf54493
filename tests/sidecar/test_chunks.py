"""SnapshotBuffer: adopted and owned chunks, landing at any offset, zero-copy and joined reads."""

from __future__ import annotations

import numpy as np
import pytest

from snapshotd.sidecar.chunks import ADOPT_MIN_BYTES, SnapshotBuffer

CHUNK = ADOPT_MIN_BYTES


def data(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Pool:
    """The store's ``take``, counting what it handed out."""

    def __init__(self) -> None:
        self.taken: list[np.ndarray] = []

    def __call__(self, nbytes: int) -> np.ndarray:
        self.taken.append(np.empty(nbytes, dtype=np.uint8))
        return self.taken[-1]


def test_adopted_chunks_are_held_and_read_without_a_copy() -> None:
    pool = Pool()
    src = data(2 * CHUNK + 10)
    buf = SnapshotBuffer(src.nbytes, CHUNK, pool)
    assert buf.nchunks == 3 and buf.chunk_range(2) == (2 * CHUNK, 2 * CHUNK + 10)
    for index in range(3):
        lo, hi = buf.chunk_range(index)
        buf.adopt(index, src.data[lo:hi])
    assert pool.taken == []
    inside = buf.view(CHUNK + 5, 2 * CHUNK)
    assert np.shares_memory(np.frombuffer(inside, dtype=np.uint8), src)
    assert bytes(inside) == src[CHUNK + 5 : 2 * CHUNK].tobytes()
    across = buf.view(CHUNK - 7, 2 * CHUNK + 3)  # spans three chunks: a joined copy
    assert bytes(across) == src[CHUNK - 7 : 2 * CHUNK + 3].tobytes()
    assert not np.shares_memory(np.frombuffer(across, dtype=np.uint8), src)
    assert [start for start, _ in buf.parts()] == [0, CHUNK, 2 * CHUNK]
    assert buf.tobytes() == src.tobytes() and buf.view(4, 4).nbytes == 0
    with pytest.raises(ValueError, match="got 9 B"):
        buf.adopt(2, src.data[:9])


def test_landing_adopts_whole_chunks_and_copies_the_rest_into_owned_chunks() -> None:
    pool = Pool()
    src = data(3 * CHUNK, 1)
    buf = SnapshotBuffer(src.nbytes, CHUNK, pool)
    buf.land(0, src.data[:CHUNK])  # a whole chunk: adopted
    buf.land(CHUNK + 100, src.data[CHUNK + 100 : 3 * CHUNK])  # spans two chunks, starts inside one: copied
    buf.land(CHUNK, src.data[CHUNK : CHUNK + 100])
    assert [t.nbytes for t in pool.taken] == [CHUNK, CHUNK]
    assert buf.tobytes() == src.tobytes()
    src[:] = 0  # the owned chunks are copies; the adopted one is the caller's buffer, kept as is
    assert buf.view(0, CHUNK).tobytes() == src[:CHUNK].tobytes()
    assert buf.view(CHUNK, 3 * CHUNK).tobytes() == data(3 * CHUNK, 1)[CHUNK:].tobytes()
    with pytest.raises(ValueError, match="outside"):
        buf.land(3 * CHUNK - 1, src.data[:2])


def test_writing_into_an_adopted_chunk_copies_it_first() -> None:
    pool = Pool()
    src = data(CHUNK, 2)
    buf = SnapshotBuffer(CHUNK, CHUNK, pool)
    buf.adopt(0, src.data)
    buf.writable(0)[:4] = b"abcd"
    assert buf.tobytes() == b"abcd" + src[4:].tobytes()
    assert src[:4].tobytes() != b"abcd"  # the adopted buffer was never written
    assert buf.release() == pool.taken and buf.release() == []
    assert buf.tobytes() == b"abcd" + src[4:].tobytes()  # a pull still serving it reads the same bytes


def test_reading_an_unwritten_chunk_or_outside_the_snapshot_fails_clearly() -> None:
    buf = SnapshotBuffer(2 * CHUNK, CHUNK, Pool())
    buf.land(0, data(CHUNK).data)
    with pytest.raises(ValueError, match="chunk 1 of this snapshot was never written"):
        buf.tobytes()
    with pytest.raises(ValueError, match="outside"):
        buf.view(0, 2 * CHUNK + 1)
    with pytest.raises(ValueError, match="bad geometry"):
        SnapshotBuffer(10, 0, Pool())
    assert SnapshotBuffer(0, CHUNK, Pool()).nchunks == 0
