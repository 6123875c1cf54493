"""Which steps a rank snapshots: :class:`AutoInterval` for ``every="auto"``, :class:`AlignedStride` for ``every=N``.

``every="auto"``: snapshot as often as a budget of training time allows.

Where snapshots cost the training step something (on a host whose cores training keeps busy, the staging copy and
the sidecars' streaming take cycles from it), snapshotting after every step slows training by that cost. The
:class:`AutoInterval` measures it and spaces snapshots so that, on average, they slow training by at most
``budget`` (1% by default):

- A step is *loaded* if a snapshot of this rank was in flight (staging, or streaming until durable) when it began,
  else *clean*. The baseline is the median of the recent clean steps.
- The cost of one snapshot is the time its loaded steps took beyond the baseline, summed; its estimate is a
  moving average over snapshots.
- The interval ``K`` is the smallest power of two with ``cost / (K * baseline) <= budget`` (at most
  :attr:`AutoInterval.MAX_INTERVAL`), and a step is due when ``step % K == 0``. Tying the schedule to the step
  number, with ``K`` a power of two, keeps ranks in step: ranks whose estimates differ by a factor of two still
  share every step of the larger interval, so the job always has a step that every rank snapshotted.
- While ``K`` is below :attr:`AutoInterval.PROBE_BELOW`, the last :attr:`AutoInterval.PROBE_STEPS` steps of
  every :attr:`AutoInterval.PROBE_EVERY` are never due, so that clean steps keep coming and the baseline follows
  the job's speed. Loaded steps back to back (a snapshot in flight longer than the interval) are costed against
  the baseline at hand every :attr:`AutoInterval.PROBE_EVERY` steps (or two intervals).

The first :attr:`AutoInterval.WARMUP` snapshots are not costed: they pay once for what later ones reuse (the
buddy's first buffers, the first touch of the shared memory), which on a busy host can cost more than the
steady state and would set the interval from an outlier. A "step" longer than :attr:`AutoInterval.PAUSE` baselines is the training loop pausing (an evaluation, a disk
checkpoint, a gap between capture calls) and is left out of both measurements. Before it has measured anything
the interval is :attr:`AutoInterval.START` (the first step is always due, so a
job is protected from its first step on). The class is pure bookkeeping: no clock, no I/O, not thread-safe (the
training thread owns it).
"""

from __future__ import annotations

import collections
import math
import statistics

__all__ = ["AlignedStride", "AutoInterval", "left_out", "max_steps_lost"]

CLEAN_EVERY = 64
"""``every=1`` or ``2``: one due step in this many is left out (:func:`left_out`)."""


