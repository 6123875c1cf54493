"""``snapshotd-bench scale``: one real coordinator against thousands of simulated sidecars.

For each N of ``--sidecars`` (default 100, 1,000 and 10,000 in turn): a real ``snapshotd coordinator`` process
(:class:`~snapshotd.harness.cluster.LocalCluster`, heartbeat interval 0.5 s and timeout 3 s by default) and
``--workers`` processes of :mod:`.simsidecars` (at nice 10, 4 by default) that drive N simulated sidecars between
them. A simulator reads its sidecars' plan replies one after another, and that reading counts in the plan latency
below; on 2 cores four simulators measured the 10,000-sidecar round with less of their own queueing than two, and
more than four only added contention (the README has the runs). Each
simulated sidecar has its own heartbeat DEALER socket, so the coordinator sees N heartbeat connections as it would
in a real job (it keys nodes by the name in each message, so several could share a socket, but that would hide the
per-connection cost); four share a plan socket, where a real job has one per sidecar. Each registers and
heartbeats as the real sidecar does, and reports 8 ranks (``--ranks-per-node``) of one job of 8N ranks and an
inventory of 32 snapshots that changes every training step (``--step-seconds``, by default
one heartbeat interval: every heartbeat carries its full inventory, the real sidecar's worst case).

1. **Ramp**: every sidecar registers and heartbeats; ``up`` counts those the coordinator answered at least once
   within ``--timeout`` s (``ramp_s``: how long that took), then ``--settle`` s pass.
2. **Window** (``--window`` s): ``heartbeats_per_s`` is heartbeat replies received per second, summed over the
   workers, late ones included (``hb_ratio``: that over the rate the sidecars aim at, the sum of 1 / interval
   over them with the interval each one was given by the coordinator, which stretches it as the fleet grows;
   ``hb_interval_s`` is N over that rate, the interval in effect); ``hb_rtt_*`` the request-to-reply times of the timely ones; ``coordinator_cpu`` the coordinator
   process's utime + stime from ``/proc/PID/stat`` over the window as a fraction of one core (every thread:
   its Python thread, which ``coordinator_py_cpu`` counts alone, and ZeroMQ's I/O thread); ``cpu_per_hb_us``
   that over ``heartbeats_per_s`` (what one heartbeat costs, whatever else runs on the machine);
   ``drivers_cpu`` the simulators' together. Halfway through the window the bench asks for the status document
   once, as an operator's ``snapshotd status`` would (every node and rank: about 6 MB at 10,000 sidecars):
   ``status_ms`` is its round trip, and the heartbeats answered meanwhile count in ``hb_rtt_*``.
3. **Node loss**: training stops (every step freezes; the buddies' streams finish), sidecar N/2 falls silent and
   a replacement node registers hosting its 8 ranks, holding nothing. The bench waits the coordinator's death
   timeout in effect (``coordinator.heartbeat_timeout`` of its status document, stretched like the interval;
   ``death_timeout_s``) plus 0.5 s for it to declare the silent node dead.
4. **Plan round**: every one of the 8N ranks asks for a plan, each sidecar (the replacement for the lost
   node's ranks) asking for its 8 in one request as the real sidecar does, the sidecars spread over one
   heartbeat interval, on plan sockets connected before the round as the real sidecar's are (see
   :mod:`.simsidecars`), while every sidecar keeps heartbeating.
   The coordinator holds each request until the last rank is asked for, which freezes the round, and then
   answers them all, one reply per request; a request held past its hold time gets ``wait`` and its sidecar
   asks again at once. ``freeze_s``: from the first request to the last answer.
5. **Plan latency**, measured in that round: a rank's ``plan_ms`` is the time its answer came (the reply
   covering it was read off the socket) minus the time the last rank was first asked for (the moment the round
   could freeze): the decision, and the wait behind the other answers and the heartbeats queued in the
   coordinator. ``plan_p50_ms``, ``plan_p99_ms`` (``plan_ms_p99``)
   and ``plan_max_ms`` are over every rank (``plan_samples``: 8N), ranks unanswered within ``--timeout`` s
   (``plan_answered`` < ``plan_samples``) counting as infinitely late, which leaves those percentiles empty;
   ``plan_waits`` counts the ``wait`` replies (one per request). ``plan_answer_ms``, from the coordinator's
   status document (its job's ``round``), is the coordinator's own part: from its reading the last rank's
   request (the freeze) to its handing the last answer to ZeroMQ. The rest of ``plan_ms`` is the wait of that
   last request in the queues before it, and the delivery and reading of the answers, all on the same cores
   here.
   Every answer must be ``ready`` at one step, ``local`` exactly for ranks whose node lived, with sources for the
   replacement, never the lost node (``plan_wrong`` counts those that are not). A value that could not be
   measured is empty (null in the JSON) and left out of the plot.

``timeouts`` and ``reregistered`` count heartbeats left unanswered for ``max(1, 4 * interval)`` s and sidecars
told to register again (declared dead while alive), over the whole run: both are 0 when the coordinator keeps up.

``--profile PATH.prof`` runs the coordinator in this process, in a thread under cProfile timing that thread's
CPU (``run_coordinator`` from :mod:`snapshotd.coordinator.server`), and writes ``PATH-N.prof`` per N;
``coordinator_cpu`` then counts that thread alone, profiler overhead included.

Summary: ``sidecars`` (the largest N), and for it ``heartbeats_per_s``, ``coordinator_cpu`` and ``plan_ms_p99``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import logging
import math
import os
import resource
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from snapshotd import security
from snapshotd.harness.cluster import LocalCluster
from snapshotd.status import fetch_status

from .report import Report, save_figure
from .simsidecars import data_addr, fds_needed, node_name, plan_sockets, raise_nofile

__all__ = ["add_arguments", "plot", "run"]

log = logging.getLogger(__name__)

_COLUMNS = [
    "sidecars",
    "ranks",
    "heartbeats_per_s",
    "hb_interval_s",
    "hb_ratio",
    "hb_rtt_p50_ms",
    "hb_rtt_p99_ms",
    "coordinator_cpu",
    "coordinator_py_cpu",
    "cpu_per_hb_us",
    "drivers_cpu",
    "status_ms",
    "up",
    "ramp_s",
    "death_timeout_s",
    "freeze_s",
    "plan_p50_ms",
    "plan_p99_ms",
    "plan_max_ms",
    "plan_answer_ms",
    "plan_samples",
    "plan_answered",
    "plan_wrong",
    "plan_waits",
    "timeouts",
    "reregistered",
]
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_ANSWER_S = 30.0  # a simulator answers every command at once; this long means it is wedged
_POLL_S = 0.25


def _int_list(text: str) -> list[int]:
    values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected integers >= 2 separated by commas, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``scale`` subcommand's flags."""
    parser.add_argument(
        "--sidecars",
        type=_int_list,
        default=[100, 1000, 10000],
        help="simulated sidecars, one run per value (default 100,1000,10000)",
    )
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks each sidecar hosts (default 8)")
    parser.add_argument("--workers", type=int, default=4, help="simulator processes (default 4)")
    parser.add_argument(
        "--window", type=float, default=5.0, help="seconds of measured heartbeats (default 5)"
    )
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds after the ramp before measuring (1)"
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.5,
        help="simulated training step time; inventories change every step (default 0.5)",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds (default 0.5)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds the ramp and each plan phase may take before the run goes on (default 30)",
    )
    parser.add_argument("--profile", metavar="PATH.prof", help="cProfile the coordinator (in a thread here)")


