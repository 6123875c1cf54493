"""``snapshotd-bench recovery``: a replacement rank restoring its state from buddies, beside ``torch.load``.

Setup, all on this machine, one process per role: a coordinator (``--replicas 1``, heartbeat every 0.2 s,
timeout 1.5 s, as the demo) and sidecars for nodes A, B and C. Rank 0 of a one-rank job runs on node B and holds
``--size`` bytes of float32 state in ``--tensors`` tensors (seeded random values). It snapshots until one step
is durable, and the coordinator knows the step is on B and on B's buddy (A or C, the coordinator's choice).

1. **Node loss.** The rank and B's sidecar are SIGKILLed together (B's shared memory goes with them).
   ``detection_seconds`` runs from the kill until the coordinator's status shows B dead.
2. **Re-replication.** The coordinator copies the snapshot from the buddy to the third live node, back to
   ``1 + replicas`` copies; ``re_replication_seconds`` runs from the kill until it has.
3. **Replacement.** A sidecar starts as node R and a fresh rank process on R calls ``Snapshotter.restore()``.
   ``restore_seconds`` is that call, timed inside the rank: registration (R's sidecar maps a new arena), the
   coordinator's plan, the pull striped over both live holders (checksums verified), and the copy from shared
   memory into the rank's tensors; ``pull_seconds`` is the sidecar's share (plan plus pull, RestoreReply.seconds).
   The restored tensors' xxh3 digest must equal the original's, or the run fails. R starts only after the
   re-replication, so R is the rank's new home and never a replication target: the restore is a real pull
   (``restore_source`` says which path ran). With ``--repeat`` N (default 3) it is done N times, each time by a
   fresh rank process on a fresh node (R, R2, ...), and the median restore is reported: one restore's time
   varies by a factor of two from run to run on a small shared machine.

Baselines in the same run, on the same tensors: ``torch.save`` to a file in a temporary folder on local disk,
fsync, then ``posix_fadvise(DONTNEED)`` to drop it from the page cache, and ``torch.load(weights_only=True)``
timed (``torch_load_seconds``, cold cache; a second, warm-cache load is a row of its own). When the optional
``torchft`` package is importable, its ``HTTPTransport`` moves the same tensors from one process to another
(``torchft_seconds``: the receiver's ``recv_checkpoint`` only, median of N; ``torchft_ratio`` is that over
``restore_seconds``); otherwise that row says it was skipped. A plain TCP socket between two processes moves
the same number of bytes over loopback (:func:`~.baselines.raw_socket_transfer`, median of 3), each side reusing
one 1 MiB buffer that stays in the CPU's caches: ``raw_socket_GBps``, and ``restore_vs_raw`` and ``pull_vs_raw``,
the restore's rate (end to end, in the rank) and the pull's (the sidecar's share) over it. A restore reads its
bytes from the holders' memory and writes them into the rank's tensors, which no cache holds at that size, so the
socket moves them once more from and into buffers of the state's size, every page written first
(``whole=True``): ``raw_state_GBps``, and ``restore_vs_raw_state``.

Expected time lost per failure (``--interval`` N, ``--step-seconds`` T, ``--restart-seconds`` S, the launcher
relaunching the processes, the same for both): snapshotd = detection + S + restore + 1 step (the usual loss
with a snapshot every step; the README states the bound); checkpoint-restart every N steps = detection + S + torch.load + N/2 x T (half an interval recomputed on
average). The measured detection is charged to both, which favours checkpoint-restart: without a detector,
a job learns of a lost node from a collective's timeout.

The data plane runs without ``SNAPSHOTD_SECRET`` (plaintext on loopback, as ``transport`` and the raw socket).

Summary: ``state_bytes``, ``detection_seconds``, ``restore_seconds``, ``restore_GBps``, ``torch_load_seconds``,
``torch_load_GBps``, ``restore_speedup`` (torch.load / restore), ``pull_seconds``, ``restore_source``,
``restore_fetched`` (the rank read the bytes from the holders' bulk ports itself),
``re_replication_seconds``, ``raw_socket_GBps``, ``restore_vs_raw``, ``pull_vs_raw``, ``raw_state_GBps``,
``restore_vs_raw_state``, ``restore_cpu_seconds`` (of the median restore: the CPU time its rank spent in
``restore()``, ``restore_cpu_rank_seconds``, plus what every sidecar spent from the go to the rank's report,
``restore_cpu_sidecar_seconds`` for the replacement's and ``restore_cpu_holders_seconds`` for the others: the
holders, and nodes that only heartbeat), ``restore_busy_cores`` (that CPU time over ``restore_seconds``: near the
machine's core count, the restore is bound by CPU, not by the network), and ``torchft_seconds`` and
``torchft_ratio`` when torchft ran.

The rank roles run as ``python -m snapshotd.bench.recovery snapshot|restore|torchft-send|torchft-recv``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from snapshotd.harness.cluster import LocalCluster
from snapshotd.harness.demo import wait_for
from snapshotd.status import fetch_status
from snapshotd.units import format_bytes, parse_bytes

from .baselines import process_cpu_seconds, raw_socket_transfer
from .report import Report, progress, save_figure, scratch_dir

__all__ = ["add_arguments", "make_state", "plot", "run", "state_digest"]

log = logging.getLogger(__name__)

_COLUMNS = ["path", "time_seconds", "state_bytes", "rate_Bps", "lost_steps", "wasted_seconds", "note"]
_POLL = 0.05


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``recovery`` subcommand's flags."""
    parser.add_argument("--size", type=parse_bytes, default=1 << 30, help="rank state (default 1GiB)")
    parser.add_argument("--tensors", type=int, default=4, help="float32 tensors holding it (default 4)")
    parser.add_argument(
        "--interval",
        type=_int_list,
        default=[10, 100],
        help="checkpoint-restart baselines: checkpoint every N steps (default 10,100)",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=1.0,
        help="training step time for the lost-work rows (default 1.0)",
    )
    parser.add_argument(
        "--restart-seconds",
        type=float,
        default=0.0,
        help="launcher relaunch time, charged to both (default 0: not counted)",
    )
    parser.add_argument("--chunk", default=None, help="sidecars' --chunk (default: theirs, 4MiB)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="restores (each a fresh replacement node) and torchft transfers timed; medians are "
        "reported (default 3)",
    )
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per phase (default 300)")


