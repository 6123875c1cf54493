"""Probes of nodes suspected dead: the state's queue, the probe itself on real sockets, and a real coordinator
that declares a node dead at once when a rank reports a lost peer and that node's data port refuses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterator

import pytest

from snapshotd.coordinator import CoordinatorConfig, CoordinatorState
from snapshotd.coordinator.probes import SILENCE_INTERVALS, Prober, host_local, probe
from snapshotd.proto import (
    Heartbeat,
    PeerLostReply,
    PeerLostReport,
    RankInfo,
    RegisterSidecar,
    SidecarRegistered,
)
from snapshotd.status import fetch_status

from .scenario import LATER, T0, beat, make, ranks, register
from .test_server import TIMEOUT, ask, dealer, start  # noqa: F401 - fixtures


@contextlib.contextmanager
def _listening() -> Iterator[str]:
    """A TCP port something listens on (without ever accepting: the kernel completes the handshake)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _closed_port() -> str:
    """A TCP port nothing listens on (bound once, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_the_state_queues_the_other_nodes_of_the_job_once_per_heartbeat_interval() -> None:
    st = make()
    for n in "abcd":
        register(st, n)
    for n, r in zip("abc", range(3), strict=True):
        beat(st, n, T0, ranks("j", 3, r))  # d runs no rank of j
    reply = st.peer_lost(PeerLostReport(job="j", rank=0, node="a"), LATER)
    assert reply.probed == 2 and sorted(st.membership.suspects) == ["b", "c"]
    assert st.peer_lost(PeerLostReport(job="j", rank=0, node="a"), LATER + 0.1).probed == 0  # queued already
    assert st.peer_lost(PeerLostReport(job="nope", rank=0, node="a"), LATER).probed == 0  # an unknown job
    taken = st.membership.take_suspects(8)
    assert [n.name for n, _ in taken] == ["b", "c"] and "rank 0 of job j on node a lost a peer" in taken[0][1]
    # b is found gone: dead at once, its ranks' home dropped; a stale probe of another incarnation changes nothing
    b = st.membership.nodes["b"]
    assert not st.lose(b, "another incarnation", "refused")
    assert st.lose(b, "i1", "refused a connection") and not b.alive and st.membership.live == 3
    assert not st.lose(b, "i1", "refused again")
    assert 1 not in st.jobs["j"].homes
    # c: within the interval
    assert st.peer_lost(PeerLostReport(job="j", rank=0, node="a"), LATER + 0.2).probed == 0
    assert st.peer_lost(PeerLostReport(job="j", rank=0, node="a"), LATER + 0.6).probed == 1  # c again, not b


def test_a_probe_tells_an_open_port_a_refused_one_and_what_it_cannot_know(tmp_path) -> None:
    async def main() -> None:
        with _listening() as open_addr:
            assert await probe(open_addr, 1.0) is True
        assert await probe(_closed_port(), 1.0) is False
        with socket.socket(socket.AF_UNIX) as u:
            path = os.path.join(tmp_path, "data.sock")
            u.bind(path)
            u.listen()
            assert await probe(f"ipc://{path}", 1.0) is True
        os.unlink(path)
        assert await probe(f"ipc://{path}", 1.0) is False  # the socket file is gone
        assert await probe("mem://node-a", 1.0) is None
        assert await probe("tcp://not-a-host.invalid:1", 1.0) is None

    asyncio.run(main())


def _refusing_node(st: CoordinatorState, name: str = "b"):
    """A node registered now whose data address refuses connections."""
    st.register(RegisterSidecar(node=name, data_addr=_closed_port(), incarnation="i1"), time.monotonic())
    return st.membership.nodes[name]


def test_a_refusing_node_is_declared_dead_only_once_it_also_missed_a_heartbeat() -> None:
    """A refusal alone is not enough: the node must be silent for SILENCE_INTERVALS of its heartbeat interval too.
    One that keeps heartbeating (a firewall resets the coordinator's connections; its listener is not open yet)
    stays live; a silent one is declared dead as soon as that silence is reached."""

    async def main() -> None:
        st = CoordinatorState(
            CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=30.0), now=time.monotonic()
        )
        deaths: list[str] = []
        prober = Prober(st, lambda: deaths.append("b"))
        b = _refusing_node(st)

        async def heartbeats(stop: asyncio.Event) -> None:
            while not stop.is_set():
                st.membership.seen(b, time.monotonic())
                await asyncio.sleep(0.02)

        stop = asyncio.Event()
        beating = asyncio.create_task(heartbeats(stop))
        assert not await prober.check(b, "i1", "(test)", 1.0)
        stop.set()
        await beating
        assert b.alive and not deaths
        t0 = time.monotonic()
        assert await prober.check(b, "i1", "(test)", 1.0)  # silent now: dead once silent long enough
        assert not b.alive and deaths == ["b"]
        assert time.monotonic() - b.last_seen >= SILENCE_INTERVALS * 0.1 - 0.01
        assert time.monotonic() - t0 < 10.0

    asyncio.run(main())


def test_a_node_whose_listener_closes_just_after_the_first_probe_is_declared_dead_by_the_second() -> None:
    """The node's ranks were killed with it and reported lost, but its sidecar's listener was still open at the
    first probe: one heartbeat interval later the second probe is refused."""

    async def main() -> None:
        st = CoordinatorState(
            CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=30.0), now=time.monotonic()
        )
        probed = asyncio.Event()

        def first_probe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            server.close()  # the sidecar's process ends: nothing listens any more
            writer.close()
            probed.set()

        server = await asyncio.start_server(first_probe, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        st.register(
            RegisterSidecar(node="b", data_addr=f"tcp://127.0.0.1:{port}", incarnation="i1"), time.monotonic()
        )
        b = st.membership.nodes["b"]
        assert await Prober(st, lambda: None).check(b, "i1", "(test)", 1.0)
        assert probed.is_set() and not b.alive

    asyncio.run(main())


def test_another_hosts_loopback_address_is_not_probed() -> None:
    assert host_local("tcp://127.0.0.1:1") and host_local("tcp://localhost:1") and host_local("ipc:///tmp/x")
    assert (
        host_local("tcp://[::1]:1")
        and not host_local("tcp://10.0.0.5:1")
        and not host_local("tcp://node-a:1")
    )

    async def main() -> None:
        st = CoordinatorState(
            CoordinatorConfig(bind="tcp://0.0.0.0:7070", heartbeat_interval=0.1, heartbeat_timeout=30.0),
            now=time.monotonic(),
        )
        b = _refusing_node(st)
        b.last_seen = time.monotonic() - 1.0
        assert st.membership.suspect("b", "(test)", time.monotonic())
        async with Prober(st, lambda: None) as prober:
            prober.start()  # on another host than the coordinator's: not probed
            assert not st.membership.suspects and not prober._running and b.alive

    asyncio.run(main())


def _join(sock, node: str, data_addr: str, rank: int) -> None:
    assert isinstance(
        ask(sock, RegisterSidecar(node=node, data_addr=data_addr, incarnation="i1")), SidecarRegistered
    )
    info = RankInfo(job="j", rank=rank, world_size=3, pid=100 + rank, alive=True)
    assert ask(sock, Heartbeat(node=node, incarnation="i1", ranks=(info,))).known


def test_a_lost_peer_gets_a_node_whose_sidecar_is_gone_declared_dead_at_once(start, dealer) -> None:  # noqa: F811
    """Nodes a and c have live data ports, b's refuses (its sidecar is gone, its host up). Rank 0 on a reports a
    lost peer: b is declared dead within a probe, not after the death timeout (30 s); a and c stay live."""
    coord = start(heartbeat_timeout=30.0, heartbeat_interval=0.1)
    socks = {n: dealer(coord.endpoint) for n in "abc"}
    with _listening() as addr_a, _listening() as addr_c:
        for rank, (node, addr) in enumerate((("a", addr_a), ("b", _closed_port()), ("c", addr_c))):
            _join(socks[node], node, addr, rank)
        t0 = time.monotonic()
        reply = ask(socks["a"], PeerLostReport(job="j", rank=0, node="a"))
        assert isinstance(reply, PeerLostReply) and reply.probed == 2
        alive: dict[str, bool] = {}
        while alive.get("b", True):
            assert time.monotonic() - t0 < TIMEOUT, alive
            alive = {
                n["node"]: n["alive"]
                for n in fetch_status(coord.endpoint, secret=None, timeout=TIMEOUT)["nodes"]
            }
        assert alive == {"a": True, "b": False, "c": True}
        assert time.monotonic() - t0 < 15.0  # a probe's time, not the death timeout's (30 s)
        assert not ask(socks["b"], Heartbeat(node="b", incarnation="i1")).known  # b must register again


def test_a_report_for_a_job_nobody_runs_probes_nothing(start, dealer) -> None:  # noqa: F811
    coord = start()
    reply = ask(dealer(coord.endpoint), PeerLostReport(job="unknown", rank=0, node="a"))
    assert isinstance(reply, PeerLostReply) and reply.probed == 0


def test_a_probe_measures_a_nodes_silence_on_the_coordinators_clock(caplog: pytest.LogCaptureFixture) -> None:
    """The node last heartbeated at the clock's 100.0; the coordinator's clock reads 200.0 (real time has barely
    moved): the refusal comes after a silence long enough, so the node is declared dead without waiting."""

    async def main() -> None:
        clock = [100.0]
        st = CoordinatorState(CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=30.0), now=clock[0])
        st.register(RegisterSidecar(node="b", data_addr=_closed_port(), incarnation="i1"), clock[0])
        b = st.membership.nodes["b"]
        clock[0] = 200.0
        t0 = time.monotonic()
        assert await Prober(st, lambda: None, clock=lambda: clock[0]).check(b, "i1", "(test)", 1.0)
        assert not b.alive and time.monotonic() - t0 < 1.0
        assert "was silent for 100.0 s (test): declared dead" in caplog.text

    asyncio.run(main())


def test_probes_are_tasks_of_the_probers_group_and_end_with_it() -> None:
    """Outside its ``async with`` a prober starts none; inside, a probe still waiting when the block ends is
    cancelled and waited for, so none outlives the coordinator's loop."""

    async def main() -> None:
        st = CoordinatorState(
            CoordinatorConfig(heartbeat_interval=5.0, heartbeat_timeout=30.0), now=time.monotonic()
        )
        b = _refusing_node(st)  # silent for 1.5 intervals = 7.5 s only later: its check waits that long
        prober = Prober(st, lambda: None)
        assert st.membership.suspect("b", "(test)", time.monotonic())
        with pytest.raises(RuntimeError, match="only inside `async with prober`"):
            prober.start()
        assert "b" in st.membership.suspects  # still queued: the refused start took nothing
        async with prober:
            prober.start()
            (task,) = prober._running
            await asyncio.sleep(0.2)  # refused, now waiting for the silence
            assert not task.done()
        assert task.cancelled() and b.alive

    asyncio.run(main())
