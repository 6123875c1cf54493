"""The bulk port and a rank's fetch from it: real sockets and threads, holders' copies in this process.

Each holder is a :class:`~snapshotd.sidecar.bulk.BulkServer` on an event loop of its own thread, serving a
:class:`~snapshotd.sidecar.serve.HeldCopy` of test bytes; the rank's side is :class:`client.fetch.RestoreFetcher`,
landing into a numpy array (a live tensor's stand-in, by address) and an arena slot. The snapshot's two entries
have 64 bytes of padding between them, as the client's layout leaves between tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from snapshotd.client import fetch as fetch_module
from snapshotd.client.fetch import RestoreFetcher
from snapshotd.proto import RestoreFetch, RestoreFetched, TensorEntry, encode_table
from snapshotd.proto.bulk import CHUNK, HELLO, MAGIC, RANGE, VERSION, Status
from snapshotd.shm import Arena, create_arena
from snapshotd.sidecar import bulk as bulk_module
from snapshotd.sidecar.bulk import BulkServer, HeldCopy
from snapshotd.sidecar.config import SidecarConfig
from snapshotd.sidecar.integrity import CorruptCopy, Seal
from snapshotd.sidecar.local import SlotState
from tests.waits import wait_until

CHUNK_BYTES = 64 << 10
A_FLOATS = 200_000  # entry "a": 800,000 bytes, into the live array
B_BYTES = 123_457  # entry "b": into the slot (the rank names no target for it)
B_OFFSET = 4 * A_FLOATS + 64
DATA_BYTES = B_OFFSET + B_BYTES
NCHUNKS = -(-DATA_BYTES // CHUNK_BYTES)
SNAPSHOT = [
    TensorEntry("a", "float32", (A_FLOATS,), 0, 4 * A_FLOATS),
    TensorEntry("b", "uint8", (B_BYTES,), B_OFFSET, B_BYTES),
]


@pytest.fixture(autouse=True)
def short_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges of 3 chunks, so that a copy of 15 chunks is striped over every holder."""
    monkeypatch.setattr(fetch_module, "RANGE_BYTES", 3 * CHUNK_BYTES)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own, for the holders."""
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(10)
    lp.close()


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = create_arena(f"bulk-{uuid.uuid4().hex[:6]}", 0, -(-DATA_BYTES // 4096) * 4096, 2, node="test")
    yield a
    a.close(unlink=True)


def _data(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, DATA_BYTES, dtype=np.uint8)


class Holder:
    """A BulkServer holding one copy; ``dropped`` lists what its corrupt callback was told. With ``after``, it
    sends nothing until that holder has read a chunk of its copy: the first range goes to ``after``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        data: np.ndarray,
        *,
        good: np.ndarray | None = None,
        ticket_ttl: float = 30.0,
        after: Holder | None = None,
    ) -> None:
        self.loop = loop
        self.data = data
        self.seal = Seal(CHUNK_BYTES, 0)
        self.seal.fill(memoryview(good if good is not None else data))  # the seal of the bytes as announced
        self.slot = SlotState()
        self.has_read = threading.Event()
        view = memoryview(data)

        def read(start: int, end: int) -> memoryview:
            if after is not None:
                assert after.has_read.wait(10)
            self.has_read.set()
            return view[start:end]

        self.copy = HeldCopy(b"", b"", DATA_BYTES, self.seal, read, self.slot, lambda: None)
        self.dropped: list[CorruptCopy] = []
        self.served = 0

        async def make() -> BulkServer:
            return BulkServer("127.0.0.1", 0, served=self._count, ticket_ttl=ticket_ttl, timeout=2.0)

        self.server = asyncio.run_coroutine_threadsafe(make(), loop).result(10)

    def _count(self, n: int) -> None:
        self.served += n

    def ticket(self) -> bytes:
        token = self.on_loop(lambda: self.server.grant(self.copy, "the test copy", self.dropped.append))
        assert token is not None
        return token

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def pins(self) -> int:
        return int(self.on_loop(lambda: self.slot.pins))

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.on_loop(self.server.close)


