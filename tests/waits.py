"""The one wait the tests share: poll a condition until it holds, within a deadline, naming what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["wait_until"]


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 10.0, every: float = 0.01) -> Any:
    """Call ``cond`` every ``every`` seconds until it returns something true, and return that.

    Raises:
        TimeoutError: it did not within ``timeout`` seconds; the message names ``what``.
    """
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(every)
    return value
