"""The coordinator's GC policy: survivors frozen at every tick, one full collection per period unless busy."""

from __future__ import annotations

import gc
import weakref

from snapshotd.coordinator.gc_policy import GcPolicy


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_survivors_are_frozen_and_frozen_cycles_are_freed_by_the_periodic_full_collection() -> None:
    policy = GcPolicy(now=0.0, full_every=10.0)
    try:
        cycle = _Cycle()
        ref = weakref.ref(cycle)
        policy.tick(1.0, busy=False)
        assert gc.get_freeze_count() > 0
        del cycle  # garbage now, but frozen: no collection looks at it
        gc.collect()
        assert ref() is not None
        policy.tick(11.0, busy=True)  # the full collection is due, but plan requests are held: put off
        assert ref() is not None
        policy.tick(11.5, busy=False)  # unfreeze, collect, freeze again
        assert ref() is None and gc.get_freeze_count() > 0
    finally:
        policy.close()
    assert gc.get_freeze_count() == 0
