"""Keep snapshot streams inside the node's bandwidth budget (DESIGN.md "Network-aware pacing").

:class:`Pacer` is a token bucket shared by every outgoing stream of the sidecar. Its rate is either fixed
(``--max-rate 10Gbit``) or, with ``--max-rate auto``, steered by AIMD from the step times the local ranks report:
while step time stays within ``budget`` of its no-snapshot baseline the rate grows additively; when it grows past
it the rate is cut multiplicatively.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import time

__all__ = ["Pacer"]

log = logging.getLogger(__name__)


class Pacer:
    """A token bucket. ``rate`` is bytes per second; ``math.inf`` means unpaced.

    Args:
        rate: a fixed rate in bytes/s, or None for ``auto``.
        budget: with ``auto``, the tolerated relative growth of step time (0.01 = 1%).
        burst_seconds: how much unused rate may accumulate.
    """

    MIN_RATE = 10e6  # auto never throttles below 10 MB/s: snapshots must still make progress
    WINDOW = 16

    def __init__(self, rate: float | None, *, budget: float = 0.01, burst_seconds: float = 0.05) -> None:
        self.auto = rate is None
        self.rate = math.inf if rate is None else float(rate)
        self.budget = budget
        self.burst_seconds = burst_seconds
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._baseline: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._recent: collections.deque[float] = collections.deque(maxlen=4)
        self._observed_rate = 0.0

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent under the current rate."""
        if math.isinf(self.rate):
            return
        now = time.monotonic()
        cap = self.rate * self.burst_seconds
        self._tokens = min(cap, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)

    @property
    def observed_rate(self) -> float:
        """The throughput of the last stream, bytes/s (0 before the first)."""
        return self._observed_rate

    def observe_throughput(self, bytes_per_s: float) -> None:
        """Record the rate a finished stream achieved (the starting point when ``auto`` first backs off)."""
        self._observed_rate = bytes_per_s

    def report_step(self, step_seconds: float, streaming: bool) -> None:
        """A rank's step time. Steps run while nothing streamed form the baseline; the others steer AIMD."""
        if not self.auto or step_seconds <= 0:
            return
        if not streaming:
            self._baseline.append(step_seconds)
            return
        self._recent.append(step_seconds)
        if len(self._baseline) < 3 or len(self._recent) < self._recent.maxlen:  # type: ignore[operator]
            return
        base = statistics.median(self._baseline)
        now = statistics.median(self._recent)
        if now > base * (1 + self.budget):
            start = self.rate if not math.isinf(self.rate) else max(self._observed_rate, self.MIN_RATE * 10)
            self.rate = max(self.MIN_RATE, start * 0.7)
            self._recent.clear()
            log.info("pacer: step time %.1f ms > baseline %.1f ms; rate -> %.0f MB/s", now * 1e3, base * 1e3, self.rate / 1e6)
        elif not math.isinf(self.rate):
            self.rate += max(self.rate * 0.05, 5e6)
