"""The pacer: a fixed-rate token bucket, unpaced mode, and AIMD steered by reported step times."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from snapshotd.sidecar.pacer import Pacer


def timed_takes(pacer: Pacer, nbytes: int, count: int) -> float:
    async def run() -> float:
        t0 = time.monotonic()
        for _ in range(count):
            await pacer.take(nbytes)
        return time.monotonic() - t0

    return asyncio.run(run())


def test_fixed_rate_holds_the_stream_to_the_rate() -> None:
    rate = 40e6
    pacer = Pacer(rate)
    total = 8_000_000  # 0.2 s at 40 MB/s; at most burst_seconds (0.05 s) of it can be saved up
    elapsed = timed_takes(pacer, 100_000, total // 100_000)
    assert total / rate - pacer.burst_seconds - 0.01 <= elapsed <= 3 * total / rate, elapsed
    assert not pacer.auto and pacer.rate == rate


def test_idle_time_accumulates_at_most_one_burst() -> None:
    pacer = Pacer(10e6, burst_seconds=0.02)
    time.sleep(0.1)  # 1 MB of idle rate, but only 200 kB may be saved up
    assert timed_takes(pacer, 200_000, 1) < 0.01
    elapsed = timed_takes(pacer, 500_000, 1)
    assert 0.04 <= elapsed <= 0.5, elapsed  # 500 kB at 10 MB/s with an empty bucket


def test_unpaced_is_instant() -> None:
    pacer = Pacer(None)
    assert pacer.auto and math.isinf(pacer.rate)
    assert timed_takes(pacer, 1 << 30, 10_000) < 0.5


def test_fixed_rate_ignores_step_times() -> None:
    pacer = Pacer(5e6)
    for seconds in [0.1] * 5 + [1.0] * 10:
        pacer.report_step(seconds, streaming=seconds > 0.5)
    assert pacer.rate == 5e6


def feed(pacer: Pacer, seconds: float, n: int, streaming: bool = True) -> None:
    for _ in range(n):
        pacer.report_step(seconds, streaming=streaming)


def test_aimd_backs_off_when_step_time_grows_and_recovers_when_it_does_not() -> None:
    pacer = Pacer(None, budget=0.01)
    feed(pacer, 0.100, 4, streaming=False)  # the no-snapshot baseline
    feed(pacer, 0.1005, 6)  # within 1%: nothing to correct while unpaced
    assert math.isinf(pacer.rate)
    pacer.observe_throughput(200e6)
    feed(pacer, 0.120, 1)  # one slow step among four is not the median yet
    assert math.isinf(pacer.rate)
    feed(pacer, 0.120, 1)  # 20% slower: multiplicative cut from the observed throughput
    assert pacer.rate == pytest.approx(140e6)
    feed(pacer, 0.120, 3)
    assert pacer.rate == pytest.approx(140e6)  # after a cut, the next decision needs four fresh samples
    feed(pacer, 0.120, 1)
    assert pacer.rate == pytest.approx(98e6)
    cut = pacer.rate
    feed(pacer, 0.100, 4)  # the median is back at the baseline: additive increase on every report
    assert pacer.rate > cut
    grown = pacer.rate
    feed(pacer, 0.100, 10)
    assert pacer.rate > grown
    feed(pacer, 0.0, 10)  # unknown step times change nothing
    assert pacer.rate > grown


def test_aimd_never_throttles_below_the_floor() -> None:
    pacer = Pacer(None)
    feed(pacer, 0.05, 3, streaming=False)
    feed(pacer, 0.5, 200)
    assert pacer.rate == Pacer.MIN_RATE
    assert timed_takes(pacer, 100_000, 1) < 0.5


def test_aimd_waits_for_a_baseline() -> None:
    pacer = Pacer(None)
    feed(pacer, 0.05, 2, streaming=False)
    feed(pacer, 1.0, 8)  # slow steps, but no baseline to compare with yet
    assert math.isinf(pacer.rate)
    pacer.report_step(0.05, streaming=False)
    feed(pacer, 1.0, 4)
    assert pacer.rate == pytest.approx(Pacer.MIN_RATE * 10 * 0.7)  # nothing observed: cut from 100 MB/s
