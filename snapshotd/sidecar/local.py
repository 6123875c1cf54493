"""The sidecar's view of one local training rank: its arena and what each slot holds.

Slot discipline (what makes the local copy safe to restore from after a crash):

- The client writes only into slots the sidecar listed as free in its last :class:`SlotUpdate`; from the moment
  a slot is listed free, the sidecar treats its contents as gone.
- An announced slot is *valid*: the copy finished before the announce. It streams to the buddies.
- The newest valid slot whose stream has ended is *kept* (the local fast-path copy); so are streaming slots.
- So is every valid slot at or above the job's durable watermark D, as the coordinator last said: if another
  node dies, the job may resume from D or any step above it that becomes durable first (by this stream or by the
  coordinator having a copy made), and this node's copy of this rank's step may then be the only one left (its
  buddy may be the node that died). A newer step's copy does not replace it; D moving past it does, or the
  coordinator naming its step *unusable* (another rank skipped it, so no restore can use it; without that, ranks
  that skipped different steps could fill their slots and wait for each other forever; or a restore resumed from
  an older step, so copies of this one may be the failed run's).
  So a rank runs at most ``slots - 1`` snapshots ahead of D.
- While a stream is in flight after a first complete copy, one more slot is held back: the client waits for the
  stream instead of superseding it step after step on a slow link.
- Every other slot is free. While a restore is pending or the rank's process is gone, nothing valid is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from snapshotd.proto import DTYPE_SIZES, TensorEntry, decode_table, table_data_bytes
from snapshotd.shm import Arena

from .inflight import Flight
from .integrity import Seal

__all__ = ["FAILURE_REASONS", "LocalRank", "SlotState", "dominant_elem"]

FAILURE_REASONS = ("no_buddy", "buddy_failed", "buddy_reassigned")
"""Why a snapshot failed (:attr:`LocalRank.failures`)."""


@dataclasses.dataclass(slots=True)
class SlotState:
    step: int = -1
    valid: bool = False
    streaming: bool = False
    pins: int = 0
    table: bytes = b""
    meta: bytes = b""
    data_bytes: int = 0
    elem: int = 1
    seal: Seal | None = None
    """The copy's end-to-end checksums (:mod:`.integrity`); every valid slot has one."""
    taken_at: float | None = None
    """When the rank announced the copy (monotonic; None: not announced here, e.g. restored from a buddy)."""


