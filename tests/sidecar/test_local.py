"""Slot discipline of one local rank: which slots are free, kept or streaming, and what a restart keeps."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from snapshotd.proto import ProtocolError, TensorEntry, encode_table
from snapshotd.shm import create_arena, pid_alive, process_started
from snapshotd.sidecar.local import LocalRank, SlotState, dominant_elem


@pytest.fixture
def rank() -> Iterator[LocalRank]:
    arena = create_arena(f"unit-local-{uuid.uuid4().hex[:8]}", 0, 4096, 3, node="unit")
    try:
        yield LocalRank("job", 0, 1, os.getpid(), b"id", arena, [SlotState() for _ in range(3)])
    finally:
        arena.close(unlink=True)
    assert not os.path.exists(arena.path)


def announce(lr: LocalRank, slot: int, step: int, *, streaming: bool = True) -> None:
    lr.slots[slot] = SlotState(step=step, valid=True, streaming=streaming)


def test_fresh_rank_has_every_slot_free(rank: LocalRank) -> None:
    assert rank.kept_slot() is None
    assert rank.free_slots() == [0, 1, 2]
    assert rank.valid_steps() == []


def test_streaming_slot_is_busy_and_newest_finished_slot_is_kept(rank: LocalRank) -> None:
    announce(rank, 0, 1, streaming=False)
    announce(rank, 2, 3)  # streaming
    announce(rank, 1, 2, streaming=False)
    assert rank.kept_slot() == 1  # the newest valid slot whose stream ended, not the streaming one
    assert rank.free_slots() == []  # slot 0 is held back while step 3 streams
    assert rank.valid_steps() == [1, 2, 3]
    assert rank.find(2) == 1 and rank.find(4) is None
    rank.job_durable = 3  # step 3's stream ended and the job's durable step moved to it
    rank.slots[2].streaming = False
    assert rank.kept_slot() == 2 and rank.free_slots() == [0, 1]


def test_copies_are_held_until_the_jobs_durable_watermark_passes_them(rank: LocalRank) -> None:
    """Another node's failure may make the job resume from D or any step above it that becomes durable first; this
    node's copy of that step may then be the only one left (its buddy may be the node that failed). So a newer
    copy does not free an older one; D moving past it does, or its step being named unusable."""
    rank.job_durable = 1
    announce(rank, 0, 1, streaming=False)
    announce(rank, 1, 2, streaming=False)
    assert rank.free_slots() == [2]  # steps 1 (= D) and 2 (newest) are held
    announce(rank, 2, 3)  # streaming
    assert rank.free_slots() == []
    rank.slots[2].streaming = False
    assert rank.free_slots() == []  # step 2 is above D: D may yet become 2
    rank.job_durable = 2  # D moved: step 1 is no longer needed
    assert rank.release_free() == [0]
    assert rank.valid_steps() == [2, 3]
    rank.job_unusable = frozenset({2})  # another rank skipped step 2: no restore can use it
    assert rank.release_free() == [0, 1]
    assert rank.valid_steps() == [3]


def test_a_rank_whose_slots_d_alone_holds_asks_for_d(rank: LocalRank) -> None:
    """Its buddies report a copy to the coordinator at once, but the node heard the new D only with its next
    heartbeat: a rank whose first streams were slow had every slot held for half a second and skipped steps."""
    rank.job_durable = 1
    announce(rank, 0, 1, streaming=False)
    announce(rank, 1, 2, streaming=False)
    announce(rank, 2, 3, streaming=False)
    rank.durable_step = 2
    assert rank.free_slots() == [] and rank.waits_on_watermark()  # D reaching 2 frees step 1's slot
    rank.durable_step = 1
    assert not rank.waits_on_watermark()  # nothing durable above D: a new D frees nothing
    rank.durable_step = 3
    rank.job_durable = 3
    assert rank.free_slots() == [0, 1] and not rank.waits_on_watermark()  # a slot is free already
    rank.job_durable = 1
    rank.slots[0].pins = 1  # a pull reads step 1: D frees it only once the read ends
    rank.slots[1].pins = 1
    assert not rank.waits_on_watermark()


def test_pinned_slot_is_never_free(rank: LocalRank) -> None:
    announce(rank, 0, 1, streaming=False)
    announce(rank, 1, 2, streaming=False)
    rank.slots[0].pins = 1
    assert rank.free_slots() == [2]


def test_release_free_invalidates_what_it_hands_back(rank: LocalRank) -> None:
    announce(rank, 0, 1, streaming=False)
    announce(rank, 1, 2, streaming=False)
    rank.job_durable = 2
    assert rank.release_free() == [0, 2]
    assert rank.slots[0] == SlotState() and rank.valid_steps() == [2]
    assert rank.kept_slot() == 1


def test_awaiting_restore_or_dead_rank_keeps_every_valid_slot(rank: LocalRank) -> None:
    announce(rank, 0, 1, streaming=False)
    announce(rank, 1, 2, streaming=False)
    rank.job_durable = 2  # step 1 would be free
    for flag in ("awaiting_restore", "alive"):
        setattr(rank, flag, flag == "awaiting_restore")
        assert rank.release_free() == [2]  # only the slot that held nothing
        assert rank.valid_steps() == [1, 2]
        rank.awaiting_restore, rank.alive = False, True


def test_previous_is_the_newest_older_valid_slot(rank: LocalRank) -> None:
    announce(rank, 0, 4, streaming=False)
    announce(rank, 1, 6)
    announce(rank, 2, 5, streaming=False)
    assert rank.previous(1) == 2
    assert rank.previous(2) == 0
    assert rank.previous(0) is None
    rank.slots[2] = SlotState()
    assert rank.previous(1) == 0


def test_set_table_validates_against_the_arena(rank: LocalRank) -> None:
    entries = [TensorEntry("a", "bfloat16", (1000,), 0, 2000), TensorEntry("b", "int64", (8,), 2048, 64)]
    rank.set_table(7, encode_table(entries))
    assert rank.table_id == 7 and rank.entries == entries
    assert rank.data_bytes == 2112 and rank.elem == 2
    too_big = [TensorEntry("c", "float32", (2000,), 0, 8000)]
    with pytest.raises(ProtocolError, match="ends past the data buffer"):
        rank.set_table(8, encode_table(too_big))
    assert rank.table_id == 7  # the old table stays in force


def test_dominant_elem_weighs_bytes_not_tensor_count() -> None:
    entries = [TensorEntry(f"i{i}", "int64", (1,), 64 * i, 8) for i in range(10)]
    entries.append(TensorEntry("w", "float32", (100,), 640, 400))
    assert dominant_elem(entries) == 4
    assert dominant_elem([TensorEntry("e", "bfloat16", (0,), 0, 0)]) == 2  # only zero bytes: still its size
    assert dominant_elem([]) == 1


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(0) and not pid_alive(-5)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:  # do not reap
            assert time.monotonic() < deadline, "child did not exit"
            time.sleep(0.01)
        assert not pid_alive(child.pid)  # a zombie counts as gone
    finally:
        assert child.wait(30) == 0
    assert not pid_alive(child.pid)  # reaped: gone


def test_process_started_names_one_process() -> None:
    with open("/proc/self/stat", "rb") as f:
        mine = int(f.read().split(b") ", 1)[1].split()[19])
    assert process_started(os.getpid()) == mine > 0
    assert process_started(1) is not None and process_started(1) <= mine  # init started first
    assert process_started(0) is None and process_started(-5) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = process_started(child.pid)
    assert child.wait(30) == 0
    assert started is not None and started >= mine and process_started(child.pid) is None  # reaped: gone
