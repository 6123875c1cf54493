"""Simulated sidecars for ``snapshotd-bench scale``: one process drives many over real DEALER sockets.

``python -m snapshotd.bench.simsidecars`` is started by :mod:`snapshotd.bench.scale`. It reads one JSON command
per line on stdin and answers each at once with one JSON event line on stdout (logs go to stderr); nothing here
is pickled. The first command is ``start`` with a :class:`FleetConfig`; the others are ``mark`` (counters),
``freeze`` (training stops), ``lose`` (a sidecar falls silent, a replacement node registers with its ranks),
``ask`` (send plan requests), ``plans`` (the plan replies so far) and ``stop``.

Each simulated sidecar behaves like the real one's control loop (``snapshotd/sidecar/heartbeat.py``): its own DEALER
socket (one TCP connection to the coordinator), register, then heartbeat, wait for the reply (at most
``max(1, 4 * interval)``), wait ``interval``, heartbeat again; ``changed`` and the full ranks and inventory only
when something changed since the last heartbeat the coordinator acknowledged. ``interval`` starts as the
configured one and is replaced by the coordinator's: the registration reply's ``heartbeat_interval`` and every
heartbeat reply's that is not 0 (the coordinator stretches it as the fleet grows). Node ``i`` hosts ranks ``8i .. 8i+7``
of one job (``ranks_per_node`` of them) and holds the buddy copies of node ``i - 1``'s ranks, which is where
the coordinator places them (ring order of the zero-padded names). Steps advance with a clock shared by every
process (``t0``, ``step_seconds``): a node holds its own ranks' steps ``s`` and ``s - 1`` and its buddy ranks'
``s - 1`` and ``s - 2`` while training, both ``s`` and ``s - 1`` once frozen (the streams finish).

Plan requests go out on lasting plan sockets, never on the heartbeat socket: one DEALER per ``_PLAN_SHARE`` sidecars
of the process (the real sidecar has one of its own; sharing keeps the file descriptors of 10,000 simulated sidecars
under the limit, see :func:`plan_sockets`), connected with the first sidecar that uses it (the real sidecar connects
its plan socket at start) and kept until ``stop``. As the real sidecar does when its ranks restore together, a
sidecar asks for all its ranks in one request (``rank`` and ``ranks``) and gets one reply covering them; replies are
matched to requests by ``(job, first rank)``. The coordinator holds a request that must wait until the round is
decided or its hold time passes; a ``wait`` answer makes the sidecar ask again at once, as the real one does, so
every rank is asked for until it gets its plan. For each rank the process records when it was first asked for and
when its final (not ``wait``) answer came, on ``time.monotonic()``, the clock every process shares: the moment the
reply is read off the socket, before it is decoded (the full decode, with every check, runs when the replies are
reported). Replies are matched to their requests (a decode each) when a ``wait`` comes, or once as many have been
read as requests are unanswered: the bench's progress polls (``plans``) must not spend the cores on decoding while
the replies they time are still being read.

No coroutine per sidecar: each socket's ZMQ_FD is an event-loop reader and every wait is a loop timer, so one
core drives thousands. Heartbeats are packed by :class:`snapshotd.proto.FramePacker` (see :class:`HeartbeatFrames`):
what stays the same for a sidecar (its name, its ranks) is packed once, its inventory at each heartbeat straight
from its wire form, without building a message or its records. Replies are read with msgpack for the few fields
a simulated sidecar acts on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import resource
import sys
import time
from typing import Any, cast

import msgpack
import uvloop
import zmq

from snapshotd import security
from snapshotd.proto import FramePacker, Heartbeat, PlanReply, PlanRequest, RegisterSidecar, decode, encode

__all__ = [
    "FleetConfig",
    "HeartbeatFrames",
    "data_addr",
    "fds_needed",
    "main",
    "node_name",
    "plan_sockets",
    "raise_nofile",
]

log = logging.getLogger(__name__)

_CONNECT_BATCH = (
    100  # sockets connected per 0.1 s while ramping up: a gentle start, inside the listen backlog
)
_FDS_PER_SOCKET = 2  # the TCP connection and the socket's mailbox (an eventfd)
_PLAN_SHARE = 4  # simulated sidecars of a process that share one plan socket
# in a plan reply's header exactly when it says ``wait``
_WAIT = msgpack.packb("status") + msgpack.packb("wait")


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
    snapshot_bytes: int = 1 << 30
    """Bytes one rank's snapshot adds to the reported byte counters per step (the coordinator's rate path)."""


def plan_sockets(sidecars: int) -> int:
    """Plan sockets a process driving ``sidecars`` opens at most (one per ``_PLAN_SHARE``, the replacement's)."""
    return -(-sidecars // _PLAN_SHARE) + 1


def fds_needed(sidecars: int) -> int:
    """File descriptors a simulator process driving ``sidecars`` may need (its heartbeat and plan sockets)."""
    return _FDS_PER_SOCKET * (sidecars + plan_sockets(sidecars)) + 256


def node_name(index: int, total: int) -> str:
    """``sim-00042``: zero-padded so that the coordinator's ring (sorted names) is numeric order."""
    return f"sim-{index:0{len(str(total))}d}"


def data_addr(index: int) -> str:
    """The data-plane address sidecar ``index`` registers (nothing listens there)."""
    return f"tcp://10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}:7071"


class HeartbeatFrames:
    """Frame 0 of simulated sidecars' heartbeats, from pieces packed by :class:`~snapshotd.proto.FramePacker`.

    Each frame is ``encode(heartbeat)[0]`` of the :class:`~snapshotd.proto.Heartbeat` it stands for, after the same
    checks.
    """

    def __init__(self) -> None:
        self._packer = FramePacker(Heartbeat)
        self._no_ranks = self._packer.piece("ranks", [])
        self._no_inventory = self._packer.piece("inventory", [])
        self._changed = {flag: self._packer.piece("changed", flag) for flag in (False, True)}

    def sidecar(self, node: str, incarnation: str, ranks: list[list[Any]]) -> dict[str, bytes]:
        """The pieces that stay the same for one sidecar.

        Args:
            ranks: ``[job, rank, world_size, pid, alive]`` per rank (the wire form of ``RankInfo``).
        """
        piece = self._packer.piece
        return {
            "node": piece("node", node),
            "incarnation": piece("incarnation", incarnation),
            "ranks": piece("ranks", ranks),
        }

    def frame(
        self,
        fixed: dict[str, bytes],
        changed: bool,
        inventory: list[list[Any]],
        bytes_out: int,
        bytes_in: int,
        stored_bytes: int,
    ) -> bytes:
        """A heartbeat of the sidecar of ``fixed`` (see :meth:`sidecar`): its ranks and ``inventory`` with
        ``changed``, neither without.

        Args:
            inventory: ``[job, rank, step, local]`` per snapshot (the wire form of ``InventoryItem``).
        """
        piece = self._packer.piece
        return self._packer.frame(
            {
                "node": fixed["node"],
                "incarnation": fixed["incarnation"],
                "changed": self._changed[changed],
                "ranks": fixed["ranks"] if changed else self._no_ranks,
                "inventory": piece("inventory", inventory) if changed else self._no_inventory,
                "bytes_out": piece("bytes_out", bytes_out),
                "bytes_in": piece("bytes_in", bytes_in),
                "stored_bytes": piece("stored_bytes", stored_bytes),
            }
        )


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


@dataclasses.dataclass(slots=True, eq=False)
class _Sim:
    index: int
    sock: zmq.Socket[bytes]
    own: list[int]  # ranks it hosts
    backed: list[int]  # ranks whose buddy copies it holds
    interval: float  # the heartbeat interval it uses now (the coordinator's, once told)
    holds: bool = True  # False: a fresh node, no snapshots at all
    registered: bool = False
    silent: bool = False
    up: bool = False  # the coordinator answered one of its heartbeats
    timer: asyncio.TimerHandle | None = None
    hb_sent: float | None = None  # when the outstanding heartbeat left; None: none outstanding
    state: tuple[int, bool] = (-1, False)  # (step, frozen) of the last heartbeat sent
    acked: tuple[int, bool] | None = None  # ... of the last one a known reply acknowledged
    last_reply: bytes = b""
    pieces: dict[str, bytes] = dataclasses.field(default_factory=dict)  # see HeartbeatFrames.sidecar


class Fleet:
    """The sidecars of one process and their counters. Every method runs on the event loop's thread."""

    def __init__(self, cfg: FleetConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.cfg = cfg
        self.loop = loop
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, cfg.count + plan_sockets(cfg.count) + 64)
        self.secret = security.secret_from_env()
        self.world = cfg.total * cfg.ranks_per_node
        self.sims: dict[int, _Sim] = {}
        self.freeze_at = float("inf")
        self.counts = dict.fromkeys(
            (
                "hb_sent",
                "hb_replies",
                "changed_sent",
                "timeouts",
                "stale",
                "reregistered",
                "tasks",
                "errors",
                "up",
                "plan_waits",
            ),
            0,
        )
        self.rtts: list[float] = []
        self.frames = HeartbeatFrames()
        self.plan_socks: dict[int, zmq.Socket[bytes]] = {}  # sidecar index // _PLAN_SHARE -> its plan socket
        # (job, first rank) -> (node, ranks)
        self.asked: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
        self.first: list[float] = []  # when each rank of the round was first asked for
        # (node, answered at, reply header) of final answers
        self.answers: list[tuple[int, float, bytes]] = []
        self.received = 0  # ranks answered
        self.unread: list[tuple[float, bytes]] = []  # (read at, header) of plan replies not looked at yet
        self._ramp: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Connect and register every sidecar, ``_CONNECT_BATCH`` every 0.1 s, in a task of the loop."""
        self._ramp = self.loop.create_task(self._connect_all())

    async def _connect_all(self) -> None:
        cfg = self.cfg
        for k, i in enumerate(range(cfg.first, cfg.first + cfg.count)):
            prev = (i - 1) % cfg.total
            own = list(range(i * cfg.ranks_per_node, (i + 1) * cfg.ranks_per_node))
            backed = list(range(prev * cfg.ranks_per_node, (prev + 1) * cfg.ranks_per_node))
            self._add(_Sim(i, self._socket(), own, backed, cfg.interval))
            if k % _CONNECT_BATCH == _CONNECT_BATCH - 1:
                await asyncio.sleep(0.1)

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        security.secure_client(sock, self.secret)
        sock.connect(self.cfg.coordinator)
        return sock

    def _add(self, sim: _Sim) -> None:
        cfg = self.cfg
        ranks = [[cfg.job, r, self.world, 100_000 + r, True] for r in sim.own]
        sim.pieces = self.frames.sidecar(node_name(sim.index, cfg.total), "1", ranks)
        self.sims[sim.index] = sim
        self.loop.add_reader(sim.sock.fileno(), self._drain, sim.sock, sim)
        if sim.index // _PLAN_SHARE not in self.plan_socks:
            plan = self.plan_socks[sim.index // _PLAN_SHARE] = self._socket()
            self.loop.add_reader(plan.fileno(), self._drain_plans, plan)
        self._register(sim)

    def close(self) -> None:
        if self._ramp is not None:
            self._ramp.cancel()
        for sock in self.plan_socks.values():
            self.loop.remove_reader(sock.fileno())
            sock.close(linger=0)
        for sim in self.sims.values():
            if sim.timer is not None:
                sim.timer.cancel()
            self.loop.remove_reader(sim.sock.fileno())
            sim.sock.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------------------------ heartbeats

    def _send(self, sock: zmq.Socket[bytes], sim: _Sim, frames: list[Any]) -> None:
        sock.send_multipart(frames, zmq.NOBLOCK)
        if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # the send may have eaten the FD's wake-up
            self._drain(sock, sim)

    def _arm(self, sim: _Sim, delay: float, fn: Any) -> None:
        if sim.timer is not None:
            sim.timer.cancel()
        sim.timer = self.loop.call_later(delay, fn, sim)

    def _register(self, sim: _Sim) -> None:
        sim.registered, sim.hb_sent = False, None
        name = node_name(sim.index, self.cfg.total)
        self._send(
            sim.sock, sim, encode(RegisterSidecar(node=name, data_addr=data_addr(sim.index), incarnation="1"))
        )
        self._arm(sim, _reply_timeout(sim), self._register)

    def _beat(self, sim: _Sim) -> None:
        if sim.silent:
            return
        now = time.monotonic()
        cfg = self.cfg
        step = 1 + max(0, int((min(now, self.freeze_at) - cfg.t0) / cfg.step_seconds))
        frozen = now >= self.freeze_at
        changed = (step, frozen) != sim.acked
        inventory: list[list[Any]] = []
        if changed:
            job = cfg.job
            if sim.holds:
                mine = [s for s in (step, step - 1) if s >= 1]
                theirs = mine if frozen else [s for s in (step - 1, step - 2) if s >= 1]
                inventory = [[job, r, s, True] for r in sim.own for s in mine]
                inventory += [[job, r, s, False] for r in sim.backed for s in theirs]
            self.counts["changed_sent"] += 1
        nbytes = cfg.snapshot_bytes * step
        header = self.frames.frame(
            sim.pieces,
            changed,
            inventory,
            nbytes * len(sim.own),
            nbytes * len(sim.backed),
            2 * cfg.snapshot_bytes * len(sim.backed),
        )
        sim.state, sim.hb_sent = (step, frozen), now
        self.counts["hb_sent"] += 1
        self._arm(sim, _reply_timeout(sim), self._timed_out)
        self._send(sim.sock, sim, [header])

    def _timed_out(self, sim: _Sim) -> None:
        """No reply within the reply timeout: as the real sidecar, wait an interval and heartbeat again."""
        self.counts["timeouts"] += 1
        sim.hb_sent = None
        self._arm(sim, sim.interval, self._beat)

    def _drain(self, sock: zmq.Socket[bytes], sim: _Sim) -> None:
        while True:
            try:
                head = sock.recv_multipart(zmq.NOBLOCK)[0]
            except zmq.Again:
                return
            if head == sim.last_reply:  # the same heartbeat reply as last time
                self._hb_reply(sim, True, 0)
                continue
            msg = msgpack.unpackb(head, raw=False)
            kind = msg.get("type")
            if kind == "heartbeat_reply":
                ntasks = len(msg.get("tasks", ()))
                sim.last_reply = head if msg.get("known") and not ntasks else b""
                sim.interval = float(msg.get("heartbeat_interval") or sim.interval)  # 0 or absent: keep it
                self._hb_reply(sim, bool(msg.get("known")), ntasks)
            elif kind == "sidecar_registered":
                if not sim.registered:
                    sim.registered, sim.acked = True, None
                    sim.interval = float(msg["heartbeat_interval"])
                    first = sim.state[0] < 0  # spread the first heartbeats over an interval
                    self._arm(sim, sim.interval * ((sim.index * 0.618) % 1.0) if first else 0.0, self._beat)
            else:
                self.counts["errors"] += 1
                if self.counts["errors"] == 1:
                    log.warning("unexpected %s: %s", kind, msg.get("message", ""))

    def _hb_reply(self, sim: _Sim, known: bool, ntasks: int) -> None:
        """Count every heartbeat the coordinator answered (late ones too: it handled them); act on timely ones."""
        self.counts["hb_replies"] += 1
        if not sim.up:
            sim.up = True
            self.counts["up"] += 1
        if sim.hb_sent is None:  # the answer to a heartbeat that already timed out
            self.counts["stale"] += 1
            return
        self.rtts.append(round((time.monotonic() - sim.hb_sent) * 1e3, 3))
        self.counts["tasks"] += ntasks
        sim.hb_sent = None
        if not known:
            self.counts["reregistered"] += 1
            self._register(sim)
            return
        sim.acked = sim.state
        self._arm(sim, sim.interval, self._beat)

    # ------------------------------------------------------------------------------------ plans

    def ask(self, asks: list[tuple[int, list[int]]], spread: float) -> int:
        """Start a plan round: sidecar ``index`` asks for all its ``ranks`` at ``spread * k / len(asks)`` s.

        Requests of an earlier round still unanswered are forgotten (their late replies count as stale).
        Returns the number of ranks asked for.
        """
        self.asked.clear()
        self._read_plans()  # late replies of an earlier round: stale
        self.first, self.answers, self.received = [], [], 0
        for k, (index, ranks) in enumerate(asks):
            self.loop.call_later(spread * k / len(asks), self._ask_first, index, tuple(ranks))
        return sum(len(r) for _, r in asks)

    def _ask_first(self, index: int, ranks: tuple[int, ...]) -> None:
        self.asked[(self.cfg.job, ranks[0])] = (index, ranks)
        self.first.extend([time.monotonic()] * len(ranks))
        self._ask(index, ranks)

    def _ask(self, index: int, ranks: tuple[int, ...]) -> None:
        sock = self.plan_socks[index // _PLAN_SHARE]
        msg = PlanRequest(
            job=self.cfg.job,
            rank=ranks[0],
            world_size=self.world,
            node=node_name(index, self.cfg.total),
            ranks=ranks[1:],
        )
        sock.send_multipart(encode(msg), zmq.NOBLOCK)
        if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # the send may have eaten the FD's wake-up
            self._drain_plans(sock)

    def _drain_plans(self, sock: zmq.Socket[bytes]) -> None:
        """Read every reply waiting on a plan socket, each timed as it is read; only ``wait`` ones are looked at
        now (the others when the replies are counted, so that reading a burst of them costs little)."""
        while True:
            try:
                head = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.unread.append((time.monotonic(), head))
            if _WAIT in head:
                self._read_plans()

    def _read_plans(self) -> None:
        """Match the replies read so far to their requests; ask again at once for those answered ``wait``."""
        unread, self.unread = self.unread, []
        for at, head in unread:
            msg = msgpack.unpackb(head, raw=False)
            asked = self.asked.get((msg.get("job"), msg.get("rank")))
            if msg.get("type") != "plan_reply":
                self.counts["errors"] += 1
                if self.counts["errors"] == 1:
                    log.warning("unexpected %s: %s", msg.get("type"), msg.get("message", ""))
            elif asked is None:
                self.counts["stale"] += 1
            elif msg["status"] == "wait":  # held for the hold time and not decided yet: ask again at once
                self.counts["plan_waits"] += 1
                self.loop.call_soon(self._ask, *asked)  # not inside the socket's drain
            else:
                del self.asked[(msg["job"], msg["rank"])]
                self.answers.append((asked[0], at, head))
                self.received += len(asked[1])

    def _replies(self) -> list[list[Any]]:
        """Every rank's final answer, decoded and checked: [node, rank, answered at, status, step, local, sources]."""
        out: list[list[Any]] = []
        for index, at, head in self.answers:
            reply = decode([head])
            assert isinstance(reply, PlanReply)
            out += [[index, p.rank, at, p.status, p.step, p.local, list(p.sources)] for p in reply.answers()]
        return out

    # ------------------------------------------------------------------------------------ commands

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Answer one command (see the module docstring) at once."""
        name = cmd["cmd"]
        if name == "mark":
            rtts, self.rtts = self.rtts, []
            rate = sum(1.0 / s.interval for s in self.sims.values() if not s.silent)  # heartbeats/s expected
            return {
                "event": "mark",
                "t": time.monotonic(),
                "cpu_s": time.process_time(),
                **self.counts,
                "rtts": rtts,
                "rate": rate,
            }
        if name == "freeze":
            self.freeze_at = cmd["at"]
            return {"event": "frozen"}
        # silence the victim; the replacement (index total) hosts its ranks and holds nothing
        if name == "lose":
            victim = self.sims[cmd["victim"]]
            victim.silent = True
            if victim.timer is not None:
                victim.timer.cancel()
            self._add(
                _Sim(self.cfg.total, self._socket(), list(victim.own), [], self.cfg.interval, holds=False)
            )
            return {"event": "lost"}
        if name == "ask":  # every live sidecar (the replacement too) asks for all its ranks
            asks = [(i, list(s.own)) for i, s in self.sims.items() if not s.silent]
            return {"event": "asking", "requests": self.ask(asks, cmd["spread"])}
        # matching costs a decode per reply: while replies are still coming, only at the end
        if name == "plans":
            if cmd.get("replies") or len(self.unread) >= len(self.asked):
                self._read_plans()
            out: dict[str, Any] = {
                "event": "plans",
                "received": self.received,
                "left": sum(len(ranks) for _, ranks in self.asked.values()),
                "first_min": min(self.first, default=None),
                "first_max": max(self.first, default=None),
            }
            if cmd.get("replies"):
                out["replies"] = self._replies()
            return out
        raise ValueError(f"unknown command {name!r}")


def _reply_timeout(sim: _Sim) -> float:
    """How long a sidecar waits for the coordinator's answer, as the real one: ``max(1, 4 * interval)``."""
    return max(1.0, 4 * sim.interval)


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    cfg = FleetConfig(**json.loads(await reader.readline())["config"])
    raise_nofile(fds_needed(cfg.count + 1))
    fleet = Fleet(cfg, loop)
    try:
        fleet.start()
        _emit({"event": "started"})
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            _emit(fleet.handle(cmd))
    finally:
        fleet.close()


def main() -> int:
    """Entry point of ``python -m snapshotd.bench.simsidecars`` (see the module docstring).

    The process lowers its own priority (nice 10), so that on a small machine the coordinator it measures gets
    the cores it needs first, as it would on its own host.
    """
    os.nice(10)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s simsidecars %(levelname)s %(message)s")
    uvloop.run(_serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
