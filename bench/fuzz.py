"""Live fuzzing: random and mutated messages at each socket of running daemons, and what must hold after.

``snapshotd-bench fuzz`` starts a coordinator and two sidecars (nodes A and B) on loopback, and a job of two ranks
(rank 0 on A, rank 1 on B, in this process) that snapshots a few steps. Then it sends ``--messages`` messages to
each of the coordinator's control socket, A's data socket and A's ipc socket, from a ZeroMQ DEALER (what that
socket's peers use). The messages come from :class:`Mutator` (``--seed``, printed):

- valid messages of every type, each field drawn from its spec (range edges included);
- the same with a field given a hostile value (another type, out of range, a huge string), removed, or an
  unknown one added, or with a wrong version or type name;
- with a frame dropped, the header cut short, frames added, or a payload of another length;
- raw random bytes;
- replays of earlier messages, so duplicated and out of order.

Names are drawn from the fuzzer's own small pools (jobs, nodes, addresses), never the running job's: a peer
holding the job's secret is trusted with that job; what no message may do is end, wedge or bloat a daemon, or
touch a job that is not its own.

After each socket: every daemon alive and answering within ``--answer-timeout`` (a status document from the
coordinator, once the nodes the fuzz registered have fallen silent and been declared dead; from A's data plane
a pull manifest of a copy it holds; through A's ipc a new snapshot made durable within three steps, as one
streaming to a buddy the fuzz made up fails), and each daemon's RSS grown by less than ``--rss-bound``. At the end both ranks restart, restore and
get their last snapshot bit for bit, and a new snapshot becomes durable. The report's ``passed`` is False (and
``snapshotd-bench`` exits 1) when anything of that failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import random
import time
import uuid
from collections import deque
from typing import Any

import msgpack
import torch
import zmq

from snapshotd.client import Snapshotter
from snapshotd.harness.cluster import LocalCluster, ManagedProcess
from snapshotd.proto import MESSAGE_TYPES, PullManifest, StreamBegin, decode, encode
from snapshotd.proto.compound import ListOf, Record
from snapshotd.proto.limits import PROTOCOL_VERSION
from snapshotd.proto.schema import Bool, Bytes, Enum, Float, Frame, Int, Opt, Spec, Str
from snapshotd.status import fetch_status

from .report import Report, scratch_dir

__all__ = ["SOCKETS", "Mutator", "add_arguments", "run"]

SOCKETS = ("data", "ipc", "control")
"""The sockets fuzzed: sidecar A's data and ipc sockets, the coordinator's control socket."""

_HOSTILE: tuple[Any, ...] = (
    None,
    True,
    -1,
    0,
    1 << 31,
    (1 << 63) - 1,
    (1 << 64) - 1,
    -(1 << 63),
    1.5,
    math.nan,
    math.inf,
    "",
    "x" * 300,
    "y" * 70_000,
    b"\x00" * 16,
    [],
    [[1, 2], "a"],
    {"k": 1},
    {},
)
"""Values a hostile peer puts where a field belongs."""


class Mutator:
    """Draws the fuzz messages (see the module docstring): each a list of frames, from ``seed``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.jobs = [f"fuzz-{i}" for i in range(6)]
        self.names = [*self.jobs, "fuzz-node-0", "fuzz-node-1", "tcp://127.0.0.1:9", "ipc:///tmp/none"]
        self.types = sorted(MESSAGE_TYPES)
        self.sent: deque[list[bytes]] = deque(maxlen=256)

    def message(self) -> list[bytes]:
        r = self.rng.random()
        if r < 0.10 and self.sent:
            frames = self.rng.choice(self.sent)  # a replay
        elif r < 0.35:
            frames = self._valid()
        elif r < 0.80:
            frames = self._mutated()
        elif r < 0.92:
            frames = self._reshaped()
        else:
            frames = [self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(self.rng.randint(1, 3))]
        self.sent.append(frames)
        return frames

    def _header(self) -> tuple[dict[str, Any], list[bytes]]:
        name = self.rng.choice(self.types)
        header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": name}
        frames: list[bytes] = []
        for f in dataclasses.fields(MESSAGE_TYPES[name]):
            spec = f.metadata["spec"]
            if isinstance(spec, Frame):
                frames.append(self.rng.randbytes(self.rng.choice((0, 1, 17, 4096, 65536))))
            elif f.name == "job":
                header["job"] = self.rng.choice(self.jobs)
            else:
                header[f.name] = self.value(spec)
        return header, frames

    def _pack(self, header: dict[str, Any], frames: list[bytes]) -> list[bytes]:
        return [msgpack.packb(header, use_bin_type=True), *frames]

    def _valid(self) -> list[bytes]:
        return self._pack(*self._header())

    def _mutated(self) -> list[bytes]:
        header, frames = self._header()
        keys = [k for k in header if k not in ("v", "type")] or ["job"]
        kind = self.rng.randrange(6)
        if kind == 0:
            header[self.rng.choice(keys)] = self.rng.choice(_HOSTILE)
        elif kind == 1:
            header.pop(self.rng.choice(keys), None)
        elif kind == 2:
            header[self.rng.choice(("extra", "x" * 64, "v2"))] = self.rng.choice(_HOSTILE)
        elif kind == 3:
            header["v"] = self.rng.choice((0, PROTOCOL_VERSION + 1, 99, str(PROTOCOL_VERSION), None))
        elif kind == 4:
            header["type"] = self.rng.choice((*self.types, "nope", "", 7))
        else:
            key = self.rng.choice(keys)
            header[key] = self.value_of_other_field()
        return self._pack(header, frames)

    def _reshaped(self) -> list[bytes]:
        frames = self._valid()
        kind = self.rng.randrange(4)
        if kind == 0 and len(frames) > 1:
            frames = frames[:-1]
        elif kind == 1:
            frames = [frames[0][: self.rng.randrange(max(1, len(frames[0])))], *frames[1:]]
        elif kind == 2:
            frames = [
                *frames,
                *(self.rng.randbytes(self.rng.randint(0, 32)) for _ in range(self.rng.randint(1, 3))),
            ]
        elif len(frames) > 1:
            frames = [frames[0], *(self.rng.randbytes(self.rng.randint(0, 8192)) for _ in frames[1:])]
        return frames

    def value_of_other_field(self) -> Any:
        """A value valid for some other field of some message (right type, wrong place)."""
        cls = MESSAGE_TYPES[self.rng.choice(self.types)]
        specs = [
            f.metadata["spec"] for f in dataclasses.fields(cls) if not isinstance(f.metadata["spec"], Frame)
        ]
        return self.value(self.rng.choice(specs))

    def value(self, spec: Spec, depth: int = 0) -> Any:
        """A value that ``spec`` accepts, range edges included."""
        rng = self.rng
        if isinstance(spec, Int):
            return rng.choice(
                (
                    spec.lo,
                    spec.hi,
                    spec.lo + 1,
                    rng.randint(spec.lo, min(spec.hi, spec.lo + 64)),
                    rng.randint(spec.lo, spec.hi),
                )
            )
        if isinstance(spec, Float):
            return rng.choice((spec.lo, spec.hi, rng.uniform(spec.lo, min(spec.hi, 10.0))))
        if isinstance(spec, Bool):
            return rng.random() < 0.5
        if isinstance(spec, Str):
            return rng.choice((rng.choice(self.names), "", "z" * spec.max_len))[: spec.max_len]
        if isinstance(spec, Bytes):
            return rng.randbytes(rng.randint(0, min(spec.max_len, 64)))
        if isinstance(spec, Enum):
            return rng.choice(spec.values)
        if isinstance(spec, Opt):
            return None if rng.random() < 0.3 else self.value(spec.inner, depth)
        if isinstance(spec, ListOf):
            return [self.value(spec.item, depth + 1) for _ in range(rng.randint(0, 3 if depth < 2 else 0))]
        if isinstance(spec, Record):
            return [self.value(s, depth + 1) for _, s in spec.fields]
        return rng.choice(_HOSTILE)


