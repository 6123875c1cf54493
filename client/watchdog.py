"""The watchdog of a live group: it leaves the group when a step hangs on a member the job is replacing.

A hung member (stopped, deadlocked, cut off) closes no connection, so the collectives waiting on it would wait
for the group's ``timeout``. Meanwhile its replacement arrives in the job's current epoch, which opens the next
one (see :mod:`snapshotd.client.group`). The :class:`Watchdog` sees that newer epoch in the rendezvous store
while a guarded step hangs, and leaves the group (:meth:`LiveGroup.leave_hung
<snapshotd.client.group.LiveGroup.leave_hung>`): the collective fails at once and ``guard()`` raises
``PeerLost``. It costs one store read every :data:`HANG_CHECK_S` during steps longer than that, and none
otherwise.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from .group import LiveGroup

__all__ = ["HANG_CHECK_S", "Watchdog"]

log = logging.getLogger(__name__)

HANG_CHECK_S = 1.0
"""How long a guarded step runs before the watchdog starts looking for a newer epoch, and how often it looks
then (see :meth:`LiveGroup.watch <snapshotd.client.group.LiveGroup.watch>`)."""


class Watchdog:
    """A daemon thread watching ``group`` (from :meth:`start` until :meth:`stop`): while a step has run for more
    than :data:`HANG_CHECK_S`, it reads the job's newest epoch from the store every :data:`HANG_CHECK_S`, on a
    connection of its own (opened then, and again after it failed), and hands a newer epoch than the step's to
    :meth:`LiveGroup.leave_hung <snapshotd.client.group.LiveGroup.leave_hung>`. A store it cannot read
    leaves the group alone: the group's ``timeout`` still ends a hung collective."""

    def __init__(self, group: LiveGroup) -> None:
        self.group = group
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"snapshotd-live-watchdog-{group.rank}"
        )

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread, waiting up to ``timeout`` seconds for it (a thread still blocked reading the store
        then ends, a daemon, within the store's timeout)."""
        self._stop.set()
        self.thread.join(timeout)

    def _connect(self) -> dist.Store:
        host, port = self.group.address
        return dist.PrefixStore(
            f"snapshotd/{self.group.job}",
            dist.TCPStore(
                host,
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=max(HANG_CHECK_S, 5.0)),
            ),
        )

    def _run(self) -> None:
        store: dist.Store | None = None
        while not self._stop.wait(HANG_CHECK_S):
            since, epoch = self.group.running_step()
            if since is None or epoch < 0 or time.monotonic() - since < HANG_CHECK_S:
                continue
            try:
                if store is None:
                    store = self._connect()
                newest = int(store.get("epoch"))
            except Exception as exc:  # the store is away: the group's timeout still ends a hung collective
                log.debug(
                    "[job %s rank %d] watchdog: cannot read the store: %s",
                    self.group.job,
                    self.group.rank,
                    exc,
                )
                store = None
                continue
            if not self._stop.is_set():
                self.group.leave_hung(since, epoch, newest)
