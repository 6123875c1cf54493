"""Output for people, through ``rich``: a console per stream, progress bars, and tables as plain text.

On a terminal rich draws in colour and redraws a progress bar in place. On anything else (a pipe, a log file, a
test's ``StringIO``) the console writes plain text of a fixed width, without colour or control codes, so the same
input prints the same text on every machine; a progress bar then prints its final state once, when it stops.
Sizes and rates use :mod:`snapshotd.units`, as every other place a person reads them.
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column
from rich.text import Text

from snapshotd.units import format_bytes, format_rate

__all__ = ["WIDTH", "AmountColumn", "RateColumn", "console", "is_terminal", "progress", "to_text"]

WIDTH = 200
"""Columns of plain (non-terminal) output: wide enough that no table of ours is wrapped."""


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (False for a closed stream or one without ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def console(stream: TextIO | None = None, *, width: int | None = None) -> Console:
    """A console writing to ``stream`` (``sys.stderr`` when None): rich's own on a terminal, plain text of
    ``width`` (:data:`WIDTH` by default) columns without colour or control codes otherwise (whatever
    ``FORCE_COLOR``, ``TTY_COMPATIBLE`` or ``COLUMNS`` say)."""
    stream = sys.stderr if stream is None else stream
    if is_terminal(stream):
        return Console(file=stream, width=width, highlight=False, emoji=False)
    return Console(
        file=stream,
        width=width or WIDTH,
        force_terminal=False,
        force_interactive=False,
        no_color=True,
        color_system=None,
        highlight=False,
        emoji=False,
        soft_wrap=False,
    )


def to_text(*renderables: RenderableType, width: int = WIDTH) -> str:
    """``renderables`` as plain text (one after the other), without trailing spaces or a final newline."""
    buf = io.StringIO()
    out = console(buf, width=width)
    for r in renderables:
        out.print(r)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


class AmountColumn(ProgressColumn):
    """``4.00 MiB/12.00 MiB`` (``unit="bytes"``) or ``3/10 steps``; only the count while the total is unknown."""

    def __init__(self, unit: str = "items") -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self.unit = unit

    def _amount(self, n: float) -> str:
        return format_bytes(n) if self.unit == "bytes" else f"{n:.0f}"

    def render(self, task: Task) -> Text:
        if task.total is None and not task.completed:
            return Text("")
        done = self._amount(task.completed)
        text = done if task.total is None else f"{done}/{self._amount(task.total)}"
        return Text(text if self.unit == "bytes" else f"{text} {self.unit}")


class RateColumn(ProgressColumn):
    """The average rate since the task started (``format_rate`` for bytes, ``N.N unit/s`` otherwise)."""

    def __init__(self, unit: str = "items") -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self.unit = unit

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        if not elapsed or not task.completed:
            return Text("")
        rate = task.completed / elapsed
        return Text(format_rate(rate) if self.unit == "bytes" else f"{rate:.1f} {self.unit}/s")


def progress(
    *,
    unit: str = "items",
    stream: TextIO | None = None,
    extra: tuple[ProgressColumn, ...] = (),
    auto_refresh: bool | None = None,
) -> Progress:
    """A rich progress display on ``stream`` (``sys.stderr``): description, bar, percentage, amount, rate,
    elapsed time, then ``extra`` columns. Use it as a context manager and add tasks to it. On a narrow terminal
    the bar gives way first.

    ``auto_refresh`` (default: on a terminal only) redraws from rich's own thread; without it the display is
    redrawn by ``update(..., refresh=True)`` or ``refresh()`` on the caller's thread, and off a terminal it
    prints its final state once, when it stops.
    """
    out = console(stream)
    columns = (
        TextColumn("{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=30),
        TaskProgressColumn(table_column=Column(no_wrap=True)),
        AmountColumn(unit),
        RateColumn(unit),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
        *extra,
    )
    return Progress(
        *columns,
        console=out,
        auto_refresh=out.is_terminal if auto_refresh is None else auto_refresh,
        redirect_stdout=False,
        redirect_stderr=False,
    )
