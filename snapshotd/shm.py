"""Shared-memory arenas: the slots in which a training rank stages its state for the node's sidecar.

An arena is one file under ``/dev/shm`` (owner-only, mode 0600) holding ``slots`` slots of ``slot_bytes`` each.
The sidecar creates, owns and unlinks it; a training process maps it with :func:`attach_arena`. We use a plain
file and ``mmap`` rather than ``multiprocessing.shared_memory`` because on Python 3.11 the latter registers every
segment with a resource tracker that unlinks it when an *attaching* process exits, which would destroy the local
copy exactly when the training process crashes.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import mmap
import os
import re
import uuid

__all__ = [
    "SHM_DIR",
    "Arena",
    "attach_arena",
    "create_arena",
    "default_ipc_path",
    "pid_alive",
    "process_started",
    "sweep_stale_arenas",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def default_ipc_path() -> str:
    """The per-user ipc socket path that both ``snapshotd serve`` and the client find without flags."""
    return os.path.join(
        SHM_DIR if os.access(SHM_DIR, os.W_OK) else "/tmp", f"snapshotd-{getpass.getuser()}.ipc"
    )


class Arena:
    """A mapped arena. ``slot(i)`` is a writable memoryview of slot ``i``.

    The owner (the sidecar) calls :meth:`close` with ``unlink=True``; attachers close without unlinking.
    """

    def __init__(self, path: str, slot_bytes: int, slots: int, mm: mmap.mmap | None) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._mm = mm
        self._view = memoryview(mm) if mm is not None else memoryview(bytearray(0))

    def slot(self, index: int) -> memoryview:
        """Slot ``index`` as a writable memoryview (empty when the slots are 0 bytes)."""
        if not 0 <= index < self.slots:
            raise IndexError(f"arena {self.path} has {self.slots} slots, no slot {index}")
        start = index * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def close(self, *, unlink: bool = False) -> None:
        """Unmap (and, for the owner, remove the file). Views still exported keep the mapping alive until GC."""
        self._view.release()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # zmq may still hold a zero-copy frame of it; the GC unmaps it later
                log.debug("arena %s still has exported views; unmapping later", self.path)
            self._mm = None
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


_OWNED = re.compile(r"^snapshotd-.*-r\d+-(?P<node>[A-Za-z0-9_.-]*)\.(?P<pid>\d+)-[0-9a-f]{8}$")


def create_arena(job: str, rank: int, slot_bytes: int, slots: int, *, node: str = "") -> Arena:
    """Create a new owner-only arena file and map it.

    The name carries the job, rank, the creating sidecar's node name and pid, and a random suffix, so arenas of
    several sidecars on one host (tests, the demo) never collide, and a restarted sidecar can remove what a
    killed predecessor left behind (:func:`sweep_stale_arenas`).
    """
    owner = f"{_NAME_SAFE.sub('_', node)[:32]}.{os.getpid()}"
    name = f"snapshotd-{_NAME_SAFE.sub('_', job)[:64]}-r{rank}-{owner}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(SHM_DIR, name)
    size = slot_bytes * slots
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size) if size > 0 else None
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return Arena(path, slot_bytes, slots, mm)


def attach_arena(path: str, slot_bytes: int, slots: int) -> Arena:
    """Map an existing arena created by the sidecar.

    Raises:
        FileNotFoundError: the sidecar removed it (it restarted, or the rank re-registered).
        ValueError: the file is smaller than ``slot_bytes * slots``.
    """
    size = slot_bytes * slots
    fd = os.open(path, os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"arena {path} is {actual} bytes, expected {size}")
        mm = mmap.mmap(fd, size) if size > 0 else None
    finally:
        os.close(fd)
    return Arena(path, slot_bytes, slots, mm)


def sweep_stale_arenas(node: str) -> list[str]:
    """Remove arenas of sidecars of ``node`` whose process is gone (killed before it could clean up).

    Their contents are unusable: the snapshot metadata died with the process. Returns the removed paths.
    """
    mine = _NAME_SAFE.sub("_", node)[:32]
    removed = []
    for name in os.listdir(SHM_DIR):
        m = _OWNED.match(name)
        if m is None or m.group("node") != mine or pid_alive(int(m.group("pid"))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    if removed:
        log.info("removed %d arenas left by a dead sidecar of node %s", len(removed), node)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a local process still exists (zombies count as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return True


def process_started(pid: int) -> int | None:
    """When local process ``pid`` started (clock ticks after boot, ``/proc/PID/stat``'s 22nd field), or None when
    it is gone or cannot be read. With the pid, it names one process even after the pid is reused."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().split(b") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