@dataclasses.dataclass(slots=True)
class _Job:
    """The running job: rank 0 on node A, rank 1 on node B, in this process."""

    name: str
    ipcs: tuple[str, str]
    states: list[dict[str, torch.Tensor]]
    snaps: list[Snapshotter]
    step: int = 0

    @classmethod
    def start(cls, cluster: LocalCluster, ipcs: tuple[str, str], timeout: float) -> _Job:
        name = f"fuzzed-{uuid.uuid4().hex[:6]}"
        states = [{"w": torch.randn(200_000, generator=torch.Generator().manual_seed(r))} for r in (0, 1)]
        snaps = [
            Snapshotter(
                states[r], job=name, rank=r, world_size=2, sidecar=ipcs[r], timeout=timeout, when_busy="block"
            )
            for r in (0, 1)
        ]
        job = cls(name, ipcs, states, snaps)
        assert job.restore_all(timeout) == [0, 0]
        for _ in range(3):
            if not job.snapshot(timeout):
                raise RuntimeError(f"the job's snapshots did not become durable: {[s.stats for s in snaps]}")
        return job

    def restore_all(self, timeout: float) -> list[int]:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda s: s.restore(timeout=timeout), self.snaps))

    def snapshot(self, timeout: float) -> bool:
        """Both ranks take a step and snapshot it; whether both became durable within ``timeout``."""
        self.step += 1
        for state in self.states:
            state["w"].add_(1.0)
        for snap in self.snaps:
            snap.capture(self.step)
        return all(snap.wait(timeout) for snap in self.snaps)

    def restart_and_restore(self, timeout: float) -> bool:
        """Both ranks crash and restart: whether each restored its last snapshot bit for bit."""
        for snap in self.snaps:
            snap.close(unregister=False)
        expected = [state["w"].clone() for state in self.states]
        for state in self.states:
            state["w"].zero_()
        self.snaps = [
            Snapshotter(
                self.states[r],
                job=self.name,
                rank=r,
                world_size=2,
                sidecar=self.ipcs[r],
                timeout=timeout,
                when_busy="block",
            )
            for r in (0, 1)
        ]
        steps = self.restore_all(timeout)
        return steps == [self.step] * 2 and all(
            torch.equal(s["w"], e) for s, e in zip(self.states, expected, strict=True)
        )

    def close(self) -> None:
        for snap in self.snaps:
            snap.close()


