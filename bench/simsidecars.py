"""Simulated sidecars for ``snapshotd-bench scale``: one process drives many over real DEALER sockets.

``python -m snapshotd.bench.simsidecars`` is started by :mod:`snapshotd.bench.scale`; it reads one JSON command
per line on stdin and answers each with one JSON event line on stdout (logs go to stderr). The first command is
``start`` (a :class:`FleetConfig` as a map); the process answers ``ready`` once each of its sidecars registered
and got a known heartbeat reply. Then ``mark`` (counters since the last mark), ``freeze`` (training stops),
``lose`` (a sidecar falls silent and a replacement node registers with its ranks), ``ask_all`` (every rank asks
for a plan once), ``sample`` (timed plan requests) and ``stop``.

Each simulated sidecar behaves like the real one's control loop (``snapshotd/sidecar/daemon.py``): its own DEALER
socket (one TCP connection to the coordinator), register, then heartbeat, wait for the reply (at most
``reply_timeout``), wait ``interval``, heartbeat again; ``changed`` and the full ranks and inventory only when
something changed since the last heartbeat the coordinator acknowledged. Node ``i`` hosts ranks ``8i .. 8i+7``
of one job (``ranks_per_node`` of them) and holds the buddy copies of node ``i - 1``'s ranks, which is where
the coordinator places them (ring order of the zero-padded names). Steps advance with a clock shared by every
process (``t0``, ``step_seconds``): a node holds its own ranks' steps ``s`` and ``s - 1`` and its buddy ranks'
``s - 1`` and ``s - 2`` while training, both ``s`` and ``s - 1`` once frozen (the streams finish).

No coroutine per sidecar: each socket's ZMQ_FD is an event-loop reader and every wait is a loop timer, so one
core drives thousands. Heartbeat headers are packed straight with msgpack (:func:`heartbeat_header`, the exact
bytes :func:`snapshotd.proto.encode` would produce, at a fraction of its cost); nothing here is pickled.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import resource
import sys
import time
from typing import Any

import msgpack
import uvloop
import zmq

from snapshotd import security
from snapshotd.proto import PROTOCOL_VERSION, PlanReply, PlanRequest, RegisterSidecar, decode, encode

__all__ = ["FleetConfig", "fds_needed", "heartbeat_header", "main", "node_name", "raise_nofile"]

log = logging.getLogger(__name__)

_CONNECT_BATCH = 250  # sockets connected per loop turn while ramping up (the listen backlog is 100)
_FDS_PER_SOCKET = 3  # the TCP connection, the socket's mailbox, and slack


@dataclasses.dataclass(kw_only=True, slots=True)
class FleetConfig:
    """What one simulator process drives: sidecars ``first .. first + count - 1`` of ``total``."""

    coordinator: str
    job: str
    first: int
    count: int
    total: int
    ranks_per_node: int = 8
    interval: float = 0.5
    step_seconds: float = 0.5
    t0: float = 0.0
    """``time.monotonic()`` at step 1 (the clock is shared by every process of the machine)."""
    reply_timeout: float = 2.0
    snapshot_bytes: int = 1 << 30
    """Bytes one rank's snapshot adds to the reported byte counters per step (the coordinator's rate path)."""


def fds_needed(sockets: int) -> int:
    """File descriptors a process with ``sockets`` ZeroMQ TCP sockets (or connections) may need."""
    return _FDS_PER_SOCKET * sockets + 256


def node_name(index: int, total: int) -> str:
    """``sim-00042``: zero-padded so that the coordinator's ring (sorted names) is numeric order."""
    return f"sim-{index:0{len(str(total))}d}"


def heartbeat_header(
    node: str, incarnation: str, changed: bool, ranks: list[list[Any]], inventory: list[list[Any]],
    bytes_out: int, bytes_in: int, stored_bytes: int,
) -> bytes:  # fmt: skip
    """Frame 0 of a :class:`~snapshotd.proto.Heartbeat`, packed directly.

    Args:
        ranks: ``[job, rank, world_size, pid, alive]`` per rank (the wire form of ``RankInfo``).
        inventory: ``[job, rank, step, local]`` per snapshot (the wire form of ``InventoryItem``).
    """
    return msgpack.packb({
        "v": PROTOCOL_VERSION, "type": "heartbeat", "job": "", "node": node, "incarnation": incarnation,
        "changed": changed, "ranks": ranks, "inventory": inventory, "bytes_out": bytes_out, "bytes_in": bytes_in,
        "stored_bytes": stored_bytes,
    }, use_bin_type=True)  # fmt: skip