@dataclasses.dataclass(slots=True)
class LocalRank:
    """One local rank's registration, arena and slots."""

    job: str
    rank: int
    world_size: int
    pid: int
    identity: bytes
    arena: Arena
    slots: list[SlotState]
    alive: bool = True
    table: bytes = b""
    table_id: int = -1
    entries: list[TensorEntry] = dataclasses.field(default_factory=list)
    elem: int = 1
    durable_step: int = -1
    durable_at: float | None = None
    """When the rank announced its snapshot of ``durable_step`` (monotonic; None: none, or not known)."""
    seen_step: int = -1
    awaiting_restore: bool = False
    """A new process took over this arena: valid slots stay until its restore() decided which step it resumes."""
    stream_task: asyncio.Task[None] | None = None
    buddy_streams: dict[str, asyncio.Task[None]] = dataclasses.field(default_factory=dict)
    stream_flights: dict[str, Flight] = dataclasses.field(default_factory=dict)
    """What the stream in flight has sent each buddy so far."""
    next_slot: int | None = None
    """A slot announced while the stream in flight, nearly sent, finishes first: streamed when it ends."""
    next_due: asyncio.TimerHandle | None = None
    """When :attr:`next_slot` stops waiting and supersedes the stream in flight."""
    job_durable: int = -1
    """The job's durable watermark D, as the coordinator last said (-1: none yet)."""
    job_unusable: frozenset[int] = frozenset()
    """Steps above D that no restore can use, as the coordinator last said."""
    step_seconds: float = 0.0
    """The rank's latest step time, as its last announce said (0: not known)."""
    announced: int = 0
    """Snapshots the rank announced (this registration and those before it)."""
    skipped: int = 0
    """capture() calls the rank skipped, as its last announce said."""
    durable_count: int = 0
    """Snapshots every buddy took."""
    failures: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    """Snapshots some buddy did not take, by reason (every one of :data:`FAILURE_REASONS` listed from the start):
    ``no_buddy`` (none assigned yet), ``buddy_failed`` (a buddy refused it or did not answer),
    ``buddy_reassigned`` (the coordinator replaced a buddy while it streamed)."""
    on_change: Callable[[], None] = dataclasses.field(default=lambda: None, repr=False)
    """Called when this rank's complete copies or its liveness change (the node's state sets it)."""

    def failed(self, reason: str) -> None:
        """Count one snapshot some buddy did not take, for ``reason`` (see :attr:`failures`)."""
        self.failures[reason] += 1

    def set_slot(self, index: int, state: SlotState) -> None:
        """Put ``state`` in slot ``index`` (every change of what a slot holds goes through here)."""
        was_valid = self.slots[index].valid
        self.slots[index] = state
        if index == self.next_slot:  # what was to stream next is gone
            self.cancel_next()
        if was_valid or state.valid:
            self.on_change()

    def cancel_next(self) -> None:
        """Forget the slot waiting to stream (:attr:`next_slot`) and its deadline."""
        self.next_slot = None
        if self.next_due is not None:
            self.next_due.cancel()
            self.next_due = None

    def invalidate(self, index: int) -> None:
        """Slot ``index`` no longer holds a copy (found corrupt). The same state object stays, with its
        ``streaming`` and ``pins``, so the slot is not handed back to the client while something still reads it."""
        s = self.slots[index]
        if s.valid:
            s.valid = False
            self.on_change()

    def clear_slots(self) -> None:
        """Forget what every slot holds."""
        if any(s.valid for s in self.slots):
            self.on_change()
        self.slots = [SlotState() for _ in self.slots]

    def revive(self, pid: int, identity: bytes, world_size: int) -> None:
        """A process (this rank's, or its restart) registered again with an arena that still fits. A new process
        keeps every valid slot until its ``restore()`` decided which step it resumes from."""
        self.awaiting_restore = self.awaiting_restore or self.pid != pid
        self.pid, self.identity, self.alive, self.world_size = pid, identity, True, world_size
        self.seen_step = max(self.valid_steps(), default=-1)
        self.on_change()

    def mark_dead(self) -> None:
        """The rank's process is gone; its valid slots stay (the restart's local fast path)."""
        if self.alive:
            self.alive = False
            self.on_change()

    def set_table(self, table_id: int, table: bytes) -> None:
        """Adopt a new tensor table (validated against the arena's slot size).

        Raises:
            ProtocolError: malformed table, or one whose tensors do not fit in a slot.
        """
        entries = decode_table(table, self.arena.slot_bytes)
        self.table, self.table_id, self.entries = bytes(table), table_id, entries
        self.elem = dominant_elem(entries)

    @property
    def data_bytes(self) -> int:
        return table_data_bytes(self.entries)

    def kept_slot(self) -> int | None:
        """The newest valid slot whose stream has ended (the local fast-path copy), if any."""
        best = None
        for i, s in enumerate(self.slots):
            if s.valid and not s.streaming and (best is None or s.step > self.slots[best].step):
                best = i
        return best

    def free_slots(self) -> list[int]:
        """Slots the client may overwrite now (see the module docstring); listing a slot here invalidates it."""
        newest = self.kept_slot()
        free = []
        for i, s in enumerate(self.slots):
            if i == newest or s.streaming or s.pins or self._needed(s):
                continue
            free.append(i)
        if newest is not None and any(s.streaming for s in self.slots):
            free = free[1:]
        return free

    def waits_on_watermark(self) -> bool:
        """No slot is free, and one would be once the job's D reached this rank's durable step: the coordinator
        should be asked for D now rather than at the node's next heartbeat."""
        return not self.free_slots() and any(
            s.valid and not s.streaming and s.pins == 0 and self.job_durable <= s.step < self.durable_step
            for s in self.slots
        )

    def _needed(self, s: SlotState) -> bool:
        """Whether a restore after another node's death may need this copy (see the module docstring)."""
        return s.valid and s.step >= self.job_durable and s.step not in self.job_unusable

    def release_free(self) -> list[int]:
        """Mark every free slot invalid and return them (call right before telling the client)."""
        if self.awaiting_restore or not self.alive:
            return [i for i, s in enumerate(self.slots) if not s.valid and not s.streaming and s.pins == 0]
        free = self.free_slots()
        for i in free:
            self.set_slot(i, SlotState())
        return free

    def find(self, step: int) -> int | None:
        for i, s in enumerate(self.slots):
            if s.valid and s.step == step:
                return i
        return None

    def valid_steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.valid)

    def previous(self, slot: int) -> int | None:
        """The valid slot holding the newest step older than ``slot``'s (a delta base), if any."""
        step = self.slots[slot].step
        best = None
        for i, s in enumerate(self.slots):
            if i != slot and s.valid and s.step < step and (best is None or s.step > self.slots[best].step):
                best = i
        return best


def dominant_elem(entries: list[TensorEntry]) -> int:
    """The element size that covers most tensor bytes (the byte-shuffle width for delta-lz4)."""
    weight: dict[int, int] = {}
    for e in entries:
        size = DTYPE_SIZES[e.dtype]
        weight[size] = weight.get(size, 0) + e.nbytes
    return max(weight, key=weight.__getitem__) if weight else 1
