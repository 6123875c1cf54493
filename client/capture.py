"""What ``Snapshotter.capture(step)`` does: :class:`Capture`.

A capture decides whether its step is due (``every``, ``"auto"`` or the aligned stride, see
:mod:`.schedule`), flattens the state with the :class:`~.walker.StateWalker`, times the steps for the sidecar's
pacer, and stages the snapshot into a free slot of the :class:`~.session.SidecarSession`, which announces it once
copied. It runs on the training thread only.
"""

from __future__ import annotations

import collections
import time

from snapshotd.proto import Announce
from snapshotd.proto import limits as L

from .schedule import AlignedStride, AutoInterval, left_out
from .session import SidecarSession
from .state import FlatState
from .view import SnapshotView
from .walker import StateWalker

__all__ = ["Capture"]


class Capture:
    """Snapshots of ``view`` through ``session``, on the schedule ``every`` and ``when_busy`` set (as
    :class:`~snapshotd.client.Snapshotter` takes them, checked)."""

    def __init__(self, session: SidecarSession, view: SnapshotView, every: int | str, when_busy: str) -> None:
        self._session = session
        self.stats = session.stats
        self._view = view
        self._walker = StateWalker()
        self._every = every
        self._auto = AutoInterval() if every == "auto" else None
        self._aligned = AlignedStride(every) if isinstance(every, int) and when_busy == "skip" else None
        self.stats.stride = self._aligned.stride if self._aligned is not None else 0
        self._last_capture_end: float | None = None  # time.monotonic()
        self._step_seconds = 0.0
        # the steps since the last announce, for the sidecar's pacer: durations, and when the last one ended
        self._steps: collections.deque[float] = collections.deque(maxlen=L.MAX_ANNOUNCED_STEPS)
        self._steps_end = 0.0

    def capture(self, step: int) -> bool:
        """:meth:`Snapshotter.capture <snapshotd.client.Snapshotter.capture>` (same result and errors)."""
        session = self._session
        if step <= session.last_captured:
            raise ValueError(f"capture({step}) after capture({session.last_captured}): steps only grow")
        session.last_captured = step
        self.stats.last_step = step
        t0 = time.monotonic()
        step_seconds = None if self._last_capture_end is None else t0 - self._last_capture_end
        if step_seconds is not None:
            self._step_seconds = step_seconds
            self._steps.append(step_seconds)
            self._steps_end = t0
        started = False
        try:
            if self._auto is not None:
                due = self._auto.due(step)
            else:
                due = step % self._every == 0 and not left_out(step, self._every)  # type: ignore[operator,arg-type]
            if not due:
                return False
            # TypeError for unsnapshottable values propagates: a user error
            flat = self._walker.flatten(self._view)
            # at every step due, not only at the aligned ones: a registration retried in the background (the
            # sidecar restarted) goes on while the stride is long
            registered = session.ensure_registered(flat.data_bytes)
            if self._aligned is not None:
                # unregistered, the rank has no slots to wait for: its stride does not grow
                slot_free = session.slot_free() or not registered
                aligned = self._aligned.due(step)
                self._aligned.record(step, slot_free=slot_free)
                self.stats.stride = self._aligned.stride
                if not aligned:  # passed over so that this rank skips the steps the others skip
                    self.stats.skipped += 1
                    return False
            if not registered:
                self.stats.skipped += 1
                return False
            started = self._start(step, flat)
            return started
        finally:
            end = time.monotonic()
            self.stats.capture_seconds += end - t0
            session.update_rpo()
            self._last_capture_end = end
            if self._auto is not None:
                self._auto.record(step_seconds, started=started, in_flight=session.in_flight)
                self.stats.auto_interval = self._auto.interval

    def flush(self, step: int, timeout: float) -> bool:
        """:meth:`Snapshotter.flush <snapshotd.client.Snapshotter.flush>`."""
        session = self._session
        if step != session.last_captured:
            raise ValueError(f"flush({step}): the step last captured is {session.last_captured}")
        deadline = time.monotonic() + timeout
        if session.last_started != step:
            flat = self._walker.flatten(self._view)
            if not session.ensure_registered(flat.data_bytes):
                return False
            while not self._start(step, flat):  # every slot holds a copy not yet durable: wait for one
                session.wait(max(0.0, deadline - time.monotonic()))
                if not session.wait_slot(deadline - time.monotonic()):
                    return False
        return session.wait(max(0.0, deadline - time.monotonic()))

    def _start(self, step: int, flat: FlatState) -> bool:
        """Stage and announce a snapshot of ``step`` into a free slot (the rank is registered for ``flat``'s size);
        whether one was free."""
        session = self._session
        slot = session.take_slot(step)
        if slot is None:
            self.stats.skipped += 1
            session.reregister_if_lost()
            return False
        table_id, table = session.table_for(flat)
        announce = Announce(
            job=session.job,
            rank=session.rank,
            step=step,
            slot=slot,
            table_id=table_id,
            step_seconds=self._step_seconds,
            skipped=self.stats.skipped,
            steps=tuple(self._steps),
            steps_end=self._steps_end,
            table=table,
            meta=flat.meta,
        )
        self._steps.clear()
        session.started(step)
        session.stager.stage(
            flat, session.slot_tensors[slot], session.channel, announce, lambda: session.release(slot)
        )
        self.stats.started += 1
        self.stats.bytes += flat.data_bytes
        return True

    def close(self) -> None:
        """Let go of the state: nothing is captured after this."""
        self._view = SnapshotView({}, {}, {})
        self._walker = StateWalker()
