"""A sidecar's paths to its peers: a timed-out or stalled transfer breaks one, a probe tells unreachable from
slow, and a transfer that completes or (for an unreachable one) a probe that connects heals it."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from snapshotd.proto import PathTrouble
from snapshotd.sidecar.paths import PROBE_AFTER_TIMEOUTS, SLOW_QUARANTINE_S, PeerPaths

A = "tcp://127.0.0.1:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _paths(clock: Clock, changes: list[int]) -> PeerPaths:
    return PeerPaths("n1", timeout=2.0, on_change=lambda: changes.append(1), clock=clock)


def test_a_completed_transfer_keeps_a_path_working_and_a_timeout_breaks_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="snapshotd.sidecar.paths")
    clock, changes = Clock(), []
    paths = _paths(clock, changes)
    with paths.transfer(A):
        clock.now += 1.0
    assert paths.troubles() == () and paths.paths[A].last_success == clock.now
    with pytest.raises(TimeoutError), paths.transfer(A):
        paths.failed(A, "no chunk_ack within 2.0 s")
        raise TimeoutError
    assert paths.troubles() == (PathTrouble(addr=A, reason="no chunk_ack within 2.0 s"),)
    assert paths.paths[A].failures == {"timeout": 1, "stalled": 0} and changes == [1]
    assert "node n1: the snapshot path to peer tcp://127.0.0.1:1 is broken: no chunk_ack" in caplog.text
    assert paths.check() == [A], "a new break is probed at once, to learn its kind"
    with paths.transfer(A):
        pass
    assert paths.troubles() == () and changes == [1, 1]
    assert "healed after 0.0 s (a transfer completed)" in caplog.text


def test_transfers_cut_short_for_a_peer_timeout_break_the_path_but_transfers_far_apart_do_not() -> None:
    clock, changes = Clock(), []
    paths = _paths(clock, changes)
    for _ in range(3):  # each superseded by the next step's after 0.5 s: none completes, none times out
        with pytest.raises(asyncio.CancelledError), paths.transfer(A):
            clock.now += 0.5
            raise asyncio.CancelledError
        clock.now += 0.1
    assert paths.check() == [] and paths.troubles() == ()  # 1.8 s: under the peer timeout
    with pytest.raises(asyncio.CancelledError), paths.transfer(A):
        clock.now += 0.5
        raise asyncio.CancelledError
    assert paths.check() == [A]
    (trouble,) = paths.troubles()
    assert trouble.reason == "no transfer completed for 2.3 s" and paths.paths[A].failures["stalled"] == 1
    other, quiet = "tcp://127.0.0.1:2", []
    paths = _paths(clock, quiet)
    with pytest.raises(asyncio.CancelledError), paths.transfer(other):
        raise asyncio.CancelledError
    clock.now += 5.0  # the job stopped snapshotting: no transfer under way is no stall
    assert paths.check() == [] and quiet == []
    with pytest.raises(asyncio.CancelledError), paths.transfer(other):
        clock.now += 1.0
        raise asyncio.CancelledError
    assert paths.check() == [], "a transfer after a pause starts a new count"


def _listener(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


def test_a_probe_tells_unreachable_from_slow_and_heals_only_an_unreachable_path_soon() -> None:
    async def main() -> None:
        clock, changes = Clock(), []
        paths = _paths(clock, changes)
        with _listener() as up:
            live = f"tcp://127.0.0.1:{up.getsockname()[1]}"
            closed = _listener()
            gone = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
            closed.close()  # nothing listens there: refused
            for addr in (live, gone):
                paths.failed(addr, "no chunk_ack within 2.0 s")
            for addr in paths.check():
                await paths.probe(addr)
            reasons = {t.addr: t.reason for t in paths.troubles()}
            assert reasons[live].startswith("slow: it connects, but no chunk_ack within 2.0 s")
            assert (
                reasons[gone].startswith("unreachable: connecting to 127.0.0.1:")
                and "Connection refused" in reasons[gone]
            )
            assert paths.check() == [], "neither is probed again before its time"
            clock.now += PROBE_AFTER_TIMEOUTS * 2.0
            assert paths.check() == [gone]
            await paths.probe(gone)
            assert gone in {t.addr for t in paths.troubles()}, "still refused: still broken"
            with _listener(port=int(gone.rsplit(":", 1)[1])):  # the peer listens again
                for addr in paths.check():
                    await paths.probe(addr)
            assert [t.addr for t in paths.troubles()] == [live], (
                "the unreachable one healed, the slow one not"
            )
            clock.now += SLOW_QUARANTINE_S
            assert paths.check() == [live]
            await paths.probe(live)
            assert paths.troubles() == ()

    asyncio.run(main())


def test_one_long_paced_transfer_or_one_cut_short_then_nothing_never_breaks_a_path() -> None:
    clock, changes = Clock(), []
    paths = _paths(clock, changes)
    with paths.transfer(A):  # paced to last five peer timeouts, and never superseded
        clock.now += 5.0
        assert paths.check() == [] and paths.troubles() == ()
    with pytest.raises(asyncio.CancelledError), paths.transfer(A):  # cut off (its buddy re-placed) at once
        clock.now += 1.0
        raise asyncio.CancelledError
    clock.now += 10.0  # no transfer since: the idle time is no stall
    assert paths.check() == [] and paths.troubles() == () and changes == []


def test_a_path_with_no_transfer_for_a_long_time_is_forgotten_and_a_broken_one_stops_being_reported() -> None:
    from snapshotd.sidecar.paths import FORGET_AFTER_S

    clock, changes = Clock(), []
    paths = _paths(clock, changes)
    with paths.transfer(A):
        pass
    paths.failed("tcp://127.0.0.1:2", "no chunk_ack within 2.0 s")
    clock.now += FORGET_AFTER_S + 1
    paths.check()
    assert paths.paths == {} and paths.troubles() == () and changes == [1, 1]
