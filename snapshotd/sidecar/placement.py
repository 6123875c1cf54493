"""Landing a restored snapshot: into the rank's arena slot, or straight into the restoring process's tensors.

A rank restoring on a new node would otherwise receive its state twice: the sidecar writes it into a fresh
shared-memory slot, then the training process copies it into its tensors. A fresh slot is also the dearest
memory there is: every page is allocated and mapped on first touch, which costs far more than copying into
memory already in use (docs/benchmarks.md, "Recovery"). So when the rank says where its live tensors lie
(:class:`~snapshotd.proto.RestoreRequest` ``targets``), :class:`DirectSink` writes the bytes of every entry that
:func:`~snapshotd.proto.match_entries` pairs with a target into the process itself with ``process_vm_writev(2)``
(one copy, from the received frame into the tensor) and only the rest into the slot. The kernel allows that for a
process of the same user unless Yama's ``ptrace_scope`` or a seccomp profile forbids it; :meth:`DirectSink.probe`
finds out first, and the caller falls back to the slot alone. The sidecar writes only into the process that
registered the rank, at addresses that process gave, over the owner-only ipc endpoint: a process of the same user,
which could write there itself.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Sequence

import numpy as np

from snapshotd.proto import ProtocolError, TensorEntry, landing_segments

__all__ = ["DirectSink", "Lander", "PlacementError", "arena_sink"]

log = logging.getLogger(__name__)

_IOV_MAX = 1024


class PlacementError(RuntimeError):
    """Writing into the restoring process failed (it exited, or the kernel refused)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    for fn in ("process_vm_writev", "process_vm_readv"):
        f = getattr(libc, fn, None)
        if f is None:
            return None
        f.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        f.restype = ctypes.c_ssize_t
    return libc


_LIBC = _libc()


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


Lander = Callable[[int, memoryview], None]
"""``land(start, chunk)``: put bytes ``[start, start + len(chunk))`` of a snapshot where they belong. The caller never
writes ``chunk`` again, so a lander may keep it rather than copy it."""


def arena_sink(slot: memoryview) -> Lander:
    """A lander that copies every chunk into ``slot`` at its offset."""

    def land(start: int, chunk: memoryview) -> None:
        slot[start : start + chunk.nbytes] = chunk

    return land


class DirectSink:
    """Lands chunks of a snapshot into process ``pid``'s tensors where it can, into ``slot`` elsewhere.

    Args:
        pid: the restoring process.
        snapshot: the snapshot's tensor table.
        live: the table of the process's live state, from its request.
        targets: that request's ``targets`` frame (one little-endian uint64 address per ``live`` entry).
        slot: the arena slot, for the bytes of entries without a target (and never for those with one).

    Raises:
        ProtocolError: ``targets`` does not hold one address per live entry.
    """

    def __init__(
        self,
        pid: int,
        snapshot: Sequence[TensorEntry],
        live: Sequence[TensorEntry],
        targets: memoryview | bytes,
        slot: memoryview,
    ) -> None:
        if memoryview(targets).nbytes != 8 * len(live):
            raise ProtocolError(
                f"restore targets hold {memoryview(targets).nbytes} bytes for {len(live)} tensors"
            )
        segments = landing_segments(snapshot, live, np.frombuffer(targets, dtype="<u8").tolist())
        self.pid = pid
        self.slot = slot
        self._starts = [s for s, _, _ in segments]
        self._segments = segments
        self.direct_bytes = sum(end - start for start, end, addr in segments if addr)

    def probe(self) -> bool:
        """Whether the kernel lets this process write into the target process (reads one target byte)."""
        first = next((addr for _, _, addr in self._segments if addr), 0)
        if _LIBC is None or not first:
            return False
        buf = ctypes.create_string_buffer(1)
        local, remote = _Iovec(ctypes.addressof(buf), 1), _Iovec(first, 1)
        if _LIBC.process_vm_readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 1:
            return True
        log.info(
            "cannot write into process %d (errno %d): restoring through the arena only",
            self.pid,
            ctypes.get_errno(),
        )
        return False

    def land(self, start: int, chunk: memoryview) -> None:
        """Write bytes ``[start, start + chunk.nbytes)`` of the snapshot where they belong.

        Raises:
            PlacementError: the kernel refused or wrote short (the process exited or unmapped a tensor).
        """
        end = start + chunk.nbytes
        base = _address(chunk)
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int]] = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._segments) and self._segments[i][0] < end:
            seg_lo, seg_hi, addr = self._segments[i]
            i += 1
            lo, hi = max(seg_lo, start), min(seg_hi, end)
            if lo >= hi:
                continue
            if addr:
                local.append((base + lo - start, hi - lo))
                remote.append((addr + lo - seg_lo, hi - lo))
            else:
                self.slot[lo:hi] = chunk[lo - start : hi - start]
        for k in range(0, len(local), _IOV_MAX):
            self._writev(local[k : k + _IOV_MAX], remote[k : k + _IOV_MAX])

    def _writev(self, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
        assert _LIBC is not None
        n = len(local)
        liov = (_Iovec * n)(*(_Iovec(a, k) for a, k in local))
        riov = (_Iovec * n)(*(_Iovec(a, k) for a, k in remote))
        want = sum(length for _, length in local)
        done = _LIBC.process_vm_writev(self.pid, liov, n, riov, n, 0)
        if done != want:
            err = ctypes.get_errno() if done < 0 else 0
            raise PlacementError(
                f"writing {want} bytes into process {self.pid} failed: wrote {done} (errno {err})"
            )
