"""A small terminal progress bar, for the sidecar's restore pulls and the benchmarks' long runs."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from snapshotd.units import format_bytes, format_rate, format_seconds

__all__ = ["Progress"]


class Progress:
    """A small progress bar: count, rate and ETA, for items or bytes.

    On a TTY it redraws one line (at most every ``interval`` seconds); on anything else it writes one line
    each time another ~10% is done (nothing when ``total`` is unknown). Use as a context manager, or call
    :meth:`close`. Not thread-safe: update it from one thread (or one event loop).

    Args:
        total: expected count (items, or bytes when ``unit="bytes"``); None when unknown.
        desc: label in front of the bar.
        unit: ``"bytes"`` formats counts as sizes and rates as GB/s; anything else is a plain item name.
        stream: where to write; ``sys.stderr`` when None.
        interval: least seconds between TTY redraws.
    """

    def __init__(
        self,
        total: float | None,
        *,
        desc: str = "",
        unit: str = "items",
        stream: TextIO | None = None,
        interval: float = 0.1,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.count = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._interval = interval
        self._start = time.monotonic()
        self._last_draw = -math.inf
        self._tenths = 0
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        """Add ``n`` to the count and redraw if due."""
        self.count += n
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= self._interval:
                self._last_draw = now
                self._stream.write("\r" + self.line() + "\x1b[K")
                self._stream.flush()
        elif self.total:
            tenths = min(10, int(10 * self.count / self.total))
            if tenths > self._tenths:
                self._tenths = tenths
                self._stream.write(self.line() + "\n")
                self._stream.flush()

    def close(self) -> None:
        """Draw the final state (on a TTY) and end the line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self._stream.write("\r" + self.line() + "\x1b[K\n")
            self._stream.flush()

    def _amount(self, n: float) -> str:
        return format_bytes(n) if self.unit == "bytes" else f"{n:.0f} {self.unit}"

    def line(self) -> str:
        """The current state as one line: ``desc [####....] 40% 4.00 MiB/10.00 MiB 1.2 GB/s ETA 3.1 s``."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.count / elapsed
        speed = format_rate(rate) if self.unit == "bytes" else f"{rate:.1f} {self.unit}/s"
        parts = [self.desc] if self.desc else []
        if not self.total:
            return " ".join([*parts, self._amount(self.count), speed])
        frac = min(1.0, self.count / self.total)
        filled = int(20 * frac)
        eta = max(0.0, self.total - self.count) / rate if rate > 0 else math.inf
        parts += [
            f"[{'#' * filled}{'.' * (20 - filled)}] {100 * frac:3.0f}%",
            f"{self._amount(self.count)}/{self._amount(self.total)}",
            speed,
            f"ETA {format_seconds(eta) if math.isfinite(eta) else '?'}",
        ]
        return " ".join(parts)
