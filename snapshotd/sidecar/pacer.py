"""Keep snapshot streams inside the node's bandwidth and the job's step-time budget (docs/design.md "Pacing").

:class:`Pacer` is a token bucket shared by every outgoing snapshot stream of the sidecar. With ``--max-rate
RATE`` its rate is fixed. With ``--max-rate auto`` (the default) it acts on the steps the local ranks report with
each announce (their durations since the rank's previous announce, and when the last one ended: the ranks are on
this host, so on this clock):

- **Spread.** A stream sent as fast as the wire goes takes the cores it needs at once, beside the training
  thread; the same bytes spread over the interval leave training the cores it had. So the rate is ``SPREAD``
  times the *keep-up rate*: what the local ranks' snapshots must move (each rank's snapshot bytes, times its
  buddies, over its snapshot interval, the smallest gap seen between its announced steps, times its median
  step). Streams then end with a third of the interval to spare.
- **Budget.** A step during which no snapshot stream of this node was in flight is *clean*; the others are
  *loaded*. Per rank, the baseline is the median of its last ``WINDOW`` clean steps and the load the median of
  its last ``WINDOW`` loaded ones; the slowdown is ``load / baseline - 1``: what snapshots cost its steps (the
  staging copy in the rank and the streams). Every ``WINDOW / 2`` fresh loaded steps of a rank the pacer
  decides: past ``--step-budget`` (1% by default) by more than two standard errors (steps vary; a cut needs
  evidence), the rate's factor is cut by ``CUT`` and every rank's loaded steps are forgotten, so that the next
  decision sees only steps at the new rate; within the budget, the factor grows by ``GROW`` up to 1 (the spread
  rate). Below the keep-up rate the ranks' snapshots fall behind and the ranks skip some (the stride grows; the
  README states the bound on steps lost), which is how a job with no CPU to spare keeps its step time.
- **Clean steps.** With a snapshot every step or every second step, a Snapshotter leaves out one due step in
  64 (:func:`snapshotd.client.schedule.left_out`), so that the step after it runs with no stream; sparser
  schedules leave clean steps at the spread rate.
- **Idle.** A rank that ended (its process died, or it closed its Snapshotter: :meth:`Pacer.forget`) is not
  active. Otherwise it is active while a stream of its snapshot is in flight (it skips its due snapshots
  meanwhile, and announces none: below the keep-up rate that silence is the pacing at work, not a stopped job)
  and until it has been silent for three of its snapshot intervals (``IDLE_SECONDS`` at least) since. With no rank active the
  job stopped: the rate is unpaced and the factor starts over at 1. A rank silent for ``FORGET_SECONDS`` is
  forgotten.

A step longer than ``PAUSE`` times the rank's median step (an evaluation, a disk checkpoint, a run of steps
without snapshots) says nothing of snapshots and is not counted. A rank's keep-up rate needs three steps.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence

__all__ = ["Pacer", "PacerState"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class PacerState:
    """What the pacer does now, for status and metrics."""

    rate: float
    """The rate limit, bytes/s (``inf``: unpaced)."""
    budget: float
    """The tolerated slowdown of a training step (0.01 = 1%; 0 with a fixed rate)."""
    baseline_seconds: float
    """The most slowed rank's median clean step (0: none yet)."""
    loaded_seconds: float
    """Its median loaded step (0: none since the last cut)."""
    slowdown: float
    """Its ``loaded / baseline - 1`` (0 until it has 3 of each)."""
    keep_up_rate: float
    """The bytes/s the active local ranks' snapshots need (0: none known)."""
    cuts: int
    """Times the rate was cut for the budget."""
    mode: str
    """``fixed``, ``unpaced`` (auto, with no rank active), ``spread`` or ``budget`` (cut below the spread)."""


class _Rank:
    """One local rank's recent steps, as its announces told them."""

    __slots__ = ("clean", "demand", "every", "fresh", "gap", "last", "loaded", "reported", "seconds")

    def __init__(self, window: int) -> None:
        self.last = -1  # the step of its last announce
        self.gap = 1  # steps between its last two announces
        self.every = 0  # the smallest gap seen (0: none yet)
        self.seconds: collections.deque[float] = collections.deque(maxlen=window)
        self.clean: collections.deque[float] = collections.deque(maxlen=window)
        self.loaded: collections.deque[float] = collections.deque(maxlen=window)
        self.fresh = 0  # loaded steps since its last decision
        self.demand = 0.0  # bytes/s its snapshots need
        self.reported = -math.inf  # when it last announced, or its last stream ended if later

    def silent_for(self, now: float) -> float:
        """Seconds since its last announce, in units of its snapshot interval's length (at least 1 s)."""
        interval = self.gap * statistics.median(self.seconds) if self.seconds else 0.0
        return (now - self.reported) / max(1.0, interval)

    def slowdown(self) -> tuple[float, float, float, float] | None:
        """(baseline, load, slowdown, two standard errors of it), once it has 3 clean and 3 loaded steps."""
        if len(self.clean) < 3 or len(self.loaded) < 3:
            return None
        base, load = statistics.median(self.clean), statistics.median(self.loaded)
        noise = 2 * math.hypot(_median_se(self.clean), _median_se(self.loaded)) / base
        return base, load, load / base - 1, noise


