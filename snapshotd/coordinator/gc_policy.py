"""The coordinator's garbage-collection policy: keep CPython's cyclic collector off its long-lived index.

The collector examines every tracked container it holds at each full collection. With thousands of sidecars the
coordinator's index (nodes, inventories, holders) is hundreds of thousands of containers, and a full collection a
pause that shows in heartbeat round trips; CPython runs one whenever the objects that survived since the last
reach a quarter of the heap, which is every few seconds while inventories change with every training step. Each
one stalls heartbeats and plan answers alike, for nothing: the index holds no reference cycles (records hold
dicts, sets and tuples of names, never their owners).

So every object that survived one tick of the loop is frozen (``gc.freeze``, O(1)) and the collector only looks
at newer ones. Reference counting still frees everything that is not in a cycle, frozen or not; cycles that were
frozen before they became garbage are freed by one full collection every ``full_every`` seconds (unfreeze,
collect), put off while the server says it is busy (plan requests held: a round in progress).
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["GcPolicy"]

log = logging.getLogger(__name__)


class GcPolicy:
    """Freeze survivors at every :meth:`tick`; collect everything every ``full_every`` seconds.

    The collector's state is the process's: :meth:`close` unfreezes, so that a coordinator run in a thread of a
    larger process (tests, ``snapshotd-bench scale --profile``) leaves it as it found it.
    """

    def __init__(self, now: float, full_every: float = 600.0) -> None:
        self.full_every = full_every
        self._next_full = now + full_every

    def tick(self, now: float, *, busy: bool) -> None:
        """Called by the loop when it has caught up (nothing queued); ``busy`` puts the full collection off."""
        if now >= self._next_full and not busy:
            self._next_full = now + self.full_every
            gc.unfreeze()
            t0 = time.perf_counter()
            found = gc.collect()
            log.debug(
                "full garbage collection: %d objects freed in %.0f ms",
                found,
                (time.perf_counter() - t0) * 1e3,
            )
        gc.freeze()

    def close(self) -> None:
        gc.unfreeze()
