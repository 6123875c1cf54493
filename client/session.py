"""A rank's session with its node's sidecar: :class:`SidecarSession`.

The session owns the channel to the sidecar (:class:`~.channel.Channel`), the rank's registration and the arena
it maps, the slot pool, and the stager that copies into the slots. It keeps the bookkeeping of the rank's steps
(the newest captured, started, durable and failed, and the recovery point behind ``stats.rpo_*``) and is the
one place a snapshot problem is reported (:meth:`SidecarSession.problem`).

Two threads use it: the training thread takes and releases slots and registers; the channel thread applies the
sidecar's messages (:meth:`SidecarSession.on_message`), under one lock that guards the slot pool and the step
bookkeeping.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from snapshotd.proto import (
    Message,
    RankRegistered,
    RegisterRank,
    RestoreFetch,
    RestoreProgress,
    SlotUpdate,
    UnregisterRank,
    encode_table,
)
from snapshotd.shm import Arena, attach_arena, pid_alive, process_started

from .channel import Channel
from .errors import SnapshotdError
from .identity import Identity
from .staging import Stager
from .state import FlatState
from .stats import ProblemLog, SnapshotStats

__all__ = ["SidecarSession"]

log = logging.getLogger(__name__)

SIDECAR_CHECK_S = 1.0
"""With ``when_busy="block"``, how often a capture waiting for a free slot checks that the sidecar still runs."""


class SidecarSession:
    """The channel, registration, arena and slots of one rank, and the durability of its snapshots.

    Args:
        me: the rank and its sidecar.
        state: the user's state, whose tensors the session's :class:`~.staging.Stager` copies into the slots.
        stats: the Snapshotter's counters, updated here from both threads.
        slots, timeout, when_busy: as :class:`~snapshotd.client.Snapshotter` takes them.
    """

    def __init__(
        self,
        me: Identity,
        state: Mapping[str, Any],
        stats: SnapshotStats,
        *,
        slots: int,
        timeout: float,
        when_busy: str,
    ) -> None:
        self.job, self.rank, self.world_size = me.job, me.rank, me.world_size
        self.stats = stats
        self.slots = slots
        self.timeout = timeout
        self.when_busy = when_busy
        self.on_restore: Callable[[RestoreProgress | RestoreFetch], None] = lambda msg: None
        """Channel thread: where a restore's messages go (the Snapshotter points it at its restorer)."""
        self._lock = threading.Condition()
        self._free: set[int] = set()
        self._inflight: dict[int, int] = {}  # slot -> step staged or announced, until a newer update frees it
        self._updates = 0  # SlotUpdates received
        self._last_update = time.monotonic()
        self._sidecar_ok = True
        self._pending_registration: RankRegistered | None = None
        self._registration_sent = -1e9
        self.sidecar_pid = 0
        self._sidecar_started: int | None = None  # when the sidecar started, if this process can see it
        self.arena: Arena | None = None
        self.slot_tensors: list[torch.Tensor] = []
        self._registered_bytes = -1
        self._table_layout: Any = None
        self._table_id = 0
        self._table_sent = False
        self.last_captured = -1
        """The newest step capture() was called with (or restored): the steps it may take next are newer."""
        self.last_started = -1
        """The newest step staged (or restored): the one :meth:`wait` waits for."""
        self._last_failed_step = -1
        self._taken_at: dict[int, float] = {}  # step -> when capture() started it, until it is durable
        # the newest durable (or restored) step, and when it was taken
        self._recovery_point = (-1, time.monotonic())
        self._problems = ProblemLog()
        self.channel = Channel(me.sidecar, self.on_message)
        self.stager = Stager(state, stats)

    # ------------------------------------------------------------------------------------ registration

    def _registration(self, data_bytes: int) -> RegisterRank:
        return RegisterRank(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            data_bytes=data_bytes,
            slots=self.slots,
        )

    def register(self, data_bytes: int, timeout: float) -> None:
        """Register (or re-register with a bigger size) and map the arena, waiting at most ``timeout``."""
        with self._lock:
            self._free.clear()
            self._inflight.clear()
        replied: list[int] = []  # the count of slot updates when the reply came

        def on_reply(_: Message) -> None:  # on the channel thread, before it reads the next message
            with self._lock:  # updates sent before the reply may name slots that announces since then took
                self._free.clear()
                replied.append(self._updates)

        reply = self.channel.request(
            self._registration(data_bytes), "rank_registered", timeout, on_reply=on_reply
        )
        assert isinstance(reply, RankRegistered)
        self._adopt(reply)
        with self._lock:  # the sidecar sends the free slots right after its reply
            self._lock.wait_for(
                lambda: bool(replied) and self._updates > replied[0], timeout=min(timeout, 5.0)
            )

    def _adopt(self, reply: RankRegistered) -> None:
        self.map_arena(reply.arena, reply.slot_bytes, reply.slots)
        self.sidecar_pid = reply.pid
        self._sidecar_started = process_started(reply.pid)
        self._registered_bytes = reply.slot_bytes
        self._table_sent = False
        self._sidecar_ok = True

    def ensure_registered(self, data_bytes: int) -> bool:
        """Make sure the arena fits ``data_bytes``. Never waits long: a local sidecar answers in milliseconds; one
        that does not is retried in the background (at most once a second) while captures are skipped."""
        pending, self._pending_registration = self._pending_registration, None
        if pending is not None:
            self._adopt(pending)
        if data_bytes <= self._registered_bytes and self.arena is not None:
            return True
        if self._sidecar_ok:
            try:
                self.register(data_bytes, min(self.timeout, 2.0))
                return True
            except (SnapshotdError, OSError, ValueError) as exc:
                self._sidecar_ok = False
                self.problem(f"cannot register with the sidecar: {exc}")
                return False
        now = time.monotonic()
        if now - self._registration_sent > 1.0:
            self._registration_sent = now
            self.channel.send(self._registration(data_bytes))
        return False

    def map_arena(self, path: str, slot_bytes: int, slots: int) -> Arena:
        """Map the arena at ``path`` (unless mapped already), after the copy into the old one finished."""
        if self.arena is not None and self.arena.path == path:
            return self.arena
        self.stager.fence(timeout=self.timeout, host=True)  # the old arena is unmapped below
        old = self.arena
        self.arena = attach_arena(path, slot_bytes, slots)
        self.slot_tensors = [
            torch.frombuffer(self.arena.slot(i), dtype=torch.uint8)
            if slot_bytes
            else torch.empty(0, dtype=torch.uint8)
            for i in range(slots)
        ]
        self.stager.pin(self.arena)
        if old is not None:
            self.stager.unpin(old)
            old.close()
        return self.arena

    def table_for(self, flat: FlatState) -> tuple[int, bytes]:
        """The table id of ``flat``'s layout, and its table when the sidecar does not know it (else empty)."""
        table = b""
        if not self._table_sent or flat.layout != self._table_layout:
            self._table_id += 1
            table = encode_table(flat.entries)
            self._table_layout = flat.layout
            self._table_sent = True
        return self._table_id, table

    # ------------------------------------------------------------------------------------------- slots

    def slot_free(self) -> bool:
        """Whether a slot is free now, or the rank has no arena (so no slots to wait for)."""
        with self._lock:
            return bool(self._free) or self.arena is None

    def wait_slot(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until :meth:`slot_free`; whether it is."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._free) or self.arena is None, max(0.0, timeout))

    def take_slot(self, step: int) -> int | None:
        """A free slot for ``step``; None when none is (``when_busy="block"``: none within ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while not self._free:
                if self.when_busy == "skip":
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self.problem(f"no free slot within {self.timeout:.0f} s (is the sidecar streaming?)")
                    return None
                if self._sidecar_gone():
                    return None
                self._lock.wait(min(left, SIDECAR_CHECK_S))
            slot = min(self._free)
            self._free.discard(slot)
            self._inflight[slot] = step
            return slot

    def release(self, slot: int) -> None:
        """A staged slot that was never announced (its copy was abandoned) is ours to reuse."""
        with self._lock:
            self._inflight.pop(slot, None)
            self._free.add(slot)
            self._lock.notify_all()

    def forget_slots(self) -> int:
        """Forget the free and in-flight slots (a restore rearranges them; the sidecar sends them afresh after its
        reply); the count of slot updates so far, for :meth:`await_update`."""
        with self._lock:
            self._free.clear()
            self._inflight.clear()
            return self._updates

    def await_update(self, seen: int) -> None:
        """Wait (at most ``timeout``, 5 s at most) for a slot update after the first ``seen``."""
        with self._lock:
            self._lock.wait_for(lambda: self._updates > seen, timeout=min(self.timeout, 5.0))

    def reregister_if_lost(self) -> None:
        """No slot was free: when the sidecar's process is gone, or no slot update came for ``timeout``, it
        restarted and forgot this rank, and with it the steps it had seen; register again at the next capture.
        Every announce goes out before the registration does; the update after its reply says which slots are
        free."""
        gone = self._sidecar_gone()
        if not gone and time.monotonic() - self._last_update <= self.timeout:
            return
        self.problem(
            f"the sidecar (pid {self.sidecar_pid}) is gone; registering again"
            if gone
            else f"no slot update from the sidecar for {self.timeout:.0f} s; registering again"
        )
        self.stager.fence(timeout=self.timeout)
        with self._lock:
            self._inflight.clear()
            self._free.clear()
        self._registered_bytes = -1
        self._sidecar_ok = False
        self._last_update = time.monotonic()

    def _sidecar_gone(self) -> bool:
        """Whether the sidecar this rank registered with has exited (known only when its pid is visible here; a
        process started since under the same pid is not it)."""
        started = self._sidecar_started
        pid = self.sidecar_pid
        return started is not None and (not pid_alive(pid) or process_started(pid) != started)

    # ------------------------------------------------------------------------------------- durability

    def started(self, step: int) -> None:
        """``step`` is staged from now on: :meth:`wait` waits for it, and its RPO counts from now."""
        self.last_started = step
        with self._lock:
            self._taken_at[step] = time.monotonic()
            if (
                len(self._taken_at) > 64
            ):  # bounded when no step becomes durable (no buddy, every stream failing)
                del self._taken_at[min(self._taken_at)]

    def resume_at(self, step: int) -> None:
        """A restore loaded ``step``: durable (it came from memory that survived the failure), the step captures
        go on from, and the sidecar needs the table again."""
        self.last_started = self.last_captured = step
        self._recovery_point = (step, time.monotonic())
        self.stats.last_durable_step = step
        self._table_sent = False

    @property
    def in_flight(self) -> bool:
        """Whether the newest snapshot started is neither durable nor failed yet."""
        return self.last_started > max(self.stats.last_durable_step, self._last_failed_step)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the newest snapshot started is durable on every buddy, or failed, at most ``timeout``
        (default the session's); whether it is durable."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        target = self.last_started
        with self._lock:
            while self.stats.last_durable_step < target and self._last_failed_step < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return self.stats.last_durable_step >= target

    def update_rpo(self) -> None:
        """``stats.rpo_*`` from the newest step captured and the recovery point."""
        with self._lock:
            step, taken = self._recovery_point
            if self.stats.last_step >= 0:
                self.stats.rpo_steps = max(0, self.stats.last_step - step)
                last = self._taken_at.get(self.stats.last_step, time.monotonic())
                self.stats.rpo_seconds = max(0.0, last - taken) if self.stats.rpo_steps else 0.0

    # --------------------------------------------------------------------------------- channel thread

    def on_message(self, msg: Message) -> None:
        """Channel thread: registrations, slot updates, errors about announces; a restore's messages go to
        :attr:`on_restore`."""
        if isinstance(msg, RankRegistered):  # a registration retried in the background was answered
            with (
                self._lock
            ):  # free slots come from the sidecar's update after its reply, not from earlier ones
                self._free.clear()
            self._pending_registration = msg
        elif isinstance(msg, SlotUpdate):
            self._on_slot_update(msg)
        elif isinstance(msg, RestoreProgress | RestoreFetch):
            self.on_restore(msg)
        elif msg.TYPE == "error":
            text = f"{getattr(msg, 'code', '')}: {getattr(msg, 'message', '')}"
            with self._lock:
                self.stats.failed += 1
                # the sidecar forgot us (it restarted) or lost our table: register and resend on the next capture
                self._registered_bytes = -1
                self._table_sent = False
                self._inflight.clear()
                self._free.clear()
                self._lock.notify_all()
            self.problem(text)

    def _on_slot_update(self, msg: SlotUpdate) -> None:
        self._last_update = time.monotonic()
        with self._lock:
            self._updates += 1
            for slot in msg.free_slots:
                staged = self._inflight.get(slot)
                if staged is not None and staged > msg.seen_step:
                    continue  # this update predates our announce of that slot
                self._inflight.pop(slot, None)
                self._free.add(slot)
            if msg.durable_step > self.stats.last_durable_step:
                self.stats.durable += 1
                self.stats.last_durable_step = msg.durable_step
                taken = self._taken_at.get(msg.durable_step, self._recovery_point[1])
                self._recovery_point = (msg.durable_step, taken)
                self._taken_at = {k: t for k, t in self._taken_at.items() if k > msg.durable_step}
                self.update_rpo()
            if msg.failed_step >= 0:
                self._taken_at.pop(msg.failed_step, None)  # it will never be durable
                self.stats.failed += 1
                self._last_failed_step = max(self._last_failed_step, msg.failed_step)
                self.problem(msg.note or f"step {msg.failed_step} did not reach every buddy")
            self._lock.notify_all()

    def problem(self, text: str) -> None:
        """Count a snapshot problem in ``stats``, and warn about it the first time its kind is met."""
        self.stats.errors += 1
        self.stats.last_error = text
        if self._problems.first(text):
            log.warning("[job %s rank %d] snapshot problem: %s", self.job, self.rank, text)

    def close(self, *, unregister: bool) -> None:
        """Finish the copy in flight, unregister (``unregister``: the sidecar frees the arena), stop the channel,
        unmap the arena, and let go of the stager's state."""
        self.stager.fence(timeout=self.timeout, host=True)  # before the arena is unregistered and unmapped
        self.stager.remove_hooks()
        if unregister:
            self.channel.send(UnregisterRank(job=self.job, rank=self.rank))
        self.channel.close()
        if self.arena is not None:
            self.slot_tensors = []
            self.arena.close()
        self.stager = Stager({}, self.stats)