def _status(coordinator: str, timeout: float) -> dict[str, Any]:
    """The coordinator's status document, asked again while it is busy, for at most ``timeout`` seconds.

    Raises:
        TimeoutError: no document within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fetch_status(coordinator, secret=None, timeout=max(0.1, deadline - time.monotonic()))
        except RuntimeError as exc:  # busy: it builds the documents that the fuzz asked for first
            if "busy" not in str(exc) or time.monotonic() > deadline:
                raise TimeoutError(f"no status document within {timeout:.0f} s: {exc}") from exc
            time.sleep(0.2)


def _fakes_alive(status: dict[str, Any]) -> bool:
    """Whether a node the fuzz registered is still alive to the coordinator."""
    return any(n["alive"] and n["node"] not in _REAL for n in status["nodes"])


_REAL = ("real-A", "real-B")
"""The real sidecars' node names (the fuzz's own names never take these)."""


def _rss(proc: ManagedProcess) -> int:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _fire(ctx: zmq.Context, endpoint: str, mutator: Mutator, count: int, timeout: float) -> tuple[float, int]:
    """Send ``count`` fuzz messages to ``endpoint``, reading replies as they come; seconds taken and replies.

    Raises:
        TimeoutError: the socket took no message for ``timeout`` seconds (the daemon wedged).
    """
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 10_000
    sock.connect(endpoint)
    replies = 0
    t0 = time.monotonic()
    try:
        for i in range(count):
            frames = mutator.message()
            while True:
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if not sock.poll(int(timeout * 1000), zmq.POLLIN | zmq.POLLOUT):
                        raise TimeoutError(f"{endpoint} took no message for {timeout:.0f} s") from None
                    replies += _drain(sock)
            if i % 256 == 0:
                replies += _drain(sock)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and sock.poll(100):
            replies += _drain(sock)
    finally:
        sock.close()
    return time.monotonic() - t0, replies


def _drain(sock: zmq.Socket) -> int:
    got = 0
    while True:
        try:
            sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return got
        got += 1


def _manifest_seconds(
    ctx: zmq.Context, endpoint: str, job: str, rank: int, step: int, timeout: float
) -> float:
    """Seconds for the sidecar at ``endpoint`` to describe a copy it holds.

    Raises:
        TimeoutError, RuntimeError: no answer in time, or not the description.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        t0 = time.monotonic()
        sock.send_multipart(encode(PullManifest(job=job, rank=rank, step=step)))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"{endpoint} did not describe a held copy within {timeout:.0f} s")
        reply = decode(sock.recv_multipart())
        if not isinstance(reply, StreamBegin):
            raise RuntimeError(f"{endpoint} answered {reply}")
        return time.monotonic() - t0
    finally:
        sock.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", type=int, default=1_000_000, help="messages per socket (default 1,000,000)")
    p.add_argument("--seed", type=int, default=None, help="the mutator's seed (default: drawn and printed)")
    p.add_argument(
        "--answer-timeout",
        type=float,
        default=10.0,
        help="seconds a daemon may take to answer after the fuzz (default 10)",
    )
    p.add_argument(
        "--rss-bound",
        type=float,
        default=256.0,
        help="MiB each daemon's RSS may grow by over one socket's fuzz (default 256)",
    )
    p.add_argument(
        "--sockets",
        default=",".join(SOCKETS),
        help=f"comma list of the sockets to fuzz, in order (default {','.join(SOCKETS)})",
    )
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")