def _median_se(xs: collections.deque[float]) -> float:
    """The standard error of a median: 1.25 sigma / sqrt(n), sigma from the median absolute deviation."""
    m = statistics.median(xs)
    return 1.25 * 1.4826 * statistics.median(abs(x - m) for x in xs) / math.sqrt(len(xs))


class Pacer:
    """A token bucket, fixed or steered (see the module docstring). Runs on the sidecar's event loop.

    Args:
        rate: a fixed rate in bytes/s, or None for ``auto``.
        budget: with ``auto``, the tolerated relative growth of step time (0.01 = 1%).
        burst_seconds: how much unused rate may accumulate.
        clock: monotonic seconds (tests pass their own).
        sleep: how :meth:`take` waits, in seconds of ``clock`` (tests pass one that advances their clock).
    """

    MIN_RATE = 10e6
    """``auto`` never paces below 10 MB/s: snapshots must still make progress."""
    SPREAD = 1.5
    WINDOW = 16
    PAUSE = 20.0
    CUT = 0.7
    GROW = 1.1
    IDLE_SECONDS = 3.0
    IDLE_INTERVALS = 3.0
    FORGET_SECONDS = 600.0

    def __init__(
        self,
        rate: float | None,
        *,
        budget: float = 0.01,
        burst_seconds: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if budget <= 0:
            raise ValueError(f"the step budget must be positive, got {budget}")
        self.auto = rate is None
        self.cap = math.inf if rate is None else float(rate)
        """The fixed rate (``inf`` with auto): the link's limit, as far as this pacer knows it (the codec policy
        weighs compression against it, never against the spread)."""
        self.budget = budget
        self.burst_seconds = burst_seconds
        self._clock = clock
        self._sleep = sleep
        self._tokens = 0.0
        self._stamp = clock()
        self._ranks: dict[Hashable, _Rank] = {}
        self._factor = 1.0
        self._streams = 0  # in flight now
        # rank -> its streams in flight
        self._streaming: collections.Counter[Hashable] = collections.Counter()
        # [start, end] of streaming
        self._spans: collections.deque[list[float]] = collections.deque(maxlen=1024)
        self._observed_rate = 0.0
        self.cuts = 0

    # -- the bucket ------------------------------------------------------------------------------------------

    @property
    def rate(self) -> float:
        """The rate limit now, bytes/s; ``math.inf`` means unpaced."""
        if not self.auto:
            return self.cap
        keep_up = self.keep_up_rate
        if keep_up <= 0:
            return math.inf
        return max(self.MIN_RATE, self.SPREAD * keep_up * self._factor)

    @property
    def keep_up_rate(self) -> float:
        """What the active local ranks' snapshots need, bytes/s."""
        return sum(r.demand for r in self._active())

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent under the current rate."""
        rate = self.rate
        now = self._clock()
        if math.isinf(rate):
            self._stamp = now
            return
        self._tokens = min(rate * self.burst_seconds, self._tokens + (now - self._stamp) * rate)
        self._stamp = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await self._sleep(-self._tokens / rate)

    @contextlib.contextmanager
    def streaming(self, key: Hashable) -> Iterator[None]:
        """Around one outgoing stream of local rank ``key``'s snapshot, begin to end: the steps it overlaps are
        loaded, and the rank is active while it lasts."""
        if self._streams == 0:
            self._spans.append([self._clock(), math.inf])
        self._streams += 1
        self._streaming[key] += 1
        try:
            yield
        finally:
            self._streams -= 1
            self._streaming[key] -= 1
            if not self._streaming[key]:
                del self._streaming[key]
                rank = self._ranks.get(key)
                if rank is not None:  # its silence starts now
                    rank.reported = max(rank.reported, self._clock())
            if self._streams == 0:
                self._spans[-1][1] = self._clock()

    def _busy(self, start: float, end: float) -> bool:
        """Whether a stream was in flight at some moment between ``start`` and ``end``."""
        for s, e in reversed(self._spans):
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

    def report_step(
        self, key: Hashable, step: int, steps: Sequence[float], steps_end: float, stream_bytes: int
    ) -> None:
        """Local rank ``key`` announced a snapshot of ``step``: ``steps`` are the durations of its steps since its
        previous announce (oldest first), the last ending at ``steps_end`` (this clock; 0: unknown), and
        ``stream_bytes`` what the snapshot sends to all its buddies."""
        if not self.auto:
            return
        now = self._clock()
        if not self._active(now):  # the job had stopped (or this is the first): the factor starts over
            self._factor = 1.0
        for k, r in list(self._ranks.items()):
            if now - r.reported > self.FORGET_SECONDS and k not in self._streaming:
                del self._ranks[k]
        rank = self._ranks.setdefault(key, _Rank(self.WINDOW))
        rank.reported = now
        if 0 <= rank.last < step:
            rank.gap = step - rank.last
            rank.every = min(rank.every or rank.gap, rank.gap)
        rank.last = step
        total = sum(s for s in steps if s > 0)
        # a time on another clock (or none) is taken as now: the announce follows its last step closely
        end = steps_end if 0 < steps_end <= now and now - steps_end <= total + 1.0 else now
        timed = []
        for seconds in reversed(steps):  # newest first, back in time from the last one's end
            if seconds > 0:
                timed.append((end - seconds, end, seconds))
                end -= seconds
        for start, stop, seconds in reversed(timed):
            if rank.seconds and seconds > self.PAUSE * statistics.median(rank.seconds):
                continue
            rank.seconds.append(seconds)
            if self._busy(start, stop):
                rank.loaded.append(seconds)
                rank.fresh += 1
            else:
                rank.clean.append(seconds)
        if len(rank.seconds) >= 3:
            rank.demand = stream_bytes / (max(1, rank.every) * statistics.median(rank.seconds))
        self._decide(rank)

    def forget(self, key: Hashable) -> None:
        """Local rank ``key`` ended (its process died, or it closed its Snapshotter): it is no longer active, even
        while its last snapshot still streams."""
        self._ranks.pop(key, None)

    def _decide(self, rank: _Rank) -> None:
        """Every ``WINDOW / 2`` fresh loaded steps of ``rank``: cut the factor, or grow it back."""
        measured = rank.slowdown()
        if measured is None or rank.fresh < self.WINDOW // 2:
            return
        rank.fresh = 0
        base, _, slowdown, noise = measured
        if slowdown - noise > self.budget:
            self._factor = max(
                self.MIN_RATE / max(self.SPREAD * self.keep_up_rate, self.MIN_RATE), self._factor * self.CUT
            )
            self.cuts += 1
            for r in self._ranks.values():  # the next decision sees only steps at the new rate
                r.loaded.clear()
                r.fresh = 0
            log.info(
                "pacer: steps %.1f%% slower than %.1f ms without a stream (budget %.1f%%); rate -> %.0f MB/s",
                slowdown * 100,
                base * 1e3,
                self.budget * 100,
                self.rate / 1e6,
            )
        elif slowdown <= self.budget:
            self._factor = min(1.0, self._factor * self.GROW)

    def _active(self, now: float | None = None) -> list[_Rank]:
        now = self._clock() if now is None else now
        return [
            r
            for k, r in self._ranks.items()
            if k in self._streaming
            or r.silent_for(now) <= self.IDLE_INTERVALS
            or now - r.reported <= self.IDLE_SECONDS
        ]

    def state(self) -> PacerState:
        rate = self.rate
        if not self.auto:
            mode = "fixed"
        elif math.isinf(rate):
            mode = "unpaced"
        else:
            mode = "budget" if self._factor < 1.0 else "spread"
        seen = [(r.slowdown() or (0.0, 0.0, 0.0, 0.0), r) for r in self._active()]
        (_, _, slowdown, _), worst = max(seen, key=lambda m: m[0][2], default=((0.0, 0.0, 0.0, 0.0), None))
        base = statistics.median(worst.clean) if worst is not None and worst.clean else 0.0
        load = statistics.median(worst.loaded) if worst is not None and worst.loaded else 0.0
        return PacerState(
            rate=rate,
            budget=self.budget if self.auto else 0.0,
            baseline_seconds=base,
            loaded_seconds=load,
            slowdown=slowdown,
            keep_up_rate=self.keep_up_rate,
            cuts=self.cuts,
            mode=mode,
        )
