"""What ``restore()`` shows while it waits: the restore's progress, drawn with ``rich`` on the training process's
stderr.

Drawn only where a person looks: when stderr is a terminal, and by the node's first local rank (``LOCAL_RANK`` 0
or unset), so that the ranks of a node do not draw over each other. Anywhere else :func:`restore_display` gives
None, the rank does not ask the sidecar for progress, and nothing is drawn. The sidecar's
:class:`~snapshotd.proto.RestoreProgress` messages arrive on the channel thread (:meth:`RestoreDisplay.update`
only keeps the newest); the display is drawn by the thread that called ``restore()`` (:meth:`RestoreDisplay.draw`,
called while it waits for the reply), so no thread is added and the training thread is never drawn over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TextIO

from snapshotd.proto import RestoreProgress, RestoreReply
from snapshotd.units import format_bytes

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["RestoreDisplay", "restore_display"]

log = logging.getLogger(__name__)


def restore_display(
    job: str, rank: int, *, stream: TextIO | None = None, env: Mapping[str, str] | None = None
) -> RestoreDisplay | None:
    """A display of rank ``rank``'s restore on ``stream`` (``sys.stderr``), or None where nothing is to be drawn:
    ``stream`` is not a terminal, or ``LOCAL_RANK`` (in ``env``, ``os.environ`` by default) is set to another
    rank than 0."""
    stream = sys.stderr if stream is None else stream
    env = os.environ if env is None else env
    if env.get("LOCAL_RANK", "0").strip() not in ("", "0"):
        return None
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError, OSError):  # closed, or no isatty
        return None
    # rich is imported only here: a rank that draws nothing never loads it
    return RestoreDisplay(job, rank, stream)


class RestoreDisplay:
    """One restore's progress: a line naming the source once it is known (``restore JOB rank R step S: pull from
    ADDR, ... (SIZE)``), and under it a bar (``restore rank R step S  [bar]  %  done/total  rate  elapsed``).

    Starts drawn, waiting for the plan; :meth:`update` (any thread) hands it the sidecar's latest word;
    :meth:`draw` and :meth:`finish` (the restoring thread) draw. Drawing never raises: a display that fails is
    logged and drawn no more.
    """

    def __init__(self, job: str, rank: int, stream: TextIO) -> None:
        self._job, self._rank = job, rank
        self._latest: RestoreProgress | None = None
        self._shown: RestoreProgress | None = None
        from snapshotd.terminal import progress

        self._bar: Progress | None = progress(unit="bytes", stream=stream, auto_refresh=False)
        self._task = self._bar.add_task(f"restore rank {rank}: waiting for the recovery plan", total=None)
        self._guard(self._bar.start)

    def update(self, msg: RestoreProgress) -> None:
        """Keep ``msg`` for the next :meth:`draw` (called on the channel thread: only a reference is stored)."""
        self._latest = msg

    def advance(self, done_bytes: int) -> None:
        """``done_bytes`` of the restore the sidecar last told of are in (a rank fetching its pull itself counts
        them; any thread)."""
        msg = self._latest
        if msg is not None:
            self._latest = dataclasses.replace(msg, done_bytes=min(done_bytes, msg.total_bytes))

    def draw(self) -> None:
        """Redraw with the newest progress the sidecar sent."""
        self._catch_up()
        if self._bar is not None:
            self._guard(self._bar.refresh)

    def finish(self, reply: RestoreReply | None) -> None:
        """Draw the outcome (``reply``, or a failure when None) and end the display, leaving its last lines."""
        self._catch_up()
        bar = self._bar
        if bar is None:
            return
        if reply is None:
            self._guard(bar.update, self._task, description=f"restore rank {self._rank}: failed")
        elif reply.source == "fresh":  # a line of text instead of a bar: nothing moved
            self._guard(bar.remove_task, self._task)
            self._say(
                f"restore {self._job} rank {self._rank}: a fresh job, nothing to restore; starting at step 0"
            )
        else:
            msg = self._shown
            total = msg.total_bytes if msg is not None and msg.step == reply.step else None
            if msg is None or (msg.step, msg.source) != (reply.step, reply.source):
                self._say(self._headline(reply.step, reply.source, (), total))
            self._guard(
                bar.update,
                self._task,
                description=f"restore rank {self._rank} step {reply.step}",
                total=total,
                completed=total or 0,
            )
        if self._bar is not None:
            self._guard(bar.stop)
        self._bar = None

    # the restoring thread only

    def _catch_up(self) -> None:
        msg = self._latest
        if msg is not None and msg is not self._shown and self._bar is not None:
            self._guard(self._show, msg)

    def _show(self, msg: RestoreProgress) -> None:
        assert self._bar is not None
        if self._shown is None or (msg.step, msg.source) != (self._shown.step, self._shown.source):
            self._say(self._headline(msg.step, msg.source, msg.sources, msg.total_bytes))
            # the bytes start moving now: rate and elapsed time count from here, not from the wait for the plan
            self._bar.reset(
                self._task, total=msg.total_bytes, description=f"restore rank {self._rank} step {msg.step}"
            )
        self._bar.update(self._task, total=msg.total_bytes, completed=msg.done_bytes)
        self._shown = msg

    def _headline(self, step: int, source: str, sources: tuple[str, ...], total: int | None) -> str:
        where = {
            "local": "from local shared memory",
            "replica": "from the replica held on this node",
            "pull": "pull from " + (", ".join(sources) or "the other nodes"),
        }.get(source, source)
        size = f" ({format_bytes(total)})" if total is not None else ""
        return f"restore {self._job} rank {self._rank} step {step}: {where}{size}"

    def _say(self, line: str) -> None:
        from rich.text import Text

        if self._bar is not None:
            self._guard(self._bar.console.print, Text(line), soft_wrap=True)

    def _guard(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        """Run a drawing call; a failure stops the display (logged), never the restore."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # a terminal that went away, a closed stream
            if self._bar is not None:
                log.warning("restore progress display stopped: %s", exc)
                bar, self._bar = self._bar, None
                with contextlib.suppress(Exception):
                    bar.stop()
