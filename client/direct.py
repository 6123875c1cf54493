"""What a restoring process tells its sidecar so that a pulled snapshot lands straight in its live tensors.

See :mod:`snapshotd.sidecar.placement` for the sidecar's side. :func:`direct_targets` lists, per tensor of the
flattened live state, where its bytes lie in this process; :func:`writable_by` lets the sidecar write there for the
length of a restore where the kernel's Yama module (``kernel.yama.ptrace_scope = 1``, Ubuntu's default) would
otherwise allow it only to this process's ancestors.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Iterator

import numpy as np

from .state import FlatState

__all__ = ["direct_targets", "writable_by"]

log = logging.getLogger(__name__)

_PR_SET_PTRACER = 0x59616D61
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def direct_targets(flat: FlatState) -> bytes:
    """``RestoreRequest.targets`` for ``flat``: per entry, the address of its live tensor's bytes where the sidecar
    may write them directly (a contiguous CPU tensor), else 0; empty when no entry qualifies."""
    addresses = [
        t.data_ptr() if t.device.type == "cpu" and t.is_contiguous() and t.numel() else 0
        for t in flat.tensors
    ]
    return np.asarray(addresses, dtype="<u8").tobytes() if any(addresses) else b""


def _yama_scope() -> int:
    try:
        with open(_YAMA_SCOPE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0  # no Yama: same-user processes may write each other's memory


@contextlib.contextmanager
def writable_by(pid: int) -> Iterator[None]:
    """Within the block, let process ``pid`` (the sidecar) write this process's memory under Yama scope 1.

    A no-op without Yama, at other scopes (0 needs nothing; 2 and 3 forbid it, and the sidecar falls back to
    the arena), or without a pid. The permission is withdrawn when the block ends.
    """
    libc = (
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if pid > 0 and _yama_scope() == 1 else None
    )
    if libc is None or libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0) != 0:
        yield
        return
    try:
        yield
    finally:
        if libc.prctl(_PR_SET_PTRACER, 0, 0, 0, 0) != 0:
            log.warning("could not withdraw the sidecar's (pid %d) permission to write this process", pid)
