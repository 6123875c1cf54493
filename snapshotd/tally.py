"""Durations the daemons observe again and again, kept as a Prometheus histogram's figures without Prometheus.

The daemons' state (the sidecar's :class:`~snapshotd.sidecar.node.Counters`, the coordinator's jobs) holds a
:class:`Tally` per kind of duration; :mod:`snapshotd.metrics` turns its figures into a histogram family at a
scrape. Every tally shares the bounds :data:`LATENCY_BUCKETS`, so that one dashboard query fits them all.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

__all__ = ["LATENCY_BUCKETS", "Tally"]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
"""Upper bounds, in seconds, of a histogram's buckets: from a heartbeat's round trip on loopback (a millisecond)
to a restore of a large rank pulled over a slow link (minutes). A value above the last counts only in ``+Inf``."""


def _no_observations() -> list[int]:
    return [0] * (len(LATENCY_BUCKETS) + 1)


@dataclasses.dataclass(slots=True)
class Tally:
    """Count, sum and last value of something observed repeatedly, and how many observations fell in each
    bucket of :data:`LATENCY_BUCKETS`."""

    count: int = 0
    total: float = 0.0
    last: float = 0.0
    """The latest observation (meaningless while ``count`` is 0)."""
    per_bucket: list[int] = dataclasses.field(default_factory=_no_observations)
    """Observations in each bucket alone (not cumulative): above the previous bound, at or under this one; the
    last entry counts those above every bound."""

    def add(self, value: float) -> None:
        """Count ``value`` (seconds); one that is not a finite number of zero or more is left out."""
        if not (math.isfinite(value) and value >= 0):
            return
        self.count += 1
        self.total += value
        self.last = value
        self.per_bucket[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1

    def buckets(self) -> list[tuple[float, int]]:
        """``(bound, observations at or under it)`` for every bound of :data:`LATENCY_BUCKETS`, in order: a
        histogram's cumulative ``le`` buckets, but ``+Inf`` (which is :attr:`count`)."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip(LATENCY_BUCKETS, self.per_bucket, strict=False):
            running += n
            out.append((bound, running))
        return out
