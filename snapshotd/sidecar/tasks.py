"""The sidecar's task tree: every task it runs is a child of one ``asyncio.TaskGroup``.

Long-running services (the socket loops, their outboxes, the heartbeat) and per-request work (a stream, a restore,
a served pull, a re-replication, a peer link's reader) all run here, so that stopping the sidecar stops every one
of them. A task started with :meth:`TaskTree.spawn` is an error boundary: its failure is logged with its name and
counted, and never ends the sidecar. A service started with :meth:`TaskTree.service` is not: the sidecar cannot
work without it, so its end, by a failure or otherwise, ends the sidecar (:class:`ServiceDied`), which stops
heartbeating, and the coordinator declares its node dead rather than keep placing snapshots on a node that is deaf.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from .node import Counters

__all__ = ["ServiceDied", "TaskTree"]

log = logging.getLogger(__name__)


class ServiceDied(RuntimeError):
    """A service of the sidecar ended or failed: the sidecar stops (``snapshotd serve`` exits non-zero)."""

    @staticmethod
    def first_in(group: BaseExceptionGroup) -> ServiceDied | None:
        """The first ServiceDied in ``group`` (at any depth of nested groups), if any."""
        for exc in group.exceptions:
            if isinstance(exc, ServiceDied):
                return exc
            if isinstance(exc, BaseExceptionGroup) and (found := ServiceDied.first_in(exc)) is not None:
                return found
        return None


class TaskTree:
    """Spawns tasks into the sidecar's TaskGroup once :meth:`attach` gave it one."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, group: asyncio.TaskGroup) -> None:
        self._group = group

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """Run ``coro`` in the tree; an exception it raises is logged as ``what`` failed and counted."""
        if self._group is None:
            coro.close()
            raise RuntimeError(f"{what}: the sidecar is not running")
        task = self._group.create_task(self._guarded(coro, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # cancelled before it started: never awaited, and quiet
        task.add_done_callback(lambda _: coro.close())
        return task

    def service(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """Run ``coro``, a service that must run until the sidecar stops, in the tree: if it ends or fails, the
        failure is logged as critical and the tree's group ends with :class:`ServiceDied` (see the module
        docstring)."""
        return self.spawn(self._vital(coro, what), what)

    @staticmethod
    async def _vital(coro: Coroutine[Any, Any, None], what: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.critical("%s failed: the sidecar stops", what, exc_info=True)
            raise ServiceDied(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        log.critical("%s ended: the sidecar stops", what)
        raise ServiceDied(f"{what} ended")

    async def _guarded(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        try:
            await coro
        except (asyncio.CancelledError, ServiceDied):
            raise
        except Exception:
            self._counters.errors += 1
            log.exception("%s failed", what)

    def cancel_all(self) -> None:
        """Cancel every task spawned so far (the sidecar is stopping)."""
        for task in list(self._tasks):
            task.cancel()