# ------------------------------------------------------------------------------------------ the state


def make_state(size: int, parts: int, *, seed: int = 0) -> list[Any]:
    """``parts`` float32 tensors of ``size`` bytes in all, seeded uniform values (the same for the same args).

    Raises:
        ValueError: ``size`` is not a positive multiple of 4, or ``parts`` is not in 1..size/4.
    """
    import torch

    n = size // 4
    if size < 4 or size % 4 or not 1 <= parts <= n:
        raise ValueError(
            f"need a positive size that is a multiple of 4 and 1 <= tensors <= size/4, got {size}, {parts}"
        )
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(n // parts + (i < n % parts), generator=gen) for i in range(parts)]


def state_digest(tensors: list[Any]) -> str:
    """xxh3-64 over the tensors' bytes, in order."""
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.contiguous().numpy().data)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ baselines


def _disk_baseline(folder: str, tensors: list[Any]) -> dict[str, Any]:
    """torch.save + fsync, drop the file from the page cache, then a cold and a warm ``torch.load``, timed."""
    import torch

    path = os.path.join(folder, "checkpoint.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"tensors": tensors}, f)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    save = time.perf_counter() - t0
    want = state_digest(tensors)
    out: dict[str, Any] = {"save_seconds": save, "file_bytes": os.path.getsize(path)}
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        out[f"{label}_seconds"] = time.perf_counter() - t0
        if state_digest(loaded["tensors"]) != want:
            raise RuntimeError("torch.load returned different tensors than torch.save wrote")
        del loaded
    os.unlink(path)
    return out


def _median_of(repeat: int, spread: tuple[float, float]) -> str:
    """A row note's tail naming the median and its spread, or nothing for a single run."""
    return f"; median of {repeat} ({spread[0]:.2f}-{spread[1]:.2f} s)" if repeat > 1 else ""


def _torchft(workdir: str, args: argparse.Namespace) -> list[float] | None:
    """Seconds torchft's HTTPTransport takes to move the state between two processes, for each of ``--repeat``
    transfers; None without torchft."""
    try:
        import torchft.checkpointing  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "torchft":
            raise  # torchft is there but broken: say so rather than skip
        print("snapshotd-bench recovery: torchft not installed; skipped", file=sys.stderr)
        return None
    common = ["--size", str(args.size), "--tensors", str(args.tensors), "--timeout", str(args.timeout)]
    seconds = []
    for _ in range(args.repeat):
        with _role(workdir, "torchft-send", common) as sender:
            sent = _read_json_line(sender, time.monotonic() + args.timeout)
            with _role(workdir, "torchft-recv", [*common, "--metadata", sent["metadata"]]) as receiver:
                result = _read_json_line(receiver, time.monotonic() + args.timeout)
        if result["digest"] != sent["digest"]:
            raise RuntimeError("torchft delivered different tensors than were sent")
        seconds.append(float(result["seconds"]))
    return seconds


# ---------------------------------------------------------------------------------------- node loss


def _copies(coordinator: str, job: str) -> int:
    jobs = fetch_status(coordinator, secret=None)["jobs"]
    return next((j["ranks"][0]["copies"] for j in jobs if j["job"] == job and j["ranks"]), 0)


def _node_alive(coordinator: str, node: str) -> bool:
    return any(n["node"] == node and n["alive"] for n in fetch_status(coordinator, secret=None)["nodes"])


def _node_loss(workdir: str, args: argparse.Namespace, phase_done: Callable[[], None]) -> dict[str, Any]:
    """The three steps of the module docstring; the measurements and the restore driver's report."""
    job = f"recovery-{uuid.uuid4().hex[:8]}"
    flags = ["--chunk", args.chunk] if args.chunk else []
    common = [
        "--job",
        job,
        "--size",
        str(args.size),
        "--tensors",
        str(args.tensors),
        "--timeout",
        str(args.timeout),
    ]
    with (
        LocalCluster(
            workdir, replicas=1, heartbeat_interval=0.2, heartbeat_timeout=1.5, env={"SNAPSHOTD_SECRET": ""}
        ) as cluster,
        contextlib.ExitStack() as roles,
    ):
        cluster.start_coordinator()
        addr = cluster.coordinator_addr
        # Both ranks start now (torch import, state allocation) and wait for a go line before the sidecar.
        rank_b = roles.enter_context(
            _role(workdir, "snapshot", [*common, "--sidecar", cluster.ipc_path("B")], node_loss=True)
        )
        rank_r = roles.enter_context(_role(workdir, "restore", [*common, "--sidecar", cluster.ipc_path("R")]))
        for node in ("A", "B", "C"):
            cluster.start_sidecar(node, *flags)
        snap = _go(rank_b, args.timeout)
        wait_for(lambda: _copies(addr, job) >= 2, args.timeout, "the coordinator to see the buddy's copy")
        phase_done()
        t_fail = time.monotonic()
        cluster.kill(cluster.sidecars["B"])
        rank_b.kill()
        wait_for(lambda: not _node_alive(addr, "B"), args.timeout, "node B declared dead")
        detection = time.monotonic() - t_fail
        wait_for(lambda: _copies(addr, job) >= 2, args.timeout, "re-replication back to two copies")
        re_replication = time.monotonic() - t_fail
        holders = _copies(addr, job)
        log.info(
            "node B (step %d) declared dead after %.2f s, %d copies again after %.2f s",
            snap["step"],
            detection,
            holders,
            re_replication,
        )
        phase_done()
        cluster.start_sidecar("R", *flags)
        restores = [_timed_restore(cluster, "R", rank_r, args.timeout)]
        for k in range(2, args.repeat + 1):  # each on a node of its own, as a replacement restores
            node = f"R{k}"
            with _role(workdir, "restore", [*common, "--sidecar", cluster.ipc_path(node)]) as again:
                cluster.start_sidecar(node, *flags)
                restores.append(_timed_restore(cluster, node, again, args.timeout))
        phase_done()
        for name, p in cluster.sidecars.items():
            if name != "B" and not p.alive():
                raise RuntimeError(f"sidecar {name} exited during the run; log:\n{cluster.tail(p)}")
    for restored in restores:
        if restored["digest"] != snap["digest"] or restored["step"] != snap["step"]:
            raise RuntimeError(
                f"restored step {restored['step']} digest {restored['digest']}, but step "
                f"{snap['step']} digest {snap['digest']} was snapshotted"
            )
    middle = sorted(restores, key=lambda r: r["seconds"])[(len(restores) - 1) // 2]  # the median restore
    spread = (min(r["seconds"] for r in restores), max(r["seconds"] for r in restores))
    return {
        "detection": detection,
        "re_replication": re_replication,
        "holders": holders,
        "spread": spread,
        **middle,
    }


def _timed_restore(
    cluster: LocalCluster, node: str, rank: subprocess.Popen[bytes], timeout: float
) -> dict[str, Any]:
    """Let the restore rank ``rank`` (waiting on ``node``, whose sidecar is ready) restore; its result, with
    ``cpu``: the CPU seconds the rank spent in ``restore()``, its sidecar and the other sidecars (the holders,
    and nodes that only heartbeat) over the restore and the rank's report after it."""
    pids = {name: p.pid for name, p in cluster.sidecars.items() if p.alive()}
    before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
    result = _go(rank, timeout)
    spent = {}
    for name, pid in pids.items():
        start, end = before[name], process_cpu_seconds(pid)
        if start is not None and end is not None:
            spent[name] = end - start
    result["cpu"] = {
        "rank": result["cpu_seconds"],
        "sidecar": spent.get(node, 0.0),
        "other_sidecars": sum(v for name, v in spent.items() if name != node),
    }
    return result


# -------------------------------------------------------------------------------------------- report


def run(args: argparse.Namespace) -> Report:
    """Measure as the module docstring says; see :func:`add_arguments` for ``args``.

    Raises:
        ValueError: bad arguments.
        RuntimeError: a process failed, or the restored state differs from the snapshotted one.
        TimeoutError: a phase did not finish within ``--timeout``.
    """
    if args.step_seconds < 0 or args.restart_seconds < 0 or args.timeout <= 0 or args.repeat < 1:
        raise ValueError("--step-seconds and --restart-seconds must be >= 0, --timeout > 0, --repeat >= 1")
    size = args.size
    tensors = make_state(size, args.tensors)  # ValueError for a bad --size or --tensors
    with scratch_dir(args.workdir, prefix="snapshotd-recovery-") as workdir, progress(unit="phases") as bar:
        task = bar.add_task("recovery phases", total=4)
        disk = _disk_baseline(workdir, tensors)
        del tensors
        bar.advance(task)
        loss = _node_loss(workdir, args, lambda: bar.advance(task))
        torchft_each = _torchft(workdir, args)
        raw = raw_socket_transfer(size, repeat=3, timeout=args.timeout)
        raw_state = raw_socket_transfer(size, repeat=3, timeout=args.timeout, whole=True)
    restore, load = loss["seconds"], disk["cold_seconds"]
    torchft = statistics.median_low(torchft_each) if torchft_each else None
    pulled, cpu = loss["restored"], loss["cpu"]
    cpu_total = cpu["rank"] + cpu["sidecar"] + cpu["other_sidecars"]
    rows: list[dict[str, Any]] = [
        {
            "path": f"snapshotd restore ({pulled['source']})",
            "time_seconds": restore,
            "state_bytes": size,
            "rate_Bps": size / restore,
            "note": f"{format_bytes(pulled['bytes_pulled'])} pulled from {loss['holders']} "
            f"live holders; sidecar share {pulled['seconds']:.2f} s; CPU: rank {cpu['rank']:.2f} s, its sidecar "
            f"{cpu['sidecar']:.2f} s, the others {cpu['other_sidecars']:.2f} s{_median_of(args.repeat, loss['spread'])}",
        },
        {
            "path": "torch.load, local disk (cold)",
            "time_seconds": load,
            "state_bytes": size,
            "rate_Bps": size / load,
            "note": f"file {format_bytes(disk['file_bytes'])} dropped from the page cache; save took {disk['save_seconds']:.2f} s",
        },
        {
            "path": "torch.load, page cache (warm)",
            "time_seconds": disk["warm_seconds"],
            "state_bytes": size,
            "rate_Bps": size / disk["warm_seconds"],
            "note": "the same file, read again",
        },
        {
            "path": "raw TCP socket, loopback",
            "time_seconds": size / raw,
            "state_bytes": size,
            "rate_Bps": raw,
            "note": "two processes, sendall / recv_into, one 1 MiB buffer each (in cache), median of 3",
        },
        {
            "path": "raw TCP socket, loopback, state to state",
            "time_seconds": size / raw_state,
            "state_bytes": size,
            "rate_Bps": raw_state,
            "note": "the same, from and into buffers of the state's size, median of 3",
        },
        {
            "path": "torchft HTTPTransport",
            "time_seconds": torchft,
            "state_bytes": size,
            "rate_Bps": size / torchft if torchft else None,
            "note": f"recv_checkpoint, process to process{_median_of(args.repeat, (min(torchft_each), max(torchft_each)))}"
            if torchft_each
            else "torchft not installed; skipped",
        },
    ]
    fixed = loss["detection"] + args.restart_seconds
    rows.append(
        {
            "path": "failure: snapshotd",
            "lost_steps": 1,
            "wasted_seconds": fixed + restore + args.step_seconds,
            "note": "detection + restart + restore + one step (the usual loss; see the bound)",
        }
    )
    for n in args.interval:
        rows.append(
            {
                "path": f"failure: checkpoint every {n}",
                "lost_steps": n / 2,
                "wasted_seconds": fixed + load + n / 2 * args.step_seconds,
                "note": "detection + restart + torch.load + half an interval recomputed",
            }
        )
    summary: dict[str, Any] = {
        "state_bytes": size,
        "detection_seconds": loss["detection"],
        "restore_seconds": restore,
        "restore_GBps": size / restore / 1e9,
        "torch_load_seconds": load,
        "torch_load_GBps": size / load / 1e9,
        "restore_speedup": load / restore,
        "pull_seconds": pulled["seconds"],
        "restore_source": pulled["source"],
        "restore_fetched": bool(pulled.get("fetched")),
        "re_replication_seconds": loss["re_replication"],
        "raw_socket_GBps": raw / 1e9,
        "restore_vs_raw": size / restore / raw,
        "pull_vs_raw": size / pulled["seconds"] / raw,
        "raw_state_GBps": raw_state / 1e9,
        "restore_vs_raw_state": size / restore / raw_state,
        "restore_cpu_seconds": cpu_total,
        "restore_cpu_rank_seconds": cpu["rank"],
        "restore_cpu_sidecar_seconds": cpu["sidecar"],
        "restore_cpu_holders_seconds": cpu["other_sidecars"],
        "restore_busy_cores": cpu_total / restore,
    }
    if torchft is not None:
        summary["torchft_seconds"] = torchft
        summary["torchft_ratio"] = torchft / restore
    config = {
        k: getattr(args, k)
        for k in ("size", "tensors", "interval", "step_seconds", "restart_seconds", "repeat", "chunk")
    }
    config["setup"] = (
        "coordinator + sidecars A, B, C, R on one machine (loopback TCP, plaintext); rank 0 on B; "
        "B killed; R (and with --repeat, R2, R3, ...) restores from the live holders"
    )
    return Report("recovery", config, rows, summary, columns=list(_COLUMNS))


def plot(report: Report, path: str) -> None:
    """Two bar panels: time to get the state back per path, and expected time lost per failure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1)
    for ax, key, title in (
        (top, "time_seconds", "time to get the rank's state back"),
        (bottom, "wasted_seconds", "expected time lost per failure"),
    ):
        rows = [r for r in report.results if r.get(key) is not None]
        ax.barh(range(len(rows)), [r[key] for r in rows])
        ax.set_yticks(range(len(rows)), [r["path"] for r in rows])
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            ax.text(r[key], i, f" {r[key]:.2f} s", va="center")
        ax.set_xlim(0, 1.2 * max((r[key] for r in rows), default=1.0))
        ax.set_xlabel("seconds")
        ax.set_title(title)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"snapshotd-bench recovery: {format_bytes(report.summary['state_bytes'])} of rank state")
    fig.tight_layout()
    save_figure(fig, path)


# -------------------------------------------------------------------------------- rank role processes


@contextlib.contextmanager
def _role(
    workdir: str, role: str, argv: list[str], *, node_loss: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``python -m snapshotd.bench.recovery ROLE ARGV`` (stderr to a log), yield it, then close its stdin
    and wait up to 60 s for its exit (it is killed when the block raised or it does not exit).

    Args:
        node_loss: the block SIGKILLs the process (as a node loss); that exit status is then expected.

    Raises:
        RuntimeError: the process failed (with its log's tail).
    """
    log_path = os.path.join(workdir, f"{role}-{uuid.uuid4().hex[:4]}.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, role, *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.PIPE,
            env=env,
        )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield proc
        proc.stdin.close()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()
    if proc.returncode != 0 and not (node_loss and proc.returncode == -signal.SIGKILL):
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"{role} exited with {proc.returncode}; log:\n{''.join(f.readlines()[-30:])}")


def _read_json_line(proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """One JSON line from ``proc``'s stdout by ``deadline`` (``time.monotonic``).

    Raises:
        TimeoutError: no full line in time. RuntimeError: the process closed its stdout first.
    """
    assert proc.stdout is not None
    fd, data = proc.stdout.fileno(), b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no result line from the rank process in time (got {data!r})")
        piece = os.read(fd, 65536)
        if not piece:
            raise RuntimeError(f"the rank process exited (code {proc.wait(10)}) before reporting")
        data += piece
    result: dict[str, Any] = json.loads(data)
    return result


def _go(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """Tell a rank process waiting in :func:`_await_go` to go on; its JSON result line."""
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    return _read_json_line(proc, time.monotonic() + timeout)


def _stdin_line(deadline: float) -> bytes:
    """Read stdin up to a newline or EOF (the parent closed it, or died), at most until ``deadline``."""
    data = b""
    while not data.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([sys.stdin], [], [], max(0.0, deadline - time.monotonic()))[0]:
            piece = os.read(sys.stdin.fileno(), 1)
            if not piece:
                break
            data += piece
    return data


def _await_go(deadline: float) -> None:
    """Wait for the parent's go line.

    Raises:
        RuntimeError: stdin closed, or no go line by ``deadline``.
    """
    if _stdin_line(deadline) != b"go\n":
        raise RuntimeError("no go line from the benchmark")


def _snapshot_role(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0 on the failing node: snapshot the state until one step is durable, then report and wait."""
    from snapshotd.client import Snapshotter

    tensors = make_state(args.size, args.tensors)
    deadline = time.monotonic() + args.timeout
    _await_go(deadline)
    with Snapshotter(
        {"tensors": tensors},
        job=args.job,
        rank=0,
        world_size=1,
        sidecar=args.sidecar,
        when_busy="block",
        timeout=args.timeout,
    ) as snap:
        if snap.restore(timeout=args.timeout) != 0:
            raise RuntimeError(f"job {args.job} already has a snapshot: use a fresh job name")
        step = 0
        while snap.stats.last_durable_step < 1:  # the first captures may find no buddy assigned yet
            step += 1
            failed = snap.stats.failed
            if snap.capture(step):
                while not snap.wait(timeout=_POLL) and snap.stats.failed == failed:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no snapshot became durable in time ({snap.stats})")
        _emit({"step": snap.stats.last_durable_step, "digest": state_digest(tensors)})
        _stdin_line(deadline)  # the node loss SIGKILLs this process here
    return {}


def _restore_role(args: argparse.Namespace) -> dict[str, Any]:
    """The replacement rank: fresh (zeroed, touched) tensors, ``restore()`` timed, then report."""
    import torch

    from snapshotd.client import Snapshotter

    n, parts = args.size // 4, args.tensors
    tensors = [torch.full((n // parts + (i < n % parts),), 0.0) for i in range(parts)]  # make_state's shapes
    _await_go(time.monotonic() + args.timeout)
    with Snapshotter(
        {"tensors": tensors}, job=args.job, rank=0, world_size=1, sidecar=args.sidecar, timeout=args.timeout
    ) as snap:
        t0, cpu0 = time.perf_counter(), time.process_time()
        step = snap.restore(timeout=args.timeout)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        restored = dict(snap.restored)
    return {
        "step": step,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "restored": restored,
        "digest": state_digest(tensors),
    }


def _torchft_send(args: argparse.Namespace) -> dict[str, Any]:
    from torchft.checkpointing import HTTPTransport

    timeout = timedelta(seconds=args.timeout)
    transport: Any = HTTPTransport(timeout, num_chunks=0)
    tensors = make_state(args.size, args.tensors)
    transport.send_checkpoint(dst_ranks=[1], step=1, state_dict={"tensors": tensors}, timeout=timeout)
    _emit({"metadata": transport.metadata(), "digest": state_digest(tensors)})
    _stdin_line(time.monotonic() + args.timeout)  # until the receiver is done
    transport.shutdown(wait=True)
    return {}


def _torchft_recv(args: argparse.Namespace) -> dict[str, Any]:
    from torchft.checkpointing import HTTPTransport

    timeout = timedelta(seconds=args.timeout)
    transport: Any = HTTPTransport(timeout, num_chunks=0)
    t0 = time.perf_counter()
    state = transport.recv_checkpoint(src_rank=0, metadata=args.metadata, step=1, timeout=timeout)
    seconds = time.perf_counter() - t0
    transport.shutdown(wait=True)
    return {"seconds": seconds, "digest": state_digest(state["tensors"])}


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


_ROLES = {
    "snapshot": _snapshot_role,
    "restore": _restore_role,
    "torchft-send": _torchft_send,
    "torchft-recv": _torchft_recv,
}


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snapshotd.bench.recovery")
    p.add_argument("role", choices=sorted(_ROLES))
    p.add_argument("--size", type=parse_bytes, required=True)
    p.add_argument("--tensors", type=int, required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--job", default="")
    p.add_argument("--sidecar", default="")
    p.add_argument("--metadata", default="")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    result = _ROLES[args.role](args)
    if result:
        _emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