def run(args: argparse.Namespace) -> Report:
    """Run every N of ``args.sidecars`` in turn; see the module docstring for what each row means."""
    results = [asyncio.run(_one(n, args)) for n in args.sidecars]
    top = max(results, key=lambda r: r["sidecars"])
    summary = {
        "sidecars": top["sidecars"],
        "heartbeats_per_s": top["heartbeats_per_s"],
        "coordinator_cpu": top["coordinator_cpu"],
        "plan_ms_p99": top["plan_p99_ms"],
    }
    config = {
        k: getattr(args, k)
        for k in (
            "sidecars",
            "ranks_per_node",
            "workers",
            "window",
            "settle",
            "step_seconds",
            "heartbeat_interval",
            "heartbeat_timeout",
            "profile",
        )
    }
    return Report("scale", config, results, summary, columns=_COLUMNS)


def plot(report: Report, path: str) -> None:
    """Four panels against N (log scale): heartbeats/s beside what keeping up takes, coordinator CPU, heartbeat
    round trips, and plan latency beside the 100 ms goal of issue 6."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted(report.results, key=lambda r: r["sidecars"])
    xs = [r["sidecars"] for r in rows]
    interval = report.config.get("heartbeat_interval", 0.5)

    def points(key: str | None, log_y: bool) -> tuple[list[int], list[float]]:
        """The measured (N, value) pairs: missing, NaN or infinite values (and <= 0 on a log axis) left out."""
        px: list[int] = []
        py: list[float] = []
        for r in rows:
            value = r["sidecars"] / (r.get("hb_interval_s") or interval) if key is None else r.get(key)
            if isinstance(value, int | float) and math.isfinite(value) and (value > 0 or not log_y):
                px.append(r["sidecars"])
                py.append(float(value))
        return px, py

    fig = Figure(figsize=(7.0, 9.0), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle("snapshotd-bench scale: one coordinator, N simulated sidecars")
    axes = fig.subplots(4, 1, sharex=True)
    panels: tuple[tuple[str, list[tuple[str | None, str]], tuple[float, str] | None], ...] = (
        ("heartbeats / s", [("heartbeats_per_s", "answered"), (None, "N / interval (keeping up)")], None),
        (
            "coordinator CPU (cores)",
            [("coordinator_cpu", "process"), ("coordinator_py_cpu", "Python thread")],
            (1.0, "one core"),
        ),
        ("heartbeat round trip (ms)", [("hb_rtt_p50_ms", "p50"), ("hb_rtt_p99_ms", "p99")], None),
        (
            "plan latency (ms)",
            [("plan_p50_ms", "p50"), ("plan_p99_ms", "p99"), ("plan_answer_ms", "the coordinator's part")],
            (100.0, "goal: p99 < 100 ms"),
        ),
    )
    for ax, (label, lines, goal) in zip(axes, panels, strict=True):
        log_y = label != "coordinator CPU (cores)"
        missing = []
        for key, name in lines:
            px, py = points(key, log_y)
            ax.plot(px, py, marker="o" if key else None, linestyle="-" if key else "--", label=name)
            missing += [f"{name}: N={n}" for n in xs if n not in px]
        if missing:
            ax.text(
                0.01, 0.02, "not measured: " + ", ".join(missing), transform=ax.transAxes, fontsize="x-small"
            )
        if goal is not None:
            ax.axhline(goal[0], color="tab:red", linewidth=0.8, linestyle=":", label=goal[1])
        ax.set_ylabel(label)
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("simulated sidecars (N)")
    fig.tight_layout()
    save_figure(fig, path)


class _Worker:
    """One :mod:`.simsidecars` process: a JSON line per command, one JSON event line per answer."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: str, first: int, count: int) -> None:
        self.proc, self.log_path, self.first, self.count = proc, log_path, first, count

    def owns(self, index: int) -> bool:
        return self.first <= index < self.first + self.count

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def event(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            raise RuntimeError(
                f"simulator {self.first}+{self.count} did not answer in {timeout:g} s:\n{self.tail()}"
            ) from None
        if not line:
            raise RuntimeError(f"simulator {self.first}+{self.count} exited:\n{self.tail()}")
        return json.loads(line)

    async def ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        await self.send(cmd)
        return await self.event(timeout)

    def tail(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-20:])
        return ""

    async def stop(self) -> int:
        """Ask it to stop; terminate, then kill, when it does not within 10 s. Returns the exit code."""
        with contextlib.suppress(OSError, RuntimeError):
            await self.send({"cmd": "stop"})
        try:
            async with asyncio.timeout(10):
                return await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            async with asyncio.timeout(10):
                return await self.proc.wait()


