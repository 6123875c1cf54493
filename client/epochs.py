"""How an epoch of a job's live group is decided, from the rendezvous store's keys (:mod:`.group` states the
protocol): waiting for the decision, and an elastic group's survivors making it (:func:`settle`).

The decision (``e<E>/decided``) is ``full`` (every rank of the world arrived), ``abandoned`` (a rank arrived a
second time), or, in an elastic group, ``members:<ranks>``: the ranks that had arrived when a survivor decided.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Collection

import torch.distributed as dist

from .errors import RecoveryFailed

__all__ = ["QUIET_S", "arrived", "decide", "settle", "wait_decision"]

QUIET_S = 0.1
"""An elastic group's survivors decide an epoch once no rank arrived in it for this long (and every rank they
expect has), or after ``settle`` seconds."""

SETTLE_POLL_S = 0.02
"""How often a settling survivor looks at the epoch's arrivals."""


def decide(store: dist.Store, epoch: int, outcome: str) -> str:
    """Decide ``epoch`` ``outcome``, unless it is decided already; the decision that holds."""
    return store.compare_set(f"e{epoch}/decided", "", outcome).decode()


def arrived(store: dist.Store, epoch: int, world_size: int) -> list[int]:
    """The ranks counted into ``epoch`` so far."""
    return [r for r in range(world_size) if int(store.add(f"e{epoch}/rank{r}", 0)) > 0]


def settle(store: dist.Store, epoch: int, world_size: int, until: float, expect: Collection[int]) -> None:
    """A survivor of an elastic group in ``epoch``: unless the epoch is decided first, decide it with the ranks
    arrived, once every rank of ``expect`` has and none has arrived for :data:`QUIET_S` (the survivors of one loss
    arrive within milliseconds of each other), or at ``until`` (monotonic) at the latest."""
    key, count, since = f"e{epoch}/decided", -1, time.monotonic()
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=SETTLE_POLL_S))
            return
        except dist.DistError:
            pass
        now = time.monotonic()
        total = int(store.add(f"e{epoch}/arrived", 0))
        if total != count:
            count, since = total, now
        if now >= until:
            break
        if now - since >= QUIET_S and set(expect) <= set(arrived(store, epoch, world_size)):
            break
    decide(store, epoch, "members:" + ",".join(map(str, arrived(store, epoch, world_size))))


def wait_decision(
    store: dist.Store, epoch: int, world_size: int, deadline: float, who: str
) -> tuple[int, ...]:
    """Wait for ``epoch``'s decision until ``deadline`` (monotonic); the ranks it names members, in order (none
    when abandoned).

    Raises:
        RecoveryFailed: no decision by ``deadline`` (``who`` names the waiting rank).
    """
    key = f"e{epoch}/decided"
    try:
        store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except dist.DistError:
        raise RecoveryFailed(
            f"{who}: only {int(store.add(f'e{epoch}/arrived', 0))} of {world_size} ranks joined epoch {epoch} "
            "in time (is the replacement node started?)"
        ) from None
    outcome = store.get(key).decode()
    if outcome == "full":
        return tuple(range(world_size))
    if outcome.startswith("members:"):
        return tuple(int(r) for r in outcome.removeprefix("members:").split(","))
    return ()
