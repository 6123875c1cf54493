"""Landing a snapshot straight into another process's tensors, the slot taking what has no target."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from snapshotd.proto import ProtocolError, TensorEntry, match_entries
from snapshotd.sidecar.placement import DirectSink, PlacementError, arena_sink

# A process holding two live arrays: it prints their addresses, then, on a line from us, their bytes' digests.
_TARGET = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np
    a = np.zeros(3000, dtype=np.float32)
    b = np.zeros(10, dtype=np.int64)
    print(a.ctypes.data, b.ctypes.data, flush=True)
    sys.stdin.readline()
    print(hashlib.sha256(a.tobytes()).hexdigest(), hashlib.sha256(b.tobytes()).hexdigest(), flush=True)
    """
)


def _entries(*specs: tuple[str, str, tuple[int, ...], int]) -> list[TensorEntry]:
    size = {"float32": 4, "int64": 8}
    return [TensorEntry(p, d, s, off, int(np.prod(s)) * size[d]) for p, d, s, off in specs]


@pytest.fixture
def target():  # type: ignore[no-untyped-def]
    with subprocess.Popen(
        [sys.executable, "-c", _TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            addresses = [int(x) for x in proc.stdout.readline().split()]
            yield proc, addresses
        finally:
            proc.kill()
            proc.wait(timeout=10)


def _digests(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    return proc.stdout.readline().split()


def test_match_entries_pairs_path_dtype_and_shape() -> None:
    snapshot = _entries(
        ("m/w", "float32", (3000,), 0), ("m/s", "int64", (10,), 12000), ("o/x", "float32", (4,), 12096)
    )
    live = _entries(
        ("m/s", "int64", (10,), 0), ("m/w", "float32", (3000,), 128), ("o/x", "float32", (5,), 12288)
    )
    assert match_entries(snapshot, live) == {0: 1, 1: 0}  # o/x changed shape: no pair


def test_chunks_land_in_the_process_and_the_rest_in_the_slot(target) -> None:  # type: ignore[no-untyped-def]
    proc, (addr_a, addr_b) = target
    snapshot = _entries(
        ("a", "float32", (3000,), 0), ("b", "int64", (10,), 12032), ("c", "float32", (7,), 12160)
    )
    live = _entries(("a", "float32", (3000,), 0), ("b", "int64", (10,), 12032))
    data = np.random.default_rng(1).integers(0, 256, 12160 + 28, dtype=np.uint8)
    slot = np.zeros_like(data)
    targets = np.asarray([addr_a, addr_b], dtype="<u8").tobytes()
    sink = DirectSink(proc.pid, snapshot, live, targets, memoryview(slot))
    assert sink.direct_bytes == 12000 + 80 and sink.probe()
    for start in range(0, data.nbytes, 1000):  # chunks that cut through every entry
        sink.land(start, memoryview(data[start : start + 1000]))
    assert _digests(proc) == [
        hashlib.sha256(data[:12000].tobytes()).hexdigest(),
        hashlib.sha256(data[12032:12112].tobytes()).hexdigest(),
    ]
    assert not slot[:12112].any()  # placed bytes never touch the slot
    assert bytes(slot[12160:]) == bytes(data[12160:])  # the entry without a target lands in the slot


def test_targets_must_cover_the_live_table_and_a_gone_process_is_refused(target) -> None:  # type: ignore[no-untyped-def]
    proc, (addr_a, _) = target
    snapshot = live = _entries(("a", "float32", (3000,), 0))
    slot = memoryview(bytearray(12000))
    with pytest.raises(ProtocolError, match="restore targets"):
        DirectSink(proc.pid, snapshot, live, b"\0" * 3, slot)
    sink = DirectSink(proc.pid, snapshot, live, np.asarray([addr_a], dtype="<u8").tobytes(), slot)
    proc.kill()
    proc.wait(timeout=10)
    assert not sink.probe()
    with pytest.raises(PlacementError, match=f"process {proc.pid}"):
        sink.land(0, memoryview(bytes(12000)))


def test_no_target_means_no_direct_bytes_and_the_arena_sink_copies() -> None:
    snapshot = _entries(("a", "float32", (4,), 0))
    slot = bytearray(16)
    sink = DirectSink(1, snapshot, snapshot, np.zeros(1, dtype="<u8").tobytes(), memoryview(slot))
    assert sink.direct_bytes == 0 and not sink.probe()
    arena_sink(memoryview(slot))(4, memoryview(b"\x01\x02"))
    assert slot[4:6] == b"\x01\x02"
