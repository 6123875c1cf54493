"""How the daemons log: text lines (the default) or one JSON object per line (``--log-format json``).

A JSON line always has the keys ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``node``, ``job``, ``rank``,
``step``, ``event`` and ``message``, and ``exc`` when an exception is attached; a key without a value is null.
``node`` is the daemon's own (set once, :func:`setup_logging`); ``job``, ``rank``, ``step`` and ``event`` come
from the record, where the code passes them with :func:`fields`::

    log.info("rank %d of job %s restores step %d", rank, job, step, extra=fields(job, rank, step, "restore"))

``event`` is a short, stable name for what happened (``rank_registered``, ``restore``, ``node_dead``...), for
machines to filter on; the message is for people.

A peer can make a daemon log: every refused message is a warning. So the daemons' handler passes at most
``burst`` records of one call site (logger and message template) per ``window`` seconds (:class:`RateLimit`);
the first one after a quiet spell says how many were held back.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LOG_FORMATS", "JsonFormatter", "RateLimit", "fields", "setup_logging"]

LOG_FORMATS = ("text", "json")

_TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def fields(
    job: str | None = None, rank: int | None = None, step: int | None = None, event: str | None = None
) -> dict[str, Any]:
    """The ``extra`` of a log call that names what it is about (any may be None)."""
    return {"job": job, "rank": rank, "step": step, "event": event}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def __init__(self, node: str | None) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "node": self.node,
            "job": getattr(record, "job", None),
            "rank": getattr(record, "rank", None),
            "step": getattr(record, "step", None),
            "event": getattr(record, "event", None),
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RateLimit(logging.Filter):
    """Passes at most ``burst`` records of each call site (logger, message template) per ``window`` seconds; the
    first record passed after some were held back says how many (see the module docstring).

    Args:
        burst: records of one call site a window lets through.
        window: seconds.
        clock: the time (``time.monotonic``), for tests.
    """

    def __init__(
        self, burst: int = 20, window: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.clock = clock
        self._sites: dict[tuple[str, object], list[float | int]] = {}  # site -> [window start, passed, held]

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        site = self._sites.get((record.name, record.msg))
        if site is None or now - site[0] >= self.window:
            held = int(site[2]) if site is not None else 0
            if len(self._sites) > 10_000:  # bounded however many call sites a run shows
                self._sites.clear()
            self._sites[(record.name, record.msg)] = [now, 1, 0]
            if held:
                record.msg = f"{record.msg} ({held} more like this held back in the last {self.window:.0f} s)"
            return True
        if site[1] < self.burst:
            site[1] += 1
            return True
        site[2] += 1
        return False


def setup_logging(verbose: int = 0, log_format: str = "text", node: str | None = None) -> None:
    """Log to stderr at WARNING (``verbose`` 1: INFO, 2: DEBUG); snapshotd's own loggers at INFO at least, so
    that the daemons' lifecycle lines show by default.

    Raises:
        ValueError: ``log_format`` is not one of :data:`LOG_FORMATS`.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(node) if log_format == "json" else logging.Formatter(_TEXT))
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    if verbose == 0:
        logging.getLogger("snapshotd").setLevel(logging.INFO)
