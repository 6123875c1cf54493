"""A restoring rank fetching the step its sidecar pulls from the holders' bulk ports itself.

Asked by its sidecar (:class:`~snapshotd.proto.RestoreFetch`), the rank reads every chunk from the holders'
sockets straight to where it belongs (:mod:`snapshotd.proto.bulk`): into the live tensor that
:func:`~snapshotd.proto.landing_segments` names for its bytes, else into the arena slot the sidecar named. Chunks
go in ranges of :data:`RANGE_BYTES`, taken in turn by one thread per holder; a holder that fails (refuses, goes
silent for ``timeout`` seconds, sends a chunk that fails its check, or finds its own copy corrupt) gives its
unfinished range back to the others. Every chunk's xxh3-64 is checked as it lands, against the checksum its
holder carries. The answer (:class:`~snapshotd.proto.RestoreFetched`) says whether every chunk is in.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import socket
import threading
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from snapshotd.proto import RestoreFetch, RestoreFetched, TensorEntry, decode_table, landing_segments
from snapshotd.proto.bulk import CHUNK, HELLO, MAGIC, RANGE, TOKEN_BYTES, VERSION, Status, chunk_length
from snapshotd.shm import Arena, attach_arena

__all__ = ["RANGE_BYTES", "fetch_restore"]

log = logging.getLogger(__name__)

RANGE_BYTES = 64 << 20
"""Payload asked of one holder at a time (a whole number of chunks, at least one)."""


class _HolderFailed(Exception):
    """One holder cannot deliver (the message says why); its unfinished chunks go to the others."""


def fetch_restore(msg: RestoreFetch, live: Sequence[TensorEntry], targets: Sequence[int], *, timeout: float,
                  on_progress: Callable[[int], None] | None = None) -> RestoreFetched:  # fmt: skip
    """Fetch what ``msg`` asks into this process: ``live`` and ``targets`` are the tensor table and the addresses
    the restore request named (``targets`` empty: none). Never raises for a holder's or the network's trouble:
    the answer says what went wrong. ``on_progress(done_bytes)`` is called from the fetching threads."""
    try:
        fetch = _Fetch(msg, live, targets, timeout, on_progress)
    except (OSError, ValueError) as exc:  # the arena is gone or too small, a bad table or token list
        return _failed(msg, f"cannot take the fetch: {exc}")
    try:
        return fetch.run()
    except Exception as exc:  # a bug here must still answer: the sidecar waits for the answer, then pulls
        log.exception("fetching the restore failed")
        return _failed(msg, f"the fetch failed: {type(exc).__name__}: {exc}")
    finally:
        fetch.close()


def _failed(msg: RestoreFetch, reason: str) -> RestoreFetched:
    return RestoreFetched(job=msg.job, rank=msg.rank, step=msg.step, ok=False, reason=reason)


class _Fetch:
    def __init__(self, msg: RestoreFetch, live: Sequence[TensorEntry], targets: Sequence[int], timeout: float,
                 on_progress: Callable[[int], None] | None) -> None:  # fmt: skip
        tokens = memoryview(msg.tokens).tobytes()
        if len(tokens) != TOKEN_BYTES * len(msg.holders) or not msg.holders:
            raise ValueError(f"{len(tokens)} bytes of tokens for {len(msg.holders)} holders")
        self.msg = msg
        self.timeout = timeout
        self.on_progress = on_progress
        self.holders = [(addr, tokens[i * TOKEN_BYTES : (i + 1) * TOKEN_BYTES]) for i, addr in enumerate(msg.holders)]
        snapshot = decode_table(msg.table, msg.data_bytes)
        segments = landing_segments(snapshot, live, list(targets) if len(targets) == len(live) else [0] * len(live))
        self.direct = any(addr for _, _, addr in segments)
        self.arena: Arena | None = None
        slot: memoryview | None = None
        if any(not addr for _, _, addr in segments):
            self.arena = attach_arena(msg.arena, msg.slot_bytes, msg.slots)
            slot = self.arena.slot(msg.slot)
            if slot.nbytes < msg.data_bytes:
                raise ValueError(f"slot {msg.slot} holds {slot.nbytes} bytes, the step {msg.data_bytes}")
        # (start, view) pieces covering the data buffer where the snapshot has bytes, sorted by start
        self.pieces: list[tuple[int, memoryview]] = []
        for start, end, addr in segments:
            if addr:
                view = memoryview((ctypes.c_char * (end - start)).from_address(addr)).cast("B")
            else:
                assert slot is not None
                view = slot[start:end]
            self.pieces.append((start, view))
        self.starts = [start for start, _ in self.pieces]
        self.nchunks = -(-msg.data_bytes // msg.chunk_bytes)
        self.sums = np.zeros(self.nchunks, dtype="<u8")
        per_range = max(1, RANGE_BYTES // msg.chunk_bytes)
        self.pending = collections.deque(
            range(i, min(i + per_range, self.nchunks)) for i in range(0, self.nchunks, per_range)
        )
        self.cond = threading.Condition()
        self.in_flight = 0
        self.done_bytes = 0
        self.errors: list[str] = []
        self.corrupt_from: dict[int, set[str]] = {}

    def close(self) -> None:
        self.pieces.clear()  # the views go before the arena they look into
        if self.arena is not None:
            self.arena.close()

    def run(self) -> RestoreFetched:
        msg = self.msg
        threads = [threading.Thread(target=self._worker, args=holder, name="snapshotd-fetch", daemon=True)
                   for holder in self.holders]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:  # each ends once nothing is left or its holder failed; every wait in it is bounded
            t.join()
        if self.pending:
            everywhere = {addr for addr, _ in self.holders}
            bad = sorted(i for todo in self.pending for i in todo if everywhere <= self.corrupt_from.get(i, set()))
            why = f"chunk {bad[0]} failed its check from every holder; " if bad else ""
            return _failed(msg, f"{why}{'; '.join(self.errors)}")
        return RestoreFetched(job=msg.job, rank=msg.rank, step=msg.step, ok=True, direct=self.direct,
                              fetched=msg.data_bytes, sums=self.sums.tobytes())  # fmt: skip

    def _worker(self, addr: str, token: bytes) -> None:
        host, _, port = addr.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout)
        except (OSError, ValueError) as exc:
            with self.cond:
                self.errors.append(f"{addr}: cannot connect: {exc}")
            return
        with sock:
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
            except (OSError, EOFError, _HolderFailed) as exc:
                why = "silent" if isinstance(exc, TimeoutError) else str(exc)
                log.warning("fetch from %s failed: %s", addr, why)
                with self.cond:
                    self.errors.append(f"{addr}: {why}")
                if todo is not None:
                    self._finish(sorted(left))

    def _take(self) -> range | None:
        """The next range to fetch, waiting while another holder may still give one back; None when done."""
        with self.cond:
            while not self.pending:
                if self.in_flight == 0:
                    return None
                if not self.cond.wait(self.timeout * 2):  # a range in flight ends within its holder's timeouts
                    raise _HolderFailed("another holder's range did not finish in time")
            self.in_flight += 1
            return self.pending.popleft()

    def _finish(self, left: Sequence[int]) -> None:
        """A range ended; ``left``: its chunks that did not arrive, for the other holders."""
        with self.cond:
            self.in_flight -= 1
            self.pending.extend(range(i, i + 1) for i in left)
            self.cond.notify_all()

    def _receive(self, sock: socket.socket, addr: str, index: int) -> None:
        got, length, checksum, status = CHUNK.unpack(_recv_exact(sock, CHUNK.size))
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
            if view is None:  # a gap before the next piece (padding): read it and let it go
                upto = min(end, self.pieces[i][0] if i < len(self.pieces) else end)
                view = memoryview(bytearray(upto - pos))
            _recv_into(sock, view)
            h.update(view)
            pos += view.nbytes


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the holder closed the connection")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)