@dataclasses.dataclass(slots=True, eq=False)
class _Sim:
    index: int
    name: str
    sock: zmq.Socket[bytes]
    own: list[int]  # ranks it hosts
    backed: list[int]  # ranks whose buddy copies it holds
    holds: bool = True  # False: a fresh node, no snapshots at all
    incarnation: str = "1"
    registered: bool = False
    silent: bool = False
    up: bool = False  # got its first known heartbeat reply
    timer: asyncio.TimerHandle | None = None
    hb_sent: float | None = None  # when the outstanding heartbeat left; None: none outstanding
    state: tuple[int, bool] = (-1, False)  # (step, frozen) last sent with changed=True
    acked: tuple[int, bool] | None = None  # ... and acknowledged by a known reply
    last_reply: bytes = b""
    to_ask: list[int] = dataclasses.field(default_factory=list)  # ask_all: ranks still to ask, in order
    asked_at: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> when its plan request left


class Fleet:
    """The sidecars of one process and their counters. Every method runs on the event loop's thread."""

    def __init__(self, cfg: FleetConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.cfg = cfg
        self.loop = loop
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctx.setsockopt(zmq.MAX_SOCKETS, cfg.count + 64)
        self.secret = security.secret_from_env()
        self.world = cfg.total * cfg.ranks_per_node
        self.sims: dict[int, _Sim] = {}
        self.freeze_at = float("inf")
        self.counts = dict.fromkeys(("hb_sent", "hb_replies", "timeouts", "stale", "reregistered", "tasks",
                                     "errors", "changed_sent"), 0)  # fmt: skip
        self.rtts: list[float] = []
        self.unready = 0
        self.ready = asyncio.Event()
        self.plan_waiter: asyncio.Future[None] | None = None
        self.plan_left = 0
        self.plan_replies: list[dict[str, Any]] = []

    # ---------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect and register every sidecar, a batch per loop turn; return when all got a known reply."""
        cfg = self.cfg
        self.unready = cfg.count
        for i in range(cfg.first, cfg.first + cfg.count):
            prev = (i - 1) % cfg.total
            own = list(range(i * cfg.ranks_per_node, (i + 1) * cfg.ranks_per_node))
            backed = list(range(prev * cfg.ranks_per_node, (prev + 1) * cfg.ranks_per_node))
            self._add(_Sim(i, node_name(i, cfg.total), self._socket(), own, backed))
            if (i - cfg.first) % _CONNECT_BATCH == _CONNECT_BATCH - 1:
                await asyncio.sleep(0.02)
        await self.ready.wait()

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        security.secure_client(sock, self.secret)
        sock.connect(self.cfg.coordinator)
        return sock

    def _add(self, sim: _Sim) -> None:
        self.sims[sim.index] = sim
        self.loop.add_reader(sim.sock.getsockopt(zmq.FD), self._drain, sim)
        self._register(sim)

    def close(self) -> None:
        for sim in self.sims.values():
            if sim.timer is not None:
                sim.timer.cancel()
            self.loop.remove_reader(sim.sock.getsockopt(zmq.FD))
            sim.sock.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------------------------ sending

    def _send(self, sim: _Sim, frames: list[Any]) -> None:
        sim.sock.send_multipart(frames, zmq.NOBLOCK)
        if sim.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the send may have eaten the FD's wake-up
            self._drain(sim)

    def _register(self, sim: _Sim) -> None:
        sim.registered, sim.hb_sent = False, None
        data_addr = f"tcp://10.{sim.index >> 16 & 255}.{sim.index >> 8 & 255}.{sim.index & 255}:7071"
        self._send(sim, encode(RegisterSidecar(node=sim.name, data_addr=data_addr, incarnation=sim.incarnation)))
        self._arm(sim, self.cfg.reply_timeout, self._register)

    def _arm(self, sim: _Sim, delay: float, fn: Any) -> None:
        if sim.timer is not None:
            sim.timer.cancel()
        sim.timer = self.loop.call_later(delay, fn, sim)

    def _step(self, now: float) -> tuple[int, bool]:
        t = min(now, self.freeze_at)
        return 1 + max(0, int((t - self.cfg.t0) / self.cfg.step_seconds)), now >= self.freeze_at

    def _beat(self, sim: _Sim) -> None:
        if sim.silent:
            return
        now = time.monotonic()
        state = self._step(now)
        changed = state != sim.acked
        ranks: list[list[Any]] = []
        inventory: list[list[Any]] = []
        step, frozen = state
        if changed:
            job, world = self.cfg.job, self.world
            ranks = [[job, r, world, 100_000 + r, True] for r in sim.own]
            if sim.holds:
                mine = [s for s in (step, step - 1) if s >= 1]
                theirs = mine if frozen else [s for s in (step - 1, step - 2) if s >= 1]
                inventory = [[job, r, s, True] for r in sim.own for s in mine]
                inventory += [[job, r, s, False] for r in sim.backed for s in theirs]
            self.counts["changed_sent"] += 1
        nbytes = self.cfg.snapshot_bytes * step
        header = heartbeat_header(sim.name, sim.incarnation, changed, ranks, inventory, nbytes * len(sim.own),
                                  nbytes * len(sim.backed), 2 * nbytes * len(sim.backed) // max(1, step))  # fmt: skip
        sim.state, sim.hb_sent = state, now
        self.counts["hb_sent"] += 1
        self._arm(sim, self.cfg.reply_timeout, self._timed_out)
        self._send(sim, [header])

    def _timed_out(self, sim: _Sim) -> None:
        """No reply within ``reply_timeout``: as the real sidecar, wait an interval and heartbeat again."""
        self.counts["timeouts"] += 1
        sim.hb_sent = None
        self._arm(sim, self.cfg.interval, self._beat)

    # ------------------------------------------------------------------------------------ receiving

    def _drain(self, sim: _Sim) -> None:
        while True:
            try:
                frames = sim.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_reply(sim, frames[0])

    def _on_reply(self, sim: _Sim, head: bytes) -> None:
        if head == sim.last_reply:  # the same heartbeat reply as last time: known, nothing new
            self._hb_reply(sim, True, 0)
            return
        msg = msgpack.unpackb(head, raw=False)
        kind = msg.get("type")
        if kind == "heartbeat_reply":
            ntasks = len(msg.get("tasks", ()))
            sim.last_reply = head if msg.get("known") and not ntasks else b""
            self._hb_reply(sim, bool(msg.get("known")), ntasks)
        elif kind == "plan_reply":
            self._plan_reply(sim, head)
        elif kind == "sidecar_registered":
            if not sim.registered:
                sim.registered, sim.acked = True, None
                first = sim.state[0] < 0  # spread first heartbeats over an interval
                self._arm(sim, self.cfg.interval * ((sim.index * 0.618) % 1.0) if first else 0.0, self._beat)
        else:
            self.counts["errors"] += 1
            if self.counts["errors"] == 1:
                log.warning("%s got %s: %s", sim.name, kind, msg.get("message", ""))

    def _hb_reply(self, sim: _Sim, known: bool, ntasks: int) -> None:
        if sim.hb_sent is None:  # the answer to a heartbeat that already timed out
            self.counts["stale"] += 1
            return
        now = time.monotonic()
        self.rtts.append(round((now - sim.hb_sent) * 1e3, 3))
        self.counts["hb_replies"] += 1
        self.counts["tasks"] += ntasks
        sim.hb_sent = None
        if not known:
            self.counts["reregistered"] += 1
            self._register(sim)
            return
        if not sim.up:
            sim.up = True
            self.unready -= 1
            if self.unready == 0:
                self.ready.set()
        sim.acked = sim.state
        self._arm(sim, self.cfg.interval, self._beat)

    # ------------------------------------------------------------------------------------ plans

    def _ask(self, sim: _Sim, rank: int) -> None:
        sim.asked_at[rank] = time.monotonic()
        self._send(sim, encode(PlanRequest(job=self.cfg.job, rank=rank, world_size=self.world, node=sim.name)))

    def _ask_now(self, sim: _Sim, ranks: list[int]) -> None:
        for rank in ranks:
            self._ask(sim, rank)

    def _plan_reply(self, sim: _Sim, head: bytes) -> None:
        reply = decode([head])
        assert isinstance(reply, PlanReply)
        sent = sim.asked_at.pop(reply.rank, None)
        if sent is None:
            self.counts["stale"] += 1
            return
        self.plan_replies.append({
            "node": sim.index, "rank": reply.rank, "ms": (time.monotonic() - sent) * 1e3, "status": reply.status,
            "step": reply.step, "local": reply.local, "sources": list(reply.sources),
        })  # fmt: skip
        if sim.to_ask:
            self._ask(sim, sim.to_ask.pop(0))
        self.plan_left -= 1
        if self.plan_left == 0 and self.plan_waiter is not None and not self.plan_waiter.done():
            self.plan_waiter.set_result(None)

    async def plans(self, asks: list[tuple[int, list[int]]], spread: float, one_at_a_time: bool) -> list[dict[str, Any]]:
        """Send plan requests and return one record per reply (node, rank, ms, status, step, local, sources).

        Args:
            asks: (sidecar index, ranks) pairs.
            spread: seconds over which the first requests of the sidecars are spread, evenly.
            one_at_a_time: each sidecar sends its next request when the previous one was answered (as ranks
                polling through their sidecar do); otherwise all its ranks are asked at its moment.
        """
        self.plan_replies, self.plan_left = [], sum(len(r) for _, r in asks)
        self.plan_waiter = self.loop.create_future()
        if self.plan_left == 0:
            return []
        for k, (index, ranks) in enumerate(asks):
            sim = self.sims[index]
            first, rest = (ranks[:1], ranks[1:]) if one_at_a_time else (ranks, [])
            sim.to_ask = list(rest)
            self.loop.call_later(spread * k / len(asks), self._ask_now, sim, first)
        await self.plan_waiter
        return self.plan_replies

    # ------------------------------------------------------------------------------------ commands

    def mark(self) -> dict[str, Any]:
        rtts, self.rtts = self.rtts, []
        return {"t": time.monotonic(), "cpu_s": time.process_time(), **self.counts, "rtts": rtts}

    def lose(self, victim: int) -> None:
        """Silence ``victim`` and start the replacement node (index ``total``) hosting its ranks, empty."""
        sim = self.sims[victim]
        sim.silent = True
        if sim.timer is not None:
            sim.timer.cancel()
        new = _Sim(self.cfg.total, node_name(self.cfg.total, self.cfg.total), self._socket(), list(sim.own), [])
        new.holds = False
        self._add(new)

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        name = cmd["cmd"]
        if name == "mark":
            return {"event": "mark", **self.mark()}
        if name == "freeze":
            self.freeze_at = cmd["at"]
            return {"event": "frozen"}
        if name == "lose":
            self.lose(cmd["victim"])
            return {"event": "lost"}
        if name == "ask_all":
            asks = [(i, list(s.own)) for i, s in self.sims.items() if not s.silent]
            replies = await self.plans(asks, cmd["spread"], True)
            statuses = collections.Counter(r["status"] for r in replies)
            return {"event": "asked", "statuses": statuses, "answered": [r for r in replies if r["status"] != "wait"]}
        if name == "sample":
            by_node: dict[int, list[int]] = {}
            for index, rank in cmd["asks"]:
                by_node.setdefault(index, []).append(rank)
            return {"event": "sampled", "replies": await self.plans(list(by_node.items()), cmd["spread"], False)}
        raise ValueError(f"unknown command {name!r}")


def raise_nofile(need: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit when below ``need`` (children inherit it).

    Raises:
        OSError: the hard limit is below ``need``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise OSError(f"{need} file descriptors needed, the hard limit is {hard}: use more worker processes")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else need, hard))


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    first = json.loads(await reader.readline())
    cfg = FleetConfig(**first["config"])
    raise_nofile(fds_needed(cfg.count + 1))
    fleet = Fleet(cfg, loop)
    try:
        await fleet.start()
        _emit({"event": "ready", "pid": os.getpid()})
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            _emit(await fleet.handle(cmd))
    finally:
        fleet.close()


def main() -> int:
    """Entry point of ``python -m snapshotd.bench.simsidecars`` (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s simsidecars %(levelname)s %(message)s")
    uvloop.run(_serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