class _ThreadCoordinator:
    """The coordinator in a thread of this process under cProfile (``--profile``), stopped by :meth:`close`."""

    def __init__(self, interval: float, timeout: float, prof_path: str) -> None:
        from snapshotd.coordinator.config import CoordinatorConfig

        self.cfg = CoordinatorConfig(
            bind="tcp://127.0.0.1:0", heartbeat_interval=interval, heartbeat_timeout=timeout
        )
        self.prof_path = prof_path
        self.endpoint = ""
        self.tid = 0
        self._up = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="coordinator", daemon=True)
        self._thread.start()
        if not self._up.wait(30) or not self.endpoint:
            self.close()
            raise RuntimeError("the in-process coordinator did not start (see the log)")

    def _main(self) -> None:
        import uvloop

        from snapshotd.coordinator.server import run_coordinator

        self.tid = threading.get_native_id()

        async def serve() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await run_coordinator(self.cfg, ready=self._ready, stop=self._stop)

        prof = cProfile.Profile(time.thread_time)  # CPU time of this thread: no idle waits, no preemption
        prof.enable()
        try:
            uvloop.run(serve())
        except Exception:
            log.exception("the in-process coordinator failed")
        finally:
            prof.disable()
            prof.dump_stats(self.prof_path)
            self._up.set()

    def _ready(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._up.set()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("the in-process coordinator did not stop in 30 s")


def _cpu_seconds(path: str) -> float:
    """utime + stime of the process or thread whose ``stat`` file is ``path``, in seconds."""
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@contextlib.contextmanager
def _coordinator(args: argparse.Namespace, n: int, workdir: str, connections: int) -> Any:
    """Yield (endpoint, {name: /proc stat path}) of a running coordinator; stop it on exit."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_nofile(connections + 512 + (fds_needed(0) if args.profile else 0))  # the coordinator inherits it
    try:
        if args.profile:
            root, ext = os.path.splitext(args.profile)
            inproc = _ThreadCoordinator(
                args.heartbeat_interval, args.heartbeat_timeout, f"{root}-{n}{ext or '.prof'}"
            )
            try:
                yield inproc.endpoint, {"thread": f"/proc/self/task/{inproc.tid}/stat"}
            finally:
                inproc.close()
                log.info("wrote %s", inproc.prof_path)
            return
        cluster = LocalCluster(
            workdir, heartbeat_interval=args.heartbeat_interval, heartbeat_timeout=args.heartbeat_timeout
        )
        with cluster:
            proc = cluster.start_coordinator()
            yield (
                cluster.coordinator_addr,
                {"process": f"/proc/{proc.pid}/stat", "thread": f"/proc/{proc.pid}/task/{proc.pid}/stat"},
            )
            code = cluster.stop(proc)
            if code != 0:
                raise RuntimeError(f"the coordinator exited with {code}:\n{cluster.tail(proc)}")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


async def _one(n: int, args: argparse.Namespace) -> dict[str, Any]:
    nworkers = max(1, min(args.workers, n))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # each one's sockets fit
    while hard != resource.RLIM_INFINITY and fds_needed(-(-n // nworkers) + 1) > hard:
        nworkers += 1
    connections = n + 1 + nworkers * plan_sockets(-(-n // nworkers))
    with (
        tempfile.TemporaryDirectory(prefix="snapshotd-scale-") as workdir,
        _coordinator(args, n, workdir, connections) as (ep, stat),
    ):
        workers: list[_Worker] = []
        try:
            for w in range(nworkers):
                first, count = w * n // nworkers, (w + 1) * n // nworkers - w * n // nworkers
                log_path = os.path.join(workdir, f"sim-{w}.log")
                with open(log_path, "wb") as err:
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "snapshotd.bench.simsidecars",
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=err,
                        limit=1 << 26,
                    )
                workers.append(_Worker(proc, log_path, first, count))
            return await _measure(n, args, ep, stat, workers)
        finally:
            codes = [await w.stop() for w in workers]
            if any(codes):
                log.warning("simulator exit codes %s", codes)


async def _measure(
    n: int, args: argparse.Namespace, ep: str, stat: dict[str, str], workers: list[_Worker]
) -> dict[str, Any]:
    """Phases 1-5 of the module docstring against the coordinator at ``ep``; the result row."""
    row = await _heartbeats(n, args, ep, stat, workers)
    victim, stop_at = n // 2, time.monotonic()
    for w in workers:
        await w.ask({"cmd": "freeze", "at": stop_at}, _ANSWER_S)
        if w.owns(victim):
            await w.ask({"cmd": "lose", "victim": victim}, _ANSWER_S)
    doc = await _status(ep)
    death_timeout = float(doc["coordinator"]["heartbeat_timeout"])
    row["death_timeout_s"] = round(death_timeout, 3)
    await asyncio.sleep(death_timeout + 0.5)
    row.update(await _plans(n, args, workers, victim))
    doc = await _status(ep)
    rnd = next((j["round"] for j in doc["jobs"] if j.get("round")), None)
    answer_s = rnd["answer_s"] if rnd is not None else None
    row["plan_answer_ms"] = round(answer_s * 1e3, 1) if answer_s is not None else math.nan
    last = await _all(workers, {"cmd": "mark"})
    row.update(
        timeouts=sum(x["timeouts"] for x in last),
        reregistered=sum(x["reregistered"] for x in last),
        plan_waits=sum(x["plan_waits"] for x in last),
    )
    return row


async def _heartbeats(
    n: int, args: argparse.Namespace, ep: str, stat: dict[str, str], workers: list[_Worker]
) -> dict[str, Any]:
    """Start the simulated sidecars, wait for them to be up, and measure the heartbeat window."""
    interval = args.heartbeat_interval
    job, t0 = f"scale-{uuid.uuid4().hex[:6]}", time.monotonic()
    for w in workers:
        await w.ask(
            {
                "cmd": "start",
                "config": {
                    "coordinator": ep,
                    "job": job,
                    "first": w.first,
                    "count": w.count,
                    "total": n,
                    "ranks_per_node": args.ranks_per_node,
                    "interval": interval,
                    "step_seconds": args.step_seconds,
                    "t0": t0,
                },
            },
            _ANSWER_S,
        )
    marks = await _until(workers, {"cmd": "mark"}, lambda ms: sum(m["up"] for m in ms) >= n, args.timeout)
    ramp_s, up = time.monotonic() - t0, sum(m["up"] for m in marks)
    log.info("%d sidecars: %d up after %.1f s", n, up, ramp_s)
    await asyncio.sleep(args.settle)

    cpu0 = {k: _cpu_seconds(p) for k, p in stat.items()}
    c0 = time.monotonic()
    marks0 = await _all(workers, {"cmd": "mark"})
    await asyncio.sleep(args.window / 2)
    s0 = time.monotonic()
    await _status(ep)
    status_ms = (time.monotonic() - s0) * 1e3
    await asyncio.sleep(max(0.0, c0 + args.window - time.monotonic()))
    marks1 = await _all(workers, {"cmd": "mark"})
    span = time.monotonic() - c0
    cpu = {k: (_cpu_seconds(p) - cpu0[k]) / span for k, p in stat.items()}
    pairs = list(zip(marks0, marks1, strict=True))
    hb = sum((b["hb_replies"] - a["hb_replies"]) / (b["t"] - a["t"]) for a, b in pairs)
    drivers = sum((b["cpu_s"] - a["cpu_s"]) / (b["t"] - a["t"]) for a, b in pairs)
    rtts = np.concatenate([np.asarray(m["rtts"], dtype=float) for m in marks1])
    # heartbeats/s the sidecars aim at, at the intervals they were given
    rate = sum(m["rate"] for m in marks1)
    coord = cpu.get("process", cpu["thread"])
    log.info("%d sidecars: %.0f heartbeats/s, coordinator CPU %.2f", n, hb, coord)
    return {
        "sidecars": n,
        "ranks": n * args.ranks_per_node,
        "heartbeats_per_s": round(hb, 1),
        "hb_interval_s": round(n / rate, 3) if rate else math.nan,
        "hb_ratio": round(hb / rate, 3) if rate else math.nan,
        "hb_rtt_p50_ms": _pct(rtts, 50),
        "hb_rtt_p99_ms": _pct(rtts, 99),
        "coordinator_cpu": round(coord, 3),
        "coordinator_py_cpu": round(cpu["thread"], 3),
        "cpu_per_hb_us": round(coord / hb * 1e6, 1) if hb else math.nan,
        "drivers_cpu": round(drivers, 3),
        "status_ms": round(status_ms, 1),
        "up": up,
        "ramp_s": round(ramp_s, 2),
    }


async def _plans(n: int, args: argparse.Namespace, workers: list[_Worker], victim: int) -> dict[str, Any]:
    """The plan round (every rank asks until answered) and its latencies; the plan columns."""
    ranks = n * args.ranks_per_node
    await _all(workers, {"cmd": "ask", "spread": args.heartbeat_interval})
    await _until(workers, {"cmd": "plans"}, _all_answered(ranks), args.timeout)
    got = await _all(workers, {"cmd": "plans", "replies": True})
    # [node, rank, answered at, status, step, local, sources]
    replies = [r for g in got for r in g["replies"]]
    firsts = [g[k] for g in got for k in ("first_min", "first_max") if g[k] is not None]
    last_first = max(g["first_max"] for g in got if g["first_max"] is not None) if firsts else math.nan
    ms = np.asarray([(r[2] - last_first) * 1e3 for r in replies], dtype=float)
    if len(replies) < ranks:  # unanswered within the limit: the percentiles they reach are unknown
        log.warning(
            "%d sidecars: %d of %d ranks got no plan in %g s", n, ranks - len(replies), ranks, args.timeout
        )
        ms = np.append(ms, [math.inf] * (ranks - len(replies)))
    steps = {r[4] for r in replies}
    wrong = [
        r
        for r in replies
        if r[3] != "ready"
        or len(steps) != 1
        or data_addr(victim) in r[6]
        or r[5] != (r[0] != n)
        or (r[0] == n and not r[6])
    ]
    if wrong:
        log.warning(
            "%d sidecars: %d plan answers are wrong, e.g. %s (the lost node is %s at %s; steps %s)",
            n,
            len(wrong),
            wrong[0],
            node_name(victim, n),
            data_addr(victim),
            sorted(steps),
        )
    done = len(replies) == ranks and firsts
    return {
        "freeze_s": round(max(r[2] for r in replies) - min(firsts), 2) if done else math.nan,
        "plan_p50_ms": _pct(ms, 50),
        "plan_p99_ms": _pct(ms, 99),
        "plan_max_ms": _pct(ms, 100),
        "plan_samples": ranks,
        "plan_answered": len(replies),
        "plan_wrong": len(wrong),
    }


async def _status(ep: str) -> dict[str, Any]:
    """The coordinator's status document (as ``snapshotd status --json`` prints it)."""
    return await asyncio.to_thread(fetch_status, ep, secret=security.secret_from_env(), timeout=_ANSWER_S)


def _all_answered(requests: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda events: sum(e["received"] for e in events) >= requests


async def _all(workers: list[_Worker], cmd: dict[str, Any]) -> list[dict[str, Any]]:
    """Send ``cmd`` to every worker and gather their answers."""
    for w in workers:
        await w.send(cmd)
    return list(await asyncio.gather(*(w.event(_ANSWER_S) for w in workers)))


async def _until(
    workers: list[_Worker], cmd: dict[str, Any], done: Callable[[list[dict[str, Any]]], bool], limit: float
) -> list[dict[str, Any]]:
    """Ask every worker ``cmd`` every ``_POLL_S`` until ``done(answers)`` or ``limit`` s; the last answers."""
    end = time.monotonic() + limit
    while True:
        answers = await _all(workers, cmd)
        if done(answers) or time.monotonic() >= end:
            return answers
        await asyncio.sleep(_POLL_S)


def _pct(values: np.ndarray, q: float) -> float:
    """The ``q``-th percentile in ms (rounded); NaN for no values or when it is not finite (unanswered)."""
    if not values.size:
        return math.nan
    v = float(np.percentile(values, q, method="higher"))
    return round(v, 3) if math.isfinite(v) else math.nan
