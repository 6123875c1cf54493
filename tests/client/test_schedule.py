"""``every="auto"``: the interval follows the measured cost of a snapshot and keeps ranks on common steps."""

from __future__ import annotations

import pytest

from snapshotd.client.schedule import CLEAN_EVERY, AlignedStride, AutoInterval, left_out, max_steps_lost


def simulate(
    sched: AutoInterval, steps: int, *, base: float, extra_per_step: float, busy_steps: int
) -> tuple[list[int], float]:
    """A training loop whose steps take ``base`` s, plus ``extra_per_step`` for each of the ``busy_steps`` steps
    after a snapshot starts (it is in flight for those). Returns the snapshotted steps and the mean slowdown."""
    started: list[int] = []
    busy_left = 0
    total = 0.0
    for step in range(1, steps + 1):
        t = base + (extra_per_step if busy_left else 0.0)
        busy_left = max(0, busy_left - 1)
        total += t
        start = sched.due(step) and busy_left == 0  # a slot is free only when the previous one is durable
        if start:
            started.append(step)
            busy_left = busy_steps
        sched.record(t if step > 1 else None, started=start, in_flight=busy_left > 0)
    return started, total / (steps * base) - 1


def test_first_step_is_due_and_the_interval_starts_wide() -> None:
    sched = AutoInterval()
    assert sched.due(1) and sched.interval == AutoInterval.START
    sched.record(None, started=True, in_flight=True)
    assert not sched.due(2) and sched.due(AutoInterval.START)


def test_interval_grows_until_the_cost_fits_the_budget() -> None:
    sched = AutoInterval(budget=0.01)
    # each snapshot slows two steps by 0.1 s: 0.2 s per snapshot, 20 steps of 1 s per snapshot for 1%
    started, slowdown = simulate(sched, 2000, base=1.0, extra_per_step=0.1, busy_steps=2)
    assert sched.baseline_seconds == pytest.approx(1.0)
    assert sched.cost_seconds == pytest.approx(0.2)
    assert sched.interval == 32
    assert all(s % 32 == 0 for s in started[-10:])
    assert slowdown < 0.012  # the warm-up at the start interval costs a little more
    assert 2000 // 32 - 10 <= len(started) <= 2000 // 32 + 40


def test_the_first_snapshots_one_time_costs_do_not_set_the_interval() -> None:
    sched = AutoInterval(budget=0.01)
    # the first two snapshots slow their steps tenfold (the buddy's fresh buffers), the later ones 0.1 s a step
    simulate(sched, 2 * AutoInterval.START + 1, base=1.0, extra_per_step=1.0, busy_steps=2)
    assert sched.cost_seconds is None and sched.interval == AutoInterval.START
    simulate(sched, 2000, base=1.0, extra_per_step=0.1, busy_steps=2)
    assert sched.cost_seconds == pytest.approx(0.2) and sched.interval == 32


def test_free_snapshots_go_every_step_except_the_probes() -> None:
    sched = AutoInterval(budget=0.01)
    started, slowdown = simulate(sched, 640, base=0.5, extra_per_step=0.0, busy_steps=1)
    assert sched.interval == 1 and slowdown == 0.0
    late = [s for s in started if s > 128]
    probes = {s for s in range(129, 641) if s % 64 >= 61}
    assert not probes & set(late)
    assert len(late) == (640 - 128) - len(probes)


def test_back_to_back_snapshots_are_still_costed() -> None:
    sched = AutoInterval(budget=0.01)
    # a snapshot is in flight 40 steps (a slow link): no clean step between them once it runs every step
    simulate(sched, 3000, base=1.0, extra_per_step=0.05, busy_steps=40)
    assert sched.cost_seconds is not None and sched.cost_seconds > 1.0
    assert sched.interval >= 128


def test_ranks_with_estimates_a_factor_two_apart_share_steps() -> None:
    a, b = AutoInterval(), AutoInterval()
    started_a, _ = simulate(a, 1024, base=1.0, extra_per_step=0.08, busy_steps=2)
    started_b, _ = simulate(b, 1024, base=1.0, extra_per_step=0.16, busy_steps=2)
    assert b.interval == 2 * a.interval
    common = set(started_a) & set(started_b)
    assert {s for s in range(512, 1025) if s % b.interval == 0} <= common


def test_budget_must_be_a_fraction() -> None:
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="budget"):
            AutoInterval(budget=bad)


def test_a_pause_of_the_loop_is_not_charged_to_the_snapshot() -> None:
    sched = AutoInterval(budget=0.01)
    simulate(sched, 600, base=1.0, extra_per_step=0.1, busy_steps=2)
    assert sched.interval == 32
    step = 608  # due; the step after it is an hour-long evaluation while the snapshot is still in flight
    assert sched.due(step)
    sched.record(1.0, started=True, in_flight=True)
    sched.record(3600.0, started=False, in_flight=False)
    for _ in range(5):
        sched.record(1.0, started=False, in_flight=False)
    assert sched.interval == 32 and sched.cost_seconds == pytest.approx(0.2)


def test_aligned_stride_doubles_when_busy_and_halves_when_free_midway_twice() -> None:
    s = AlignedStride(2)
    assert [t for t in range(1, 9) if s.due(t)] == [2, 4, 6, 8]
    s.record(2, slot_free=False)  # a due step found every slot busy
    assert s.stride == 4 and not s.due(6) and s.due(8)
    s.record(8, slot_free=False)
    assert s.stride == 8
    s.record(10, slot_free=True)  # neither due nor midway: no change
    s.record(12, slot_free=True)  # midway between due steps 8 and 16, a slot was free
    s.record(16, slot_free=True)  # due: taken
    s.record(20, slot_free=False)  # midway, busy: the count starts again
    s.record(28, slot_free=True)
    assert s.stride == 8
    s.record(36, slot_free=True)  # midway again: twice in a row
    assert s.stride == 4


def test_aligned_strides_of_two_ranks_share_the_larger_ones_steps() -> None:
    slow, fast = AlignedStride(1), AlignedStride(1)
    for t in (1, 2, 4, 8):
        slow.record(t, slot_free=False)
    assert (slow.stride, fast.stride) == (16, 1)
    assert all(fast.due(t) for t in range(1, 200) if slow.due(t))


def test_aligned_stride_is_bounded() -> None:
    s = AlignedStride(3)
    for t in range(3, 3 * 1_000, 3):
        if s.due(t):
            s.record(t, slot_free=False)
    assert s.stride == 3 * AlignedStride.MAX_FACTOR
    with pytest.raises(ValueError, match="every must be at least 1"):
        AlignedStride(0)


def test_every_step_leaves_out_one_due_step_in_64_so_the_next_runs_clean() -> None:
    assert [s for s in range(1, 200) if left_out(s, 1)] == [63, 127, 191]
    assert [s for s in range(2, 400, 2) if left_out(s, 2)] == [126, 254, 382]
    assert not any(left_out(s, 3) for s in range(0, 3000, 3))  # sparser schedules leave clean steps anyway
    assert CLEAN_EVERY == 64


def test_the_bound_on_steps_lost_counts_the_slots_ahead_and_a_step_left_out() -> None:
    # every step due, three slots: two snapshots in flight, and the step after one left out
    assert max_steps_lost(1) == 3
    assert max_steps_lost(4) == 15 and max_steps_lost(1, slots=2) == 2