def left_out(step: int, every: int) -> bool:
    """Whether ``step``, due with ``every=every``, is left out so that the step after it runs with no stream.

    The sidecar's pacer holds the slowdown snapshots cost within its step budget, against the steps that ran
    with no stream in flight (see :mod:`snapshotd.sidecar.pacer`). With a snapshot every step or every second
    step there would be none, so the due step that ends each run of ``CLEAN_EVERY`` intervals is left out:
    ranks decide by step number, alike. Sparser schedules leave clean steps anyway.
    """
    return every < 3 and (step // every) % CLEAN_EVERY == CLEAN_EVERY - 1


def max_steps_lost(stride: int, slots: int = 3) -> int:
    """The most steps a node lost now can cost a job snapshotting every ``stride``-th step with ``slots`` slots.

    Up to ``2 * stride - 1`` steps since the last snapshot started (``stride - 1``, and one stride more after a
    step :func:`left_out`), and ``slots - 1`` strides more: a rank runs at most ``slots - 1`` snapshots ahead of
    the newest one its buddies hold, and those may all be in flight when the node dies. With the default three
    slots and every step due: 2, and 3 right after a step left out.
    """
    return (slots + 1) * max(1, stride) - 1


class AutoInterval:
    """Chooses which steps to snapshot so that snapshots cost at most ``budget`` of training time.

    Args:
        budget: the tolerated mean relative slowdown of a step (0.01 = 1%).
    """

    START = 8
    WARMUP = 2
    MAX_INTERVAL = 1024
    PROBE_EVERY = 64
    PROBE_STEPS = 3
    PROBE_BELOW = 4
    BASELINE_WINDOW = 16
    PAUSE = (
        20  # a "step" this many baselines long is a pause of the loop (evaluation, a disk save): not counted
    )
    ALPHA = 0.3

    def __init__(self, budget: float = 0.01) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"budget must be between 0 and 1, got {budget}")
        self.budget = budget
        self.interval = self.START
        self.cost_seconds: float | None = None  # estimated training time one snapshot costs
        self._clean: collections.deque[float] = collections.deque(maxlen=self.BASELINE_WINDOW)
        self._baseline: float | None = None  # median of ``_clean``, kept as it changes (once per clean step)
        self._episode: list[float] = []  # loaded step times since the last clean step
        self._episode_snapshots = 0
        self._settled = 0  # snapshots whose episodes were closed (the first WARMUP of them are not costed)
        self._loaded_next = False  # whether the step now beginning is loaded
        self._first = True

    @property
    def baseline_seconds(self) -> float | None:
        """The median clean step time, once three clean steps were seen."""
        return self._baseline

    def due(self, step: int) -> bool:
        """Whether ``step`` should be snapshotted (the caller still skips it if no slot is free)."""
        if self._first:
            return True
        if (
            self.interval < self.PROBE_BELOW
            and step % self.PROBE_EVERY >= self.PROBE_EVERY - self.PROBE_STEPS
        ):
            return False
        return step % self.interval == 0

    def record(self, step_seconds: float | None, *, started: bool, in_flight: bool) -> None:
        """Account the step that just ended and the capture decision just taken.

        Args:
            step_seconds: how long the step that just ended took (None for the first, unknown one).
            started: a snapshot of this step was started.
            in_flight: a snapshot of this rank is in flight now (the one just started, or an older one).
        """
        if started:
            self._first = False
        base = self.baseline_seconds
        pause = base is not None and step_seconds is not None and step_seconds > self.PAUSE * base
        if step_seconds is not None and step_seconds > 0 and not pause:
            if self._loaded_next:
                self._episode.append(step_seconds)
                if len(self._episode) >= max(self.PROBE_EVERY, 2 * self.interval):
                    self._close_episode()  # snapshots back to back: measure against the baseline we have
            else:
                self._close_episode()
                self._clean.append(step_seconds)
                self._baseline = statistics.median(self._clean) if len(self._clean) >= 3 else None
                self._choose()
        if started:
            self._episode_snapshots += 1
        self._loaded_next = in_flight

    def _close_episode(self) -> None:
        base = self.baseline_seconds
        warm = self._settled >= self.WARMUP
        self._settled += self._episode_snapshots
        if self._episode and self._episode_snapshots and base is not None and warm:
            cost = max(0.0, sum(t - base for t in self._episode)) / self._episode_snapshots
            a = self.ALPHA
            self.cost_seconds = cost if self.cost_seconds is None else (1 - a) * self.cost_seconds + a * cost
            self._choose()
        self._episode.clear()
        self._episode_snapshots = 0

    def _choose(self) -> None:
        base = self.baseline_seconds
        if base is None or self.cost_seconds is None or base <= 0:
            return
        need = self.cost_seconds / (self.budget * base)  # steps per snapshot for the budget
        k = 1 if need <= 1 else 1 << math.ceil(math.log2(need) - 1e-9)
        self.interval = min(self.MAX_INTERVAL, k)


class AlignedStride:
    """``every=N`` with ``when_busy="skip"``: which steps are due, so that ranks that must skip skip alike.

    A restore needs a step that every rank snapshotted. A rank that skips whichever step finds its slots busy
    snapshots steps of its own, and ranks whose streams end at different moments may then share none. So a step
    is due when ``step % stride == 0``, where ``stride`` is ``N`` times a power of two: it doubles when a due step
    finds no free slot (up to :attr:`MAX_FACTOR` times ``N``), and halves (never below ``N``) once
    :attr:`HALVE_AFTER` steps in a row midway between two due steps find a slot free (halving at the first one lets
    two ranks freed a step apart fall out of phase for good). Ranks whose strides differ by a power of two still
    share every step of the larger. Pure bookkeeping: no clock, no I/O, not thread-safe (the training thread owns it).
    """

    MAX_FACTOR = 32
    HALVE_AFTER = 2

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self.stride = every
        self._free_midway = 0

    def due(self, step: int) -> bool:
        return step % self.stride == 0

    def record(self, step: int, *, slot_free: bool) -> None:
        """Account ``step`` (one of the user's ``every``-th steps): whether a slot was free at it."""
        if self.due(step):
            if not slot_free:
                self.stride = min(self.stride * 2, self.every * self.MAX_FACTOR)
                self._free_midway = 0
        elif self.stride > self.every and step % (self.stride // 2) == 0:
            self._free_midway = self._free_midway + 1 if slot_free else 0
            if self._free_midway >= self.HALVE_AFTER:
                self.stride //= 2
                self._free_midway = 0