def run(args: argparse.Namespace) -> Report:
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    print(f"snapshotd-bench fuzz: seed {seed}", flush=True)
    mutator = Mutator(seed)
    timeout = args.answer_timeout
    rows: list[dict[str, Any]] = []
    with (
        scratch_dir(args.workdir, prefix="snapshotd-fuzz-") as workdir,
        LocalCluster(workdir, replicas=1) as cluster,
    ):
        coordinator = cluster.start_coordinator()
        daemons = {
            "coordinator": coordinator,
            "A": cluster.start_sidecar(_REAL[0]),
            "B": cluster.start_sidecar(_REAL[1]),
        }
        job = _Job.start(cluster, (cluster.ipc_path(_REAL[0]), cluster.ipc_path(_REAL[1])), timeout)
        ctx = zmq.Context()
        endpoints = {
            "data": daemons["A"].fields["data"],
            "ipc": f"ipc://{cluster.ipc_path(_REAL[0])}",
            "control": cluster.coordinator_addr,
        }
        targets = {name: endpoints[name] for name in args.sockets.split(",")}
        try:
            for socket_name, endpoint in targets.items():
                before = {name: _rss(p) for name, p in daemons.items()}
                seconds, replies = _fire(ctx, endpoint, mutator, args.messages, timeout)
                alive = all(p.alive() for p in daemons.values())
                row: dict[str, Any] = {
                    "socket": socket_name,
                    "messages": args.messages,
                    "seconds": seconds,
                    "msg_rate": args.messages / seconds,
                    "replies": replies,
                    "alive": alive,
                }
                if alive:
                    t0 = time.monotonic()
                    status = _status(cluster.coordinator_addr, timeout)
                    row["status_s"] = time.monotonic() - t0
                    # nodes the fuzz registered fall silent: wait until they are dead
                    if socket_name == "control":
                        deadline = time.monotonic() + status["coordinator"]["heartbeat_timeout"] + timeout
                        while _fakes_alive(status) and time.monotonic() < deadline:
                            time.sleep(0.2)
                            status = _status(cluster.coordinator_addr, timeout)
                    row["nodes_alive"] = sum(1 for n in status["nodes"] if n["alive"])
                    try:
                        row["manifest_s"] = _manifest_seconds(
                            ctx, daemons["A"].fields["data"], job.name, 1, job.step, timeout
                        )
                    except (TimeoutError, RuntimeError) as exc:
                        print(f"snapshotd-bench fuzz: after the {socket_name} socket: {exc}", flush=True)
                        row["manifest_s"] = None
                    # a snapshot streaming to a buddy the fuzz made up fails: the next goes on
                    t0 = time.monotonic()
                    row["snapshots_to_durable"] = next(
                        (i for i in range(1, 4) if job.snapshot(timeout)), None
                    )
                    row["durable"] = row["snapshots_to_durable"] is not None
                    row["snapshot_s"] = time.monotonic() - t0
                    growth = {name: _rss(p) - before[name] for name, p in daemons.items()}
                    row["rss_growth_MiB"] = max(growth.values()) / 2**20
                    row["rss_MiB"] = max(_rss(p) for p in daemons.values()) / 2**20
                rows.append(row)
                if not alive:
                    break
            restored = all(r["alive"] for r in rows) and job.restart_and_restore(timeout)
            durable_after = restored and job.snapshot(timeout)
        finally:
            ctx.destroy(linger=0)
            job.close()
    rss_growth = max((r.get("rss_growth_MiB", math.inf) for r in rows), default=math.inf)
    passed = (
        len(rows) == len(targets)
        and all(
            r["alive"] and r["nodes_alive"] == 2 and r["manifest_s"] is not None and r["durable"]
            for r in rows
        )
        and rss_growth < args.rss_bound
        and restored
        and durable_after
    )
    summary = {
        "seed": seed,
        "messages_per_socket": args.messages,
        "daemons_alive": all(r["alive"] for r in rows),
        "max_rss_growth_MiB": rss_growth,
        "restore_bit_identical": restored,
        "durable_after": durable_after,
        "passed": passed,
    }
    return Report(
        "fuzz",
        {"messages": args.messages, "seed": seed, "answer_timeout": timeout, "rss_bound_MiB": args.rss_bound},
        rows,
        summary,
        passed=passed,
    )