@pytest.fixture
def holders(loop: asyncio.AbstractEventLoop) -> Iterator[Callable[..., Holder]]:
    made: list[Holder] = []

    def make(data: np.ndarray, **kwargs: Any) -> Holder:
        h = Holder(loop, data, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _fetcher(
    arena: Arena,
    holders: list[tuple[str, bytes]],
    live: np.ndarray | None,
    *,
    timeout: float = 5.0,
    progress: list[int] | None = None,
) -> RestoreFetcher:
    """A fetch of the test snapshot from ``holders`` into ``live`` (entry "a"; None: no target) and slot 1 of
    ``arena`` (the rest)."""
    msg = RestoreFetch(
        job="j",
        rank=0,
        step=3,
        fetch=7,
        data_bytes=DATA_BYTES,
        chunk_bytes=CHUNK_BYTES,
        arena=arena.path,
        slot_bytes=arena.slot_bytes,
        slots=arena.slots,
        slot=1,
        holders=tuple(a for a, _ in holders),
        table=encode_table(SNAPSHOT),
        tokens=b"".join(t for _, t in holders),
    )
    targets = [live.ctypes.data if live is not None else 0, 0]
    return RestoreFetcher(
        msg, SNAPSHOT, targets, timeout=timeout, on_progress=progress.append if progress is not None else None
    )


def _fetch(
    arena: Arena, holders: list[tuple[str, bytes]], live: np.ndarray | None, **kwargs: Any
) -> RestoreFetched:
    return _fetcher(arena, holders, live, **kwargs).run()


def _landed(arena: Arena, live: np.ndarray) -> bytes:
    """Entry "a" from the array, the padding and entry "b" from the slot."""
    return live.tobytes() + bytes(arena.slot(1)[4 * A_FLOATS : DATA_BYTES])


def test_a_rank_fetches_a_copy_from_two_holders_into_its_tensor_and_its_slot(holders, arena) -> None:
    data = _data()
    a, b = holders(data), holders(data.copy())
    live = np.zeros(A_FLOATS, dtype=np.float32)
    progress: list[int] = []
    answer = _fetch(arena, [(a.addr, a.ticket()), (b.addr, b.ticket())], live, progress=progress)
    assert answer.ok and answer.direct and answer.fetched == DATA_BYTES and answer.fetch == 7, answer.reason
    assert _landed(arena, live) == data.tobytes()
    assert np.frombuffer(answer.sums, "<u8").tolist() == [a.seal.sums[i] for i in range(NCHUNKS)]
    assert bytes(arena.slot(1)[: 4 * A_FLOATS]) == bytes(4 * A_FLOATS)  # entry "a" went to the array only
    assert max(progress) == DATA_BYTES
    wait_until(lambda: a.pins() == b.pins() == 0, "the tickets' pins released", 10)
    assert a.served + b.served == DATA_BYTES  # each chunk once (how they share depends on who connects first)


def test_a_holder_whose_copy_is_corrupt_drops_it_and_the_other_serves_its_chunks(holders, arena) -> None:
    good = _data()
    bad = good.copy()
    bad[0 : DATA_BYTES : 3 * CHUNK_BYTES] ^= 0xFF  # the first chunk of every range
    a = holders(bad, good=good)
    b = holders(good.copy(), after=a)
    live = np.zeros(A_FLOATS, dtype=np.float32)
    answer = _fetch(arena, [(a.addr, a.ticket()), (b.addr, b.ticket())], live)
    assert answer.ok, answer.reason
    assert _landed(arena, live) == good.tobytes()
    wait_until(lambda: len(a.on_loop(lambda: list(a.dropped))) == 1, "the corrupt copy dropped", 10)
    assert a.dropped[0].block is not None and a.dropped[0].block % 3 == 0


def test_a_chunk_corrupt_at_every_holder_fails_the_fetch_naming_it(holders, arena) -> None:
    good = _data()
    bad = good.copy()
    bad[5 * CHUNK_BYTES] ^= 1
    a, b = holders(bad, good=good), holders(bad.copy(), good=good)
    answer = _fetch(arena, [(a.addr, a.ticket()), (b.addr, b.ticket())], np.zeros(A_FLOATS, dtype=np.float32))
    assert not answer.ok
    assert "chunk 5 failed its check from every holder" in answer.reason, answer.reason


class _Unchecking(Seal):
    """A seal that never checks: its holder sends whatever it holds, with the carried checksum."""

    def check_block(self, index: int, view: memoryview, what: str) -> int:
        return self.sums[index]


def test_bytes_that_fail_the_rank_s_own_check_are_taken_from_another_holder(holders, arena) -> None:
    good = _data()
    a = holders(good.copy())
    b = holders(good.copy(), after=a)
    a.data[0 : DATA_BYTES : 3 * CHUNK_BYTES] ^= (
        0x10  # the first chunk of every range, after the seal was taken
    )
    # and sent unchecked, with the carried checksum
    a.copy.seal = _Unchecking(CHUNK_BYTES, 0, dict(a.seal.sums))
    live = np.zeros(A_FLOATS, dtype=np.float32)
    fetcher = _fetcher(arena, [(a.addr, a.ticket()), (b.addr, b.ticket())], live)
    answer = fetcher.run()
    assert answer.ok, answer.reason
    assert _landed(arena, live) == good.tobytes()
    assert [e for e in fetcher.errors if e.startswith(a.addr) and "failed its end-to-end checksum" in e], (
        fetcher.errors
    )
    assert a.served < DATA_BYTES  # it stopped serving at its first bad chunk


def test_a_ticket_admits_one_connection_and_anything_else_is_refused(holders, arena) -> None:
    data = _data()
    a = holders(data)
    token = a.ticket()

    def hello(tok: bytes, magic: bytes = MAGIC) -> int:
        with socket.create_connection(("127.0.0.1", a.server.port), timeout=5) as s:
            s.sendall(HELLO.pack(magic, VERSION, tok) + RANGE.pack(0, 1))
            return CHUNK.unpack(s.recv(CHUNK.size, socket.MSG_WAITALL))[3]

    assert hello(bytes(16)) == Status.REFUSED
    assert hello(token, magic=b"XXXX") == Status.REFUSED  # a bad hello spends nothing
    assert hello(token) == Status.OK
    assert hello(token) == Status.REFUSED  # used
    live = np.zeros(A_FLOATS, dtype=np.float32)
    answer = _fetch(arena, [(a.addr, token)], live)
    assert not answer.ok and "refused the ticket" in answer.reason, answer.reason


def test_a_connection_that_presents_no_ticket_is_closed(holders, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk_module, "HELLO_TIMEOUT", 0.2)
    a = holders(_data())
    with socket.create_connection(("127.0.0.1", a.server.port), timeout=10) as s:
        assert s.recv(1) == b""  # closed by the holder, not by this timeout


def test_a_range_outside_the_copy_is_refused(holders) -> None:
    a = holders(_data())
    with socket.create_connection(("127.0.0.1", a.server.port), timeout=5) as s:
        s.sendall(HELLO.pack(MAGIC, VERSION, a.ticket()) + RANGE.pack(NCHUNKS - 1, 2))
        assert CHUNK.unpack(s.recv(CHUNK.size, socket.MSG_WAITALL))[3] == Status.REFUSED
    wait_until(lambda: a.pins() == 0, "the pin released", 10)


def test_a_silent_holder_gives_its_chunks_to_the_others(holders, arena) -> None:
    data = _data()
    a = holders(data)
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        live = np.zeros(A_FLOATS, dtype=np.float32)
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        answer = _fetch(arena, [(mute, bytes(16)), (a.addr, a.ticket())], live, timeout=0.5)
    assert answer.ok, answer.reason
    assert _landed(arena, live) == data.tobytes()


def test_no_holder_reachable_answers_why(arena) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    answer = _fetch(arena, [(f"127.0.0.1:{port}", bytes(16))], np.zeros(A_FLOATS, dtype=np.float32))
    assert not answer.ok and "cannot connect" in answer.reason, answer.reason


def test_a_fetch_asked_into_a_missing_arena_answers_why(holders) -> None:
    a = holders(_data())
    msg = RestoreFetch(
        job="j",
        rank=0,
        step=3,
        fetch=7,
        data_bytes=DATA_BYTES,
        chunk_bytes=CHUNK_BYTES,
        arena="/dev/shm/snapshotd-no-such-arena",
        slot_bytes=1 << 20,
        slots=2,
        slot=1,
        holders=(a.addr,),
        table=encode_table(SNAPSHOT),
        tokens=a.ticket(),
    )
    answer = RestoreFetcher(msg, [], [], timeout=5.0).run()
    assert not answer.ok and "cannot take the fetch" in answer.reason and answer.fetch == 7, answer.reason


def test_without_targets_every_byte_lands_in_the_slot_which_then_passes_its_seal(holders, arena) -> None:
    data = _data()
    data[4 * A_FLOATS : B_OFFSET] = 0xAB  # padding the seal covers like any byte
    a = holders(data)
    answer = _fetch(arena, [(a.addr, a.ticket())], None)
    assert answer.ok and not answer.direct, answer.reason
    slot = arena.slot(1)[:DATA_BYTES]
    assert bytes(slot) == data.tobytes()
    seal = Seal.announced(CHUNK_BYTES, b"", b"")
    seal.sums.update(enumerate(np.frombuffer(answer.sums, "<u8").tolist()))
    seal.check(slot, b"", b"", "the fetched slot")  # as a later local restore or a pull from it checks


def test_a_fetch_cancelled_in_the_middle_of_a_chunk_stops_and_lands_nothing_more(arena) -> None:
    """A holder sends half of chunk 0, then waits; the fetch is cancelled, and only then does the holder send the
    rest: none of it may land."""
    half = CHUNK_BYTES // 2
    sent_half, go_on, done = threading.Event(), threading.Event(), threading.Event()

    def holder(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(HELLO.size + RANGE.size, socket.MSG_WAITALL)
            conn.sendall(CHUNK.pack(0, CHUNK_BYTES, 0, Status.OK) + b"\x11" * half)
            sent_half.set()
            go_on.wait(10)
            with contextlib.suppress(OSError):  # the fetch cut the connection
                conn.sendall(b"\x22" * (DATA_BYTES - half))
        done.set()

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        server = threading.Thread(target=holder, args=(listener,), daemon=True)
        server.start()
        live = np.zeros(A_FLOATS, dtype=np.float32)
        fetcher = _fetcher(arena, [(f"127.0.0.1:{listener.getsockname()[1]}", bytes(16))], live, timeout=30.0)
        answers: list[RestoreFetched] = []
        thread = threading.Thread(target=lambda: answers.append(fetcher.run()))
        thread.start()
        assert sent_half.wait(10)
        raw = live.view(np.uint8)
        wait_until(lambda: raw[half - 1] == 0x11, "the first half of chunk 0 landed", 10)
        fetcher.cancel()
        assert all(not t.is_alive() for t in fetcher.threads)
        go_on.set()
        assert done.wait(10)
        thread.join(10)
        server.join(10)
    assert not thread.is_alive() and not answers[0].ok and answers[0].reason == "cancelled"
    assert not raw[half:].any()  # nothing past what had arrived before the cancel


def test_tickets_past_the_most_outstanding_are_refused(holders, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk_module, "MAX_TICKETS", 2)
    a = holders(_data())
    a.ticket()
    a.ticket()
    assert a.on_loop(lambda: a.server.grant(a.copy, "the test copy", a.dropped.append)) is None
    assert a.pins() == 2  # the refused one pinned nothing


def test_an_unused_ticket_expires_and_close_releases_the_rest(holders) -> None:
    a = holders(_data(), ticket_ttl=0.2)
    a.ticket()
    assert a.pins() == 1
    wait_until(lambda: a.pins() == 0, "the unused ticket expired", 10)
    b = holders(_data())
    b.ticket()
    b.ticket()
    assert b.pins() == 2
    b.close()
    assert b.pins() == 0


@pytest.mark.parametrize(
    ("secret", "mode", "port", "serves"),
    [
        (None, "curve", 0, True),
        ("s", "members", 0, True),
        ("s", "curve", 0, False),
        (None, "curve", None, False),
    ],
)
def test_a_bulk_port_serves_only_on_a_plaintext_data_plane(
    secret: str | None, mode: str, port: int | None, serves: bool
) -> None:
    cfg = SidecarConfig(coordinator="tcp://127.0.0.1:7070", secret=secret, data_security=mode, bulk_port=port)
    assert cfg.serves_bulk == serves
