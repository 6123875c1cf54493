"""Keep snapshot streams inside the node's bandwidth and the job's step-time budget (DESIGN.md "Network-aware
pacing").

:class:`Pacer` is a token bucket shared by every outgoing snapshot stream of the sidecar. With ``--max-rate
RATE`` its rate is fixed. With ``--max-rate auto`` (the default) it acts on the step times the local ranks report
with each announce:

- **Spread.** A stream sent as fast as the wire goes takes the cores it needs at once, beside the training
  thread; the same bytes spread over the step leave training the cores it had. So the rate is ``SPREAD`` times
  the *keep-up rate*: the bytes the local ranks' snapshots must move (each rank's snapshot bytes, times its
  buddies, over its snapshot interval in steps times its step time). Streams then end with a third of the
  interval to spare, and no snapshot falls behind for want of rate.
- **Budget.** Each announce carries the durations of the rank's steps since its previous one and when the last
  ended (same host, same clock). A step during which no byte left the node is *clean*; the others are
  *loaded*. The baseline is
  the median of the last ``WINDOW`` clean steps, the load the median of the last ``WINDOW`` loaded ones, and the
  slowdown ``load / baseline - 1``. Every ``WINDOW / 2`` loaded steps it decides: past the budget
  (``--step-budget``, 1% by default) by more than two standard errors of the slowdown (steps vary; a cut needs
  evidence), the rate's factor is cut by ``CUT``; within the budget, it grows back by ``GROW`` up to 1 (the
  spread rate). Below the keep-up rate the ranks'
  snapshots fall behind and the ranks skip some (the stride grows, see the README's bound on steps lost), which
  is how a job with no CPU to spare buys back its step time.
- **Clean steps.** With a snapshot every step or every second step, a Snapshotter leaves out one due step in
  64 (:func:`snapshotd.client.schedule.left_out`), so that the step after it runs with no stream; with sparser
  snapshots, spread streams end a third of the interval early and leave whole steps clean.
- **Idle.** No step reported for ``IDLE_SECONDS`` (or 10 loaded steps): the job stopped, nothing is left to
  protect, and the rate is unpaced again; the factor starts over at 1.

A step longer than ``PAUSE`` times the rank's median step (an evaluation, a disk checkpoint, a run of steps
without snapshots) says nothing of snapshots and is not counted. A rank's keep-up rate needs three steps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = ["Pacer", "PacerState"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class PacerState:
    """What the pacer does now, for status and metrics."""

    rate: float
    """The rate limit, bytes/s (``inf``: unpaced)."""
    budget: float
    """The tolerated slowdown of a training step (0.01 = 1%)."""
    baseline_seconds: float
    """The median clean step (0: none yet)."""
    loaded_seconds: float
    """The median loaded step (0: none yet)."""
    slowdown: float
    """``loaded / baseline - 1`` (0 until both are known)."""
    keep_up_rate: float
    """The bytes/s the local ranks' snapshots need (0: unknown)."""
    cuts: int
    """Times the rate was cut for the budget."""
    mode: str
    """``fixed``, ``unpaced`` (auto, nothing to pace yet or the job idle), ``spread`` or ``budget`` (cut below
    the spread rate)."""


class _RankSteps:
    """One local rank's recent steps: the last announced, the gaps between them, and their durations."""

    __slots__ = ("gaps", "last", "seconds")

    def __init__(self, window: int) -> None:
        self.last = -1
        self.gaps: collections.deque[int] = collections.deque(maxlen=window)
        self.seconds: collections.deque[float] = collections.deque(maxlen=window)


