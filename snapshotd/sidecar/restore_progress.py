"""How a restore goes, told to the rank that asked (:class:`~snapshotd.proto.RestoreProgress`).

A rank that asks with ``progress`` is told once the source of its step is known, then, while a pull brings the
bytes, at most every :data:`PROGRESS_INTERVAL` seconds. A rank that did not ask is told nothing.
"""

from __future__ import annotations

import time

from snapshotd.proto import RestoreProgress, RestoreRequest

from .outbox import Outbox

__all__ = ["PROGRESS_INTERVAL", "ProgressReports", "PullProgress"]

PROGRESS_INTERVAL = 0.2
"""Least seconds between two RestoreProgress messages of one pull."""


class ProgressReports:
    """The RestoreProgress messages of one restore: to the rank that sent ``req`` (``ident`` on the ipc endpoint,
    through ``outbox``), if ``req`` asked for them; :meth:`tell` does nothing otherwise."""

    def __init__(self, outbox: Outbox, ident: bytes, req: RestoreRequest) -> None:
        self.outbox = outbox
        self.ident = ident
        self.req = req

    def tell(self, step: int, source: str, done: int, total: int, sources: tuple[str, ...] = ()) -> None:
        """``done`` of ``total`` bytes of ``step`` came from ``source`` (from the holders ``sources``, for a pull)."""
        if self.req.progress:
            self.outbox.reply(
                self.ident,
                RestoreProgress(
                    job=self.req.job,
                    rank=self.req.rank,
                    step=step,
                    done_bytes=min(done, total),
                    total_bytes=total,
                    source=source,
                    sources=sources,
                ),
            )

    def pull(self, step: int, holders: tuple[str, ...]) -> PullProgress:
        """The progress of a pull of ``step`` from ``holders``, told through these reports."""
        return PullProgress(self, step, holders)


class PullProgress:
    """One pull's progress: told when the pull learns its size (:meth:`begin`), then as bytes land
    (:meth:`landed`), at most every :data:`PROGRESS_INTERVAL` seconds."""

    def __init__(self, reports: ProgressReports, step: int, holders: tuple[str, ...]) -> None:
        self.reports = reports
        self.step = step
        self.holders = holders
        self.done = 0
        self.total = 0
        self._told = 0.0

    def begin(self, total: int) -> None:
        """The pull brings ``total`` bytes; none landed yet."""
        self.total, self._told = total, time.monotonic()
        self.reports.tell(self.step, "pull", 0, total, self.holders)

    def landed(self, n: int) -> None:
        """``n`` more bytes landed."""
        self.done += n
        now = time.monotonic()
        if now - self._told >= PROGRESS_INTERVAL:
            self._told = now
            self.reports.tell(self.step, "pull", self.done, self.total, self.holders)
