"""A restoring rank fetching the step its sidecar pulls from the holders' bulk ports itself.

Asked by its sidecar (:class:`~snapshotd.proto.RestoreFetch`), the rank reads every chunk from the holders'
sockets straight to where it belongs (:mod:`snapshotd.proto.bulk`): into the live tensor that
:func:`~snapshotd.proto.landing_segments` names for its bytes, else into the arena slot the sidecar named. Chunks
go in ranges of :data:`RANGE_BYTES`, taken in turn by one thread per holder; a holder that fails (refuses, goes
silent for ``timeout`` seconds, sends a chunk that fails its check, or finds its own copy corrupt) gives its
unfinished range back to the others. Every chunk's xxh3-64 is checked as it lands, against the checksum its
holder carries. The answer (:class:`~snapshotd.proto.RestoreFetched`) says whether every chunk is in.
:meth:`RestoreFetcher.cancel` stops a fetch at once from any thread (its restore ended or was given up): no byte
lands after it returns and the fetcher's threads are joined.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import logging
import socket
import threading
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from snapshotd.proto import RestoreFetch, RestoreFetched, TensorEntry, decode_table, landing_segments
from snapshotd.proto.bulk import (
    CHUNK,
    HELLO,
    MAGIC,
    RANGE,
    TOKEN_BYTES,
    VERSION,
    Status,
    chunk_length,
    recv_exact,
    recv_into,
)
from snapshotd.shm import Arena, attach_arena

__all__ = ["RANGE_BYTES", "RestoreFetcher"]

log = logging.getLogger(__name__)

RANGE_BYTES = 64 << 20
"""Payload asked of one holder at a time (a whole number of chunks, at least one)."""


class _HolderFailed(Exception):
    """One holder cannot deliver (the message says why); its unfinished chunks go to the others."""


class RestoreFetcher:
    """One fetch, as ``msg`` asks: ``live`` and ``targets`` are the tensor table and the addresses the restore
    request named (``targets`` empty: none). ``on_progress(done_bytes)`` is called from the fetching threads.

    :meth:`run` fetches and returns the answer; it never raises for a holder's, the network's or its own trouble:
    the answer says what went wrong. :meth:`cancel` (any thread) stops it.
    """

    def __init__(
        self,
        msg: RestoreFetch,
        live: Sequence[TensorEntry],
        targets: Sequence[int],
        *,
        timeout: float,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.msg = msg
        self.live = live
        self.targets = targets
        self.timeout = timeout
        self.on_progress = on_progress
        self.cond = threading.Condition()
        self.cancelled = False
        self.sockets: set[socket.socket] = set()
        self.threads: list[threading.Thread] = []
        # what _open works out
        self.holders: list[tuple[str, bytes]] = []
        self.direct = False
        self.slot: memoryview | None = None
        self.pieces: list[tuple[int, memoryview]] = []
        """(start, view) pieces covering the data buffer where the snapshot has bytes, sorted by start."""
        self.starts: list[int] = []
        self.sums = np.zeros(0, dtype="<u8")
        self.pending: collections.deque[range] = collections.deque()
        self.in_flight = 0
        self.done_bytes = 0
        self.errors: list[str] = []
        self.corrupt_from: dict[int, set[str]] = {}

    def cancel(self) -> None:
        """Stop the fetch: cut its connections and wait for its threads (each ends at its next read or write)."""
        with self.cond:
            self.cancelled = True
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self.cond.notify_all()
            threads = list(self.threads)
        for t in threads:
            t.join(self.timeout)
            if t.is_alive():
                log.warning("a restore fetch thread did not stop within %.0f s", self.timeout)

    def run(self) -> RestoreFetched:
        msg = self.msg
        arena: Arena | None = None
        try:
            arena = self._open()
            threads = [
                threading.Thread(target=self._worker, args=holder, name="snapshotd-fetch", daemon=True)
                for holder in self.holders
            ]
            with self.cond:
                if self.cancelled:
                    return self._failed("cancelled")
                self.threads = threads
            try:
                for t in threads:
                    t.start()
            except BaseException:  # those started must stop before the arena goes
                self.cancel()
                raise
            for t in threads:  # each ends once nothing is left, its holder failed, or the fetch was cancelled
                t.join()
            if self.cancelled:
                return self._failed("cancelled")
            if self.pending:
                everywhere = {addr for addr, _ in self.holders}
                bad = sorted(
                    i for todo in self.pending for i in todo if everywhere <= self.corrupt_from.get(i, set())
                )
                why = f"chunk {bad[0]} failed its check from every holder; " if bad else ""
                return self._failed(f"{why}{'; '.join(self.errors)}")
            return RestoreFetched(
                job=msg.job,
                rank=msg.rank,
                step=msg.step,
                fetch=msg.fetch,
                ok=True,
                direct=self.direct,
                fetched=msg.data_bytes,
                sums=self.sums.tobytes(),
            )
        except (OSError, ValueError) as exc:  # the arena is gone or too small, a bad table or token list
            return self._failed(f"cannot take the fetch: {exc}")
        except Exception as exc:  # a bug here must still answer: the sidecar waits for the answer, then pulls
            log.exception("fetching the restore failed")
            return self._failed(f"the fetch failed: {type(exc).__name__}: {exc}")
        finally:
            self.pieces, self.slot = [], None  # the views go before the arena they look into
            if arena is not None:
                arena.close()

    def _failed(self, reason: str) -> RestoreFetched:
        msg = self.msg
        return RestoreFetched(
            job=msg.job, rank=msg.rank, step=msg.step, fetch=msg.fetch, ok=False, reason=reason
        )

    def _open(self) -> Arena | None:
        """Work out where every byte lands (mapping the arena if some go to the slot) and what to ask for."""
        msg, live = self.msg, self.live
        tokens = memoryview(msg.tokens).tobytes()
        if len(tokens) != TOKEN_BYTES * len(msg.holders) or not msg.holders:
            raise ValueError(f"{len(tokens)} bytes of tokens for {len(msg.holders)} holders")
        self.holders = [
            (addr, tokens[i * TOKEN_BYTES : (i + 1) * TOKEN_BYTES]) for i, addr in enumerate(msg.holders)
        ]
        targets = list(self.targets) if len(self.targets) == len(live) else [0] * len(live)
        segments = landing_segments(decode_table(msg.table, msg.data_bytes), live, targets)
        self.direct = any(addr for _, _, addr in segments)
        arena: Arena | None = None
        if any(not addr for _, _, addr in segments) or not self.direct:
            arena = attach_arena(msg.arena, msg.slot_bytes, msg.slots)
            slot = arena.slot(msg.slot)
            if slot.nbytes < msg.data_bytes:
                arena.close()
                raise ValueError(f"slot {msg.slot} holds {slot.nbytes} bytes, the step {msg.data_bytes}")
            self.slot = slot[: msg.data_bytes]
        for start, end, addr in segments:
            if addr:
                view = memoryview((ctypes.c_char * (end - start)).from_address(addr)).cast("B")
            else:
                assert self.slot is not None
                view = self.slot[start:end]
            self.pieces.append((start, view))
        self.starts = [start for start, _ in self.pieces]
        nchunks = -(-msg.data_bytes // msg.chunk_bytes)
        self.sums = np.zeros(nchunks, dtype="<u8")
        per_range = max(1, RANGE_BYTES // msg.chunk_bytes)
        self.pending.extend(range(i, min(i + per_range, nchunks)) for i in range(0, nchunks, per_range))
        return arena

    def _worker(self, addr: str, token: bytes) -> None:
        host, _, port = addr.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout)
        except (OSError, ValueError) as exc:
            with self.cond:
                self.errors.append(f"{addr}: cannot connect: {exc}")
            return
        with self.cond:
            if self.cancelled:
                sock.close()
                return
            self.sockets.add(sock)
        try:
            self._fetch_from(sock, addr, token)
        finally:
            with self.cond:  # out of cancel()'s reach before its descriptor is closed (and reused)
                self.sockets.discard(sock)
            sock.close()

    def _fetch_from(self, sock: socket.socket, addr: str, token: bytes) -> None:
        """Fetch ranges from one holder over ``sock`` until none is left; a failure hands the range back."""
        todo: range | None = None
        left: set[int] = set()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(HELLO.pack(MAGIC, VERSION, token))
            while (todo := self._take()) is not None:
                left = set(todo)
                sock.sendall(RANGE.pack(todo.start, len(todo)))
                for index in todo:
                    self._receive(sock, addr, index)
                    left.discard(index)
                self._finish(())
                todo = None
            sock.sendall(RANGE.pack(0, 0))
        except Exception as exc:  # OSError, EOFError, _HolderFailed; anything else is logged with its trace
            why = (
                f"silent for {self.timeout:.1f} s" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
            )
            expected = isinstance(exc, (OSError, EOFError, _HolderFailed))
            if not self.cancelled:
                log.warning("fetch from %s failed: %s", addr, why, exc_info=not expected)
            with self.cond:
                self.errors.append(f"{addr}: {why}")
            if todo is not None:
                self._finish(sorted(left))

    def _take(self) -> range | None:
        """The next range to fetch, waiting while another holder may still give one back (each read of a range in
        flight ends within its holder's timeout); None when every chunk is in, or the fetch was cancelled."""
        with self.cond:
            while not self.pending and self.in_flight and not self.cancelled:
                self.cond.wait(self.timeout)
            if self.cancelled or not self.pending:
                return None
            self.in_flight += 1
            return self.pending.popleft()

    def _finish(self, left: Sequence[int]) -> None:
        """A range ended; ``left``: its chunks that did not arrive, for the other holders."""
        with self.cond:
            self.in_flight -= 1
            self.pending.extend(range(i, i + 1) for i in left)
            self.cond.notify_all()

    def _receive(self, sock: socket.socket, addr: str, index: int) -> None:
        got, length, checksum, status = CHUNK.unpack(recv_exact(sock, CHUNK.size))
        if status == Status.CORRUPT:
            with self.cond:
                self.corrupt_from.setdefault(index, set()).add(addr)
            raise _HolderFailed(f"its copy failed its check at chunk {index} (it dropped the copy)")
        if status != Status.OK:
            raise _HolderFailed(f"it refused the ticket or chunk {index} (status {status})")
        msg = self.msg
        start = index * msg.chunk_bytes
        expected = chunk_length(index, msg.chunk_bytes, msg.data_bytes)
        if got != index or length != expected:
            raise _HolderFailed(f"it sent chunk {got} of {length} bytes for chunk {index} of {expected}")
        h = xxhash.xxh3_64()
        self._land(sock, start, start + length, h)
        if h.intdigest() != checksum:
            with self.cond:
                self.corrupt_from.setdefault(index, set()).add(addr)
            raise _HolderFailed(f"chunk {index} failed its end-to-end checksum")
        self.sums[index] = checksum
        if self.on_progress is not None:
            with self.cond:
                self.done_bytes += length
                done = self.done_bytes
            self.on_progress(done)

    def _land(self, sock: socket.socket, start: int, end: int, h: xxhash.xxh3_64) -> None:
        """Read bytes ``[start, end)`` of the data buffer from ``sock`` into their pieces (and a scratch buffer
        for gaps no entry covers), hashing them into ``h``."""
        pos = start
        i = max(0, bisect.bisect_right(self.starts, pos) - 1)
        while pos < end:
            view: memoryview | None = None
            if i < len(self.pieces):
                p_start, piece = self.pieces[i]
                if p_start <= pos < p_start + piece.nbytes:
                    view = piece[pos - p_start : min(end, p_start + piece.nbytes) - p_start]
                    i += 1
                elif pos >= p_start + piece.nbytes:
                    i += 1
                    continue
            if view is None:  # a gap before the next piece (padding): into the slot, as its seal covers it
                upto = min(end, self.pieces[i][0] if i < len(self.pieces) else end)
                view = self.slot[pos:upto] if self.slot is not None else memoryview(bytearray(upto - pos))
            if self.cancelled:
                raise _HolderFailed("cancelled")
            recv_into(sock, view)
            h.update(view)
            pos += view.nbytes