class Pacer:
    """A token bucket, fixed or steered (see the module docstring). Runs on the sidecar's event loop.

    Args:
        rate: a fixed rate in bytes/s, or None for ``auto``.
        budget: with ``auto``, the tolerated relative growth of step time (0.01 = 1%).
        burst_seconds: how much unused rate may accumulate.
        clock: monotonic seconds (tests pass their own).
    """

    SEND_GAP = 0.02
    MIN_RATE = 10e6
    """``auto`` never paces below 10 MB/s: snapshots must still make progress."""
    SPREAD = 1.5
    WINDOW = 16
    PAUSE = 20.0
    CUT = 0.7
    GROW = 1.1
    IDLE_SECONDS = 3.0

    def __init__(self, rate: float | None, *, budget: float = 0.01, burst_seconds: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if budget <= 0:
            raise ValueError(f"the step budget must be positive, got {budget}")
        self.auto = rate is None
        self._fixed = math.inf if rate is None else float(rate)
        self.budget = budget
        self.burst_seconds = burst_seconds
        self._clock = clock
        self._tokens = 0.0
        self._stamp = clock()
        self._clean: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._loaded: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._demand: dict[Hashable, float] = {}
        self._ranks: dict[Hashable, _RankSteps] = {}
        self._factor = 1.0
        self._fresh = 0  # loaded steps since the last decision
        self._sending: collections.deque[list[float]] = collections.deque(maxlen=256)  # [start, end] of sends
        self._last_report = -math.inf
        self._observed_rate = 0.0
        self.cuts = 0

    # -- the bucket ------------------------------------------------------------------------------------------

    @property
    def rate(self) -> float:
        """The rate limit now, bytes/s; ``math.inf`` means unpaced."""
        if not self.auto:
            return self._fixed
        keep_up = self.keep_up_rate
        if keep_up <= 0 or self._idle():
            return math.inf
        return max(self.MIN_RATE, self.SPREAD * keep_up * self._factor)

    @property
    def keep_up_rate(self) -> float:
        return sum(self._demand.values())

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent under the current rate."""
        rate = self.rate
        now = self._clock()
        self.sent_at(now)
        if math.isinf(rate):
            self._stamp = now
            return
        self._tokens = min(rate * self.burst_seconds, self._tokens + (now - self._stamp) * rate)
        self._stamp = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / rate)
            self.sent_at(self._clock())

    def sent_at(self, when: float) -> None:
        """Bytes left the node at ``when``: sends less than ``SEND_GAP`` apart form one busy span."""
        if self._sending and when - self._sending[-1][1] <= self.SEND_GAP:
            self._sending[-1][1] = max(self._sending[-1][1], when)
        else:
            self._sending.append([when, when])

    def _busy(self, start: float, end: float) -> bool:
        """Whether any byte left the node between ``start`` and ``end``."""
        for s, e in reversed(self._sending):
            if e < start:
                return False
            if s <= end:
                return True
        return False

    @property
    def observed_rate(self) -> float:
        """The throughput of the last stream, bytes/s (0 before the first)."""
        return self._observed_rate

    def observe_throughput(self, bytes_per_s: float) -> None:
        self._observed_rate = bytes_per_s

    # -- the controller --------------------------------------------------------------------------------------

    def report_step(self, key: Hashable, step: int, steps: Sequence[float], steps_end: float, stream_bytes: int) -> None:
        """Local rank ``key`` announced a snapshot of ``step``: ``steps`` are the durations of its steps since its
        previous announce (oldest first), the last ending at ``steps_end`` (this clock; 0: now), and
        ``stream_bytes`` what the snapshot sends to all its buddies."""
        now = self._clock()
        if not self.auto:
            return
        rank = self._ranks.setdefault(key, _RankSteps(self.WINDOW))
        if 0 <= rank.last < step:
            rank.gaps.append(step - rank.last)
        rank.last = step
        end = steps_end if 0 < steps_end <= now else now
        timed = []
        for seconds in reversed(steps):  # newest first, back in time from the last one's end
            if seconds > 0:
                timed.append((end - seconds, end, seconds))
                end -= seconds
        if not timed:
            return
        if self._idle(now):
            self._factor, self._fresh = 1.0, 0
        self._last_report = now
        for start, stop, seconds in reversed(timed):
            typical = statistics.median(rank.seconds) if rank.seconds else None
            if typical is not None and seconds > self.PAUSE * typical:
                continue
            rank.seconds.append(seconds)
            if self._busy(start, stop):
                self._loaded.append(seconds)
                self._fresh += 1
            else:
                self._clean.append(seconds)
        if len(rank.seconds) >= 3:  # its usual step and the interval it runs at when it skips none
            self._demand[key] = stream_bytes / (min(rank.gaps, default=1) * statistics.median(rank.seconds))
        self._decide()

    def _decide(self) -> None:
        """Every ``WINDOW / 2`` fresh loaded steps, with 3 clean ones at least: cut or grow the factor."""
        if len(self._clean) < 3 or self._fresh < self.WINDOW // 2:
            return
        self._fresh = 0
        base = statistics.median(self._clean)
        slowdown = statistics.median(self._loaded) / base - 1
        if slowdown - self._noise(base) > self.budget:
            self._factor = max(self.MIN_RATE / max(self.SPREAD * self.keep_up_rate, self.MIN_RATE),
                               self._factor * self.CUT)  # fmt: skip
            self.cuts += 1
            log.info("pacer: steps %.1f%% slower than %.1f ms without a stream (budget %.1f%%); rate -> %.0f MB/s",
                     slowdown * 100, base * 1e3, self.budget * 100, self.rate / 1e6)  # fmt: skip
        else:
            self._factor = min(1.0, self._factor * self.GROW)

    def _noise(self, base: float) -> float:
        """Two standard errors of the slowdown: steps vary, and a cut needs more evidence than their noise."""

        def se(xs: collections.deque[float]) -> float:  # of a median: 1.25 sigma / sqrt(n), sigma from the MAD
            m = statistics.median(xs)
            return 1.25 * 1.4826 * statistics.median(abs(x - m) for x in xs) / math.sqrt(len(xs))

        return 2 * math.hypot(se(self._clean), se(self._loaded)) / base

    def _idle(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        recent = statistics.median(self._loaded) if self._loaded else 0.0
        return now - self._last_report > max(self.IDLE_SECONDS, 10 * recent)

    def state(self) -> PacerState:
        base = statistics.median(self._clean) if self._clean else 0.0
        load = statistics.median(self._loaded) if self._loaded else 0.0
        rate = self.rate
        if not self.auto:
            mode = "fixed"
        elif math.isinf(rate):
            mode = "unpaced"
        else:
            mode = "budget" if self._factor < 1.0 else "spread"
        return PacerState(rate=rate, budget=self.budget, baseline_seconds=base, loaded_seconds=load,
                          slowdown=load / base - 1 if base and load else 0.0, keep_up_rate=self.keep_up_rate,
                          cuts=self.cuts, mode=mode)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.state())
