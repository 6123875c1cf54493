"""The pacer: a fixed-rate token bucket; ``auto``: unpaced until a rank reports, then spread at 1.5x the keep-up
rate, cut for the step budget against clean steps, unpaced again when the job goes idle."""

from __future__ import annotations

import asyncio
import math

import pytest

from snapshotd.sidecar.pacer import Pacer


class Clock:
    """A monotonic clock the test moves; :meth:`sleep` advances it instead of waiting."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


def timed_takes(pacer: Pacer, clock: Clock, nbytes: int, count: int) -> float:
    """The seconds of ``clock`` that ``count`` takes of ``nbytes`` waited in all."""

    async def run() -> float:
        t0 = clock()
        for _ in range(count):
            await pacer.take(nbytes)
        return clock() - t0

    return asyncio.run(run())


def paced(rate: float | None, **kwargs) -> tuple[Pacer, Clock]:
    clock = Clock()
    return Pacer(rate, clock=clock, sleep=clock.sleep, **kwargs), clock


def test_fixed_rate_holds_the_stream_to_the_rate() -> None:
    rate = 40e6
    pacer, clock = paced(rate)
    total = 8_000_000  # 0.2 s at 40 MB/s; the bucket starts empty
    assert timed_takes(pacer, clock, 100_000, total // 100_000) == pytest.approx(total / rate)
    assert not pacer.auto and pacer.rate == rate


def test_idle_time_accumulates_at_most_one_burst() -> None:
    pacer, clock = paced(10e6, burst_seconds=0.02)
    clock.t += 0.1  # 1 MB of idle rate, but only 200 kB may be saved up
    assert timed_takes(pacer, clock, 200_000, 1) == 0.0
    assert timed_takes(pacer, clock, 500_000, 1) == pytest.approx(0.05)  # 500 kB at 10 MB/s, the bucket empty


def test_unpaced_is_instant() -> None:
    pacer, clock = paced(None)
    assert pacer.auto and math.isinf(pacer.rate)
    assert timed_takes(pacer, clock, 1 << 30, 10_000) == 0.0


MB = 1_000_000
RANK = ("job", 0)


def step(
    pacer: Pacer, clock: Clock, seconds: float, *, loaded: bool, n: int = 1, nbytes: int = 100 * MB
) -> None:
    """``n`` steps of ``seconds`` each, a byte sent during each when ``loaded``, every one announced (a snapshot
    of ``nbytes`` after every step)."""
    for _ in range(n):
        if loaded:
            clock.t += seconds / 2
            with pacer.streaming(RANK):  # what send_snapshot wraps each stream in
                clock.t += seconds / 4
            clock.t += seconds / 4
        else:
            clock.t += seconds
        step.count = getattr(step, "count", 0) + 1  # type: ignore[attr-defined]
        pacer.report_step(RANK, step.count, [seconds], clock.t, nbytes)  # type: ignore[attr-defined]


def cut_for_the_budget() -> tuple[Clock, Pacer]:
    """A pacer that has cut its rate below the spread: loaded steps twice as long as the clean ones."""
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    step(pacer, clock, 0.1, loaded=False, n=4)
    step(pacer, clock, 0.2, loaded=True, n=16)
    assert pacer.state().mode == "budget" and math.isfinite(pacer.rate)
    return clock, pacer


def test_fixed_rate_ignores_step_times() -> None:
    clock = Clock()
    pacer = Pacer(5e6, clock=clock)
    step(pacer, clock, 0.1, loaded=False, n=5)
    step(pacer, clock, 1.0, loaded=True, n=20)
    assert pacer.rate == 5e6 and pacer.state().mode == "fixed"


def test_auto_spreads_streams_at_one_and_a_half_times_the_keep_up_rate() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    assert math.isinf(pacer.rate) and pacer.state().mode == "unpaced"  # no rank reported yet
    step(pacer, clock, 0.5, loaded=True, n=3)  # 100 MB after every 0.5 s step: 200 MB/s keeps up
    assert pacer.keep_up_rate == pytest.approx(200 * MB)
    assert pacer.rate == pytest.approx(300 * MB) and pacer.state().mode == "spread"


def test_the_keep_up_rate_follows_the_interval_the_rank_runs_at_not_its_skips() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    for s in (4, 8, 12, 20, 24):  # every 4th step, and one skipped (12 -> 20)
        clock.t += 0.5
        pacer.report_step(RANK, s, [0.5], clock.t, 100 * MB)
    assert pacer.keep_up_rate == pytest.approx(100 * MB / (4 * 0.5))


def test_budget_cuts_the_rate_while_steps_are_slower_and_grows_it_back() -> None:
    clock = Clock()
    pacer = Pacer(None, budget=0.01, clock=clock)
    step(pacer, clock, 0.100, loaded=False, n=4)  # the clean baseline
    step(pacer, clock, 0.1005, loaded=True, n=16)  # within 1%
    spread = pacer.rate
    assert pacer.cuts == 0 and pacer.state().mode == "spread"
    step(pacer, clock, 0.120, loaded=True, n=16)  # 20% slower
    assert pacer.cuts >= 1 and pacer.rate < spread and pacer.state().mode == "budget"
    # a cut forgets the loaded steps: these are all at the new rate
    step(pacer, clock, 0.120, loaded=True, n=3)
    assert pacer.state().slowdown == pytest.approx(0.2, rel=0.05)
    cut = pacer.rate
    step(pacer, clock, 0.120, loaded=True, n=8)
    assert pacer.rate < cut  # still over: cut again
    # back within the budget: the factor grows back to the spread
    step(pacer, clock, 0.100, loaded=True, n=160)
    assert pacer.rate == pytest.approx(spread, rel=0.01) and pacer.state().mode == "spread"


def test_a_slowdown_within_the_noise_of_the_steps_is_no_evidence() -> None:
    clock = Clock()
    pacer = Pacer(None, budget=0.01, clock=clock)
    for i in range(16):  # clean steps that vary by +-10%
        step(pacer, clock, 0.100 * (0.9 if i % 2 else 1.1), loaded=False)
    for i in range(32):  # loaded ones 3% slower in the median, well within that noise
        step(pacer, clock, 0.103 * (0.9 if i % 2 else 1.1), loaded=True)
    assert pacer.cuts == 0 and pacer.state().slowdown > 0.01


def test_budget_never_cuts_below_the_floor() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    step(pacer, clock, 0.05, loaded=False, n=3)
    step(pacer, clock, 0.5, loaded=True, n=200)
    assert pacer.rate == pytest.approx(Pacer.MIN_RATE)


def test_no_cut_without_a_clean_baseline() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    step(pacer, clock, 1.0, loaded=True, n=64)  # slow, but nothing to compare with
    assert pacer.cuts == 0 and pacer.state().baseline_seconds == 0 and pacer.state().mode == "spread"


def test_a_long_pause_says_nothing_of_snapshots() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    step(pacer, clock, 0.1, loaded=False, n=4)
    step(pacer, clock, 0.1, loaded=True, n=4)
    keep_up = pacer.keep_up_rate
    step(pacer, clock, 5.0, loaded=True, n=3)  # an evaluation pass: 50 usual steps
    assert pacer.cuts == 0 and pacer.state().loaded_seconds == pytest.approx(0.1)
    assert pacer.keep_up_rate == keep_up  # the streams after it are not paced for 5 s steps


def test_an_idle_job_unpaces_and_starts_over() -> None:
    clock, pacer = cut_for_the_budget()
    clock.t += Pacer.IDLE_SECONDS + 1  # the job stopped reporting
    assert math.isinf(pacer.rate) and pacer.state().mode == "unpaced"
    # it came back (announcing before it streams again): the spread rate
    step(pacer, clock, 0.1, loaded=False)
    # again, cut only by fresh evidence
    assert pacer.state().mode == "spread"


def test_a_rank_whose_snapshot_still_streams_is_not_idle_though_it_announces_nothing() -> None:
    clock, pacer = cut_for_the_budget()
    paced = pacer.rate
    # a stream at the cut rate outlasts the idle time: the rank skips every due step
    with pacer.streaming(RANK):
        clock.t += 5 * Pacer.IDLE_SECONDS
        assert pacer.rate == paced and pacer.state().mode == "budget"
    clock.t += Pacer.IDLE_SECONDS / 2  # its silence counts from the stream's end
    assert pacer.rate == paced
    clock.t += Pacer.IDLE_SECONDS
    assert math.isinf(pacer.rate) and pacer.state().mode == "unpaced"


def test_a_rank_that_ended_is_not_active_though_its_last_snapshot_still_streams() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    step(pacer, clock, 0.1, loaded=False, n=4)
    assert math.isfinite(pacer.rate)
    with pacer.streaming(RANK):
        pacer.forget(RANK)  # its process died, or it closed its Snapshotter: the job stopped
        assert math.isinf(pacer.rate) and pacer.state().mode == "unpaced"
    assert RANK not in pacer._ranks


def test_step_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="budget"):
        Pacer(None, budget=0)


def test_each_step_since_the_last_announce_is_told_clean_or_loaded_by_when_bytes_left() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    t0 = clock.t
    clock.t = t0 + 0.05
    with pacer.streaming(RANK):  # a stream from the middle of the first of four 0.1 s steps into the second
        clock.t = t0 + 0.12
    clock.t = t0 + 0.4 + 0.003  # the announce comes a little after the last step ended
    pacer.report_step(RANK, 4, [0.1, 0.1, 0.1, 0.1], t0 + 0.4, 100 * MB)
    rank = pacer._ranks[RANK]
    assert (len(rank.loaded), len(rank.clean)) == (2, 2)
    # a steps_end on no clock this pacer knows is taken as now: the four steps end at the announce
    clock.t += 0.4
    pacer.report_step(RANK, 8, [0.1] * 4, 12345.0, 100 * MB)
    assert (len(rank.loaded), len(rank.clean)) == (2, 6)


def test_the_keep_up_rate_keeps_the_smallest_interval_through_a_long_skip() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    for s in [1, 2, 3, *range(5, 45, 2)]:  # every step, then every second one for 20 announces
        clock.t += 0.1
        pacer.report_step(RANK, s, [0.1], clock.t, 10 * MB)
    assert pacer.keep_up_rate == pytest.approx(10 * MB / 0.1)


def test_a_silent_rank_stops_counting_and_is_forgotten() -> None:
    clock = Clock()
    pacer = Pacer(None, clock=clock)
    step(pacer, clock, 0.1, loaded=True, n=4)
    other = ("other-job", 3)
    for s in range(1, 5):
        clock.t += 0.1
        pacer.report_step(other, s, [0.1], clock.t, 50 * MB)
    assert pacer.keep_up_rate == pytest.approx(1000 * MB + 500 * MB)
    for _ in range(40):  # 4 s of steps from the first rank only: the other job stopped
        step(pacer, clock, 0.1, loaded=True)
    assert pacer.keep_up_rate == pytest.approx(1000 * MB)
    clock.t += Pacer.FORGET_SECONDS + 1
    step(pacer, clock, 0.1, loaded=True)
    assert other not in pacer._ranks
