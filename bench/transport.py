"""``snapshotd-bench transport``: sidecar-to-sidecar streaming against a plain TCP socket with the same bytes.

Each sidecar phase starts a fresh deployment of real processes
(:class:`~snapshotd.harness.cluster.LocalCluster`): a coordinator (``--replicas 1``), sidecar A, which the
driver (:mod:`.drivers`, a training-rank stand-in with a real Snapshotter) snapshots into, and sidecar B, A's
buddy, which receives. The driver times each step from
``capture()`` until A reports it durable on B.

1. **Loopback**: a state of ``--size`` bytes (fp32), ``--repeat`` timed snapshots, and the same bytes through
   :func:`~snapshotd.bench.baselines.raw_socket_transfer`.
2. **Shaped links** (root and iproute2 only; skipped with the reason otherwise): the same across a veth pair
   between two network namespaces shaped with ``tbf`` at 1 and 10 Gbit/s (:mod:`.links`), with
   ``--link-size`` bytes. Everything of A's side (coordinator, sidecar A, driver) runs in namespace A,
   sidecar B in namespace B: namespaces cannot reach the root namespace's loopback.
3. **Delta on 1 Gbit/s**: consecutive AdamW steps of a GPT (``--delta-params``) streamed by sidecars running
   ``--codec raw`` (the 1 Gbit/s phase's own) and then by fresh ones running ``--codec delta-lz4``; steps
   after the first durable one are timed, so the buddy holds the previous step as the delta base.

Every driver first takes a few untimed snapshots (:data:`~snapshotd.bench.drivers.SETTLE`): the buddy's first
snapshots of a rank allocate its buffers, whose first touch costs far more than the bytes' transfer on this VM;
a long job pays that once, so the timed snapshots are the steady state.

A sidecar's rate (``stream``) is the state's bytes over the median time from ``capture()`` returning (the
state is in shared memory; the transport phase's state has no optimizer, so the copy is synchronous) to
durable; ``e2e`` also counts the copy. The raw socket's rate excludes connection setup and its first ``recv``;
it moves the same bytes just before and just after each sidecar phase, and its rate is the mean of the two runs'
medians (both in the row, ``raw_before_Bps`` and ``raw_after_Bps``), so that the machine's speed drifting during a
phase moves both sides of a ratio alike.
The sidecars stream unpaced (``--max-rate`` at :data:`~.drivers.UNPACED`): ``auto`` spreads each stream over two
thirds of its rank's step on purpose, and a driver's step is its stream, so ``auto`` would measure the pacer, not
the transport. Every other phase runs without ``SNAPSHOTD_SECRET`` (plaintext, as the raw socket is; routable
binds with ``--insecure``). The coordinator's ``--heartbeat-timeout`` defaults to 8 s here, not 3 s: while a step's
stream to its buddy is younger than that, the coordinator counts it as in flight; an older one is "missing a
copy" and the coordinator has the buddy pull the same step again, concurrently with the stream, which then
fails (the ``replications`` column counts such tasks; it should stay 0).

4. **Security** (``--security`` only): the loopback phase again with ``SNAPSHOTD_SECRET`` set, once with the
   data plane on CURVE (the default) and once in ``members`` mode (plaintext behind the member check), each
   row's ``vs_raw`` against the same raw socket.

Summary: ``state_bytes``, ``sidecar_GBps`` and ``raw_socket_GBps`` (loopback, GB/s), ``loopback_ratio``
(sidecar / raw), ``sidecar_rss_bytes`` (receiving sidecar's VmRSS after the repeats), and, when shaped links
ran, ``link_1gbit_ratio``, ``link_10gbit_ratio`` and ``delta_speedup_1gbit`` (median raw time / delta time),
and with ``--security``, ``curve_GBps`` and ``members_GBps``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from snapshotd.harness.cluster import LocalCluster
from snapshotd.units import format_bytes, parse_bytes

from .baselines import raw_socket_transfer
from .drivers import UNPACED
from .links import Link, links_available, shaped_link
from .report import Report

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)

_HEARTBEAT_INTERVAL = 0.5  # the CLI's default
_LINK_RATES = (("1gbit", 1e9), ("10gbit", 10e9))
_COLUMNS = [
    "run",
    "state_bytes",
    "stream_Bps",
    "vs_raw",
    "e2e_Bps",
    "stage_seconds",
    "receiver_rss_bytes",
    "sender_rss_bytes",
    "replications",
]
_SUMMARY_KEYS = (
    "state_bytes",
    "sidecar_GBps",
    "raw_socket_GBps",
    "loopback_ratio",
    "sidecar_rss_bytes",
    "link_1gbit_ratio",
    "link_10gbit_ratio",
    "delta_speedup_1gbit",
    "curve_GBps",
    "members_GBps",
)
_CONFIG_KEYS = (
    "size",
    "repeat",
    "chunk",
    "link_size",
    "link_repeat",
    "delta_params",
    "delta_repeat",
    "security",
    "heartbeat_timeout",
    "timeout",
)
_BENCH_SECRET = "snapshotd-bench transport"  # a throwaway secret for the security phase


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``transport`` subcommand's flags."""
    parser.add_argument("--size", type=parse_bytes, default=1 << 30, help="state on loopback (default 1GiB)")
    parser.add_argument("--repeat", type=int, default=5, help="timed snapshots on loopback (default 5)")
    parser.add_argument("--chunk", default=None, help="sidecars' --chunk (default: theirs, 4MiB)")
    parser.add_argument(
        "--link-size", type=parse_bytes, default=256 << 20, help="state on the shaped links (default 256MiB)"
    )
    parser.add_argument("--link-repeat", type=int, default=5, help="timed snapshots per link (default 5)")
    parser.add_argument(
        "--delta-params",
        type=int,
        default=20_000_000,
        help="GPT parameters of the delta phase, 12 B of state each (default 2e7)",
    )
    parser.add_argument(
        "--delta-repeat", type=int, default=3, help="timed training steps per codec (default 3)"
    )
    parser.add_argument("--no-links", action="store_true", help="skip the shaped-link phases")
    parser.add_argument(
        "--security",
        action="store_true",
        help="also stream on loopback with a secret: CURVE, and --data-security members",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=8.0,
        help="the coordinator's --heartbeat-timeout, seconds (default 8; see the module docstring)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per phase (default 300)")


def run(args: argparse.Namespace) -> Report:
    """Measure as the module docstring says; see :func:`add_arguments` for ``args``.

    Raises:
        ValueError: bad sizes or counts.
        RuntimeError: a process failed or a phase did not finish within ``--timeout``.
    """
    for name in ("size", "link_size"):
        if getattr(args, name) < 4 or getattr(args, name) % 4:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive multiple of 4 bytes")
    if min(args.repeat, args.link_repeat, args.delta_repeat) < 1 or args.delta_params < 1:
        raise ValueError("--repeat, --link-repeat, --delta-repeat and --delta-params must be >= 1")
    config: dict[str, Any] = {k: getattr(args, k) for k in _CONFIG_KEYS}
    results: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="snapshotd-bench-transport-") as workdir:
        phase = functools.partial(
            _sidecar_rows, workdir, "loopback", None, "raw", args, [_transport_argv(args.size, args.repeat)]
        )
        (side,), raw = _beside_raw("loopback", None, args.size, args.repeat, args, results, phase)
        summary["state_bytes"] = side["state_bytes"]
        summary["sidecar_GBps"] = side["stream_Bps"] / 1e9
        summary["raw_socket_GBps"] = raw / 1e9
        summary["loopback_ratio"] = side["stream_Bps"] / raw
        summary["sidecar_rss_bytes"] = side["receiver_rss_bytes"]
        for mode in ("curve", "members") if args.security else ():
            (row,) = _sidecar_rows(
                workdir,
                f"loopback-{mode}",
                None,
                "raw",
                args,
                [_transport_argv(args.size, args.repeat)],
                security=mode,
            )
            row["run"], row["vs_raw"] = f"loopback sidecar, {mode}", row["stream_Bps"] / raw
            results.append(row)
            summary[f"{mode}_GBps"] = row["stream_Bps"] / 1e9
        reason = "disabled by --no-links" if args.no_links else links_available()
        config["links"] = reason or "ran"
        if reason is not None:
            print(f"snapshotd-bench transport: shaped links skipped: {reason}", file=sys.stderr)
        else:
            summary.update(_links(workdir, args, results))
    return Report(bench="transport", config=config, results=results, summary=summary, columns=_COLUMNS)


def _transport_argv(size: int, repeat: int) -> list[str]:
    return ["transport", "--size", str(size), "--repeat", str(repeat)]


def _links(workdir: str, args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, float]:
    """The shaped-link phases; their summary values."""
    out: dict[str, float] = {}
    train = ["train", "--params", str(args.delta_params), "--repeat", str(args.delta_repeat)]
    for label, rate in _LINK_RATES:
        with shaped_link(rate) as link:
            drivers = [_transport_argv(args.link_size, args.link_repeat)]
            if label == "1gbit":  # the raw-codec training run shares these sidecars
                drivers.append(train)
            phase = functools.partial(_sidecar_rows, workdir, label, link, "raw", args, drivers)
            (side, *train_raw), raw = _beside_raw(
                label, link, args.link_size, args.link_repeat, args, results, phase
            )
            out[f"link_{label}_ratio"] = side["stream_Bps"] / raw
            if label == "1gbit":
                (delta,) = _sidecar_rows(workdir, f"{label}-delta", link, "delta-lz4", args, [train])
                train_raw[0]["run"], delta["run"] = f"{label} train raw", f"{label} train delta-lz4"
                # capture() -> durable: with an optimizer in the state the shared-memory copy is included
                delta["vs_raw"] = train_raw[0]["e2e_seconds"] / delta["e2e_seconds"]
                results.extend((train_raw[0], delta))
                out["delta_speedup_1gbit"] = delta["vs_raw"]
    return {k: out[k] for k in _SUMMARY_KEYS if k in out}


def _beside_raw(
    label: str,
    link: Link | None,
    size: int,
    repeat: int,
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    sidecars: Callable[[], list[dict[str, Any]]],
) -> tuple[list[dict[str, Any]], float]:
    """Run the phase ``sidecars`` between two raw-socket runs moving ``size`` bytes ``repeat`` times; append the
    raw row (the mean of the two runs' medians) and the phase's first row, with its ``vs_raw``.

    Returns:
        The phase's rows and the raw socket's rate.
    """
    log.info("%s: raw socket moves %s x %d, before and after the sidecars", label, format_bytes(size), repeat)
    before = raw_socket_transfer(size, repeat=repeat, link=link, timeout=args.timeout)
    rows = sidecars()
    after = raw_socket_transfer(size, repeat=repeat, link=link, timeout=args.timeout)
    raw = (before + after) / 2
    rows[0]["vs_raw"] = rows[0]["stream_Bps"] / raw
    results.append(
        {
            "run": f"{label} raw socket",
            "state_bytes": size,
            "stream_Bps": raw,
            "vs_raw": 1.0,
            "raw_before_Bps": before,
            "raw_after_Bps": after,
        }
    )
    results.append(rows[0])
    return rows, raw


def _row(name: str, out: dict[str, Any], chunk: str | None) -> dict[str, Any]:
    nbytes = out["state_bytes"]
    e2e = statistics.median(out["seconds"])
    stream = statistics.median(t - s for t, s in zip(out["seconds"], out["stage_seconds"], strict=True))
    return {
        "run": name,
        "state_bytes": nbytes,
        "stream_Bps": nbytes / stream,
        "e2e_Bps": nbytes / e2e,
        "e2e_seconds": e2e,
        "stage_seconds": statistics.median(out["stage_seconds"]),
        "receiver_rss_bytes": out["receiver_rss_bytes"],
        "sender_rss_bytes": out["sender_rss_bytes"],
        "chunk": chunk or "default",
        "replications": out["replications"],
        "seconds": out["seconds"],
    }


def _sidecar_rows(
    workdir: str,
    label: str,
    link: Link | None,
    codec: str,
    args: argparse.Namespace,
    drivers: list[list[str]],
    security: str | None = None,
) -> list[dict[str, Any]]:
    """A coordinator, sidecars A and B (A's buddy) and, one after the other, ``drivers`` on A; with
    ``security`` (a ``--data-security`` mode) every process has a secret, else none does.

    Returns one result row per driver (:func:`_row`): its JSON plus both sidecars' RSS after it and the
    coordinator's re-replication tasks during it.
    """
    phase_dir = os.path.join(workdir, label)
    host_a, host_b = (link.addr_a, link.addr_b) if link else ("127.0.0.1", "127.0.0.1")
    prefix_a = link.exec_argv(link.ns_a, []) if link else []
    prefix_b = link.exec_argv(link.ns_b, []) if link else []
    net = ["--insecure"] if link else []  # namespace addresses are routable; plaintext as the raw socket is
    side_flags = [
        "--codec",
        codec,
        "--max-rate",
        UNPACED,
        *net,
        *(["--chunk", args.chunk] if args.chunk else []),
    ]
    if security:
        side_flags += ["--data-security", security]
    env = {"SNAPSHOTD_SECRET": _BENCH_SECRET if security else ""}
    with LocalCluster(
        phase_dir,
        replicas=1,
        heartbeat_interval=_HEARTBEAT_INTERVAL,
        heartbeat_timeout=args.heartbeat_timeout,
        env=env,
    ) as cluster:
        _start_coordinator(cluster, f"tcp://{host_a}:0", net, prefix_a)
        sender = cluster.start_sidecar("A", *side_flags, prefix=prefix_a, data_bind=f"tcp://{host_a}:0")
        receiver = cluster.start_sidecar("B", *side_flags, prefix=prefix_b, data_bind=f"tcp://{host_b}:0")
        assert cluster.coordinator is not None
        outs = []
        for i, driver in enumerate(drivers):
            log.info("%s: driver %s", label, " ".join(driver))
            job = f"bench-{label}-{i}-{uuid.uuid4().hex[:6]}"
            argv = [
                *prefix_a,
                sys.executable,
                "-m",
                "snapshotd.bench.drivers",
                *driver,
                "--job",
                job,
                "--sidecar",
                cluster.ipc_path("A"),
                "--timeout",
                str(args.timeout),
            ]
            before = _replications(cluster.coordinator.log_path)
            try:
                out = _run_driver(argv, os.path.join(phase_dir, f"driver-{i}.log"), args.timeout + 30)
            except RuntimeError as exc:
                for p in (sender, receiver):
                    exc.add_note(f"--- {p.name} log:\n{cluster.tail(p, 15)}")
                raise
            for p in (sender, receiver):
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited during {label}; log:\n{cluster.tail(p)}")
            out["receiver_rss_bytes"] = _rss_bytes(receiver.pid)
            out["sender_rss_bytes"] = _rss_bytes(sender.pid)
            out["replications"] = _replications(cluster.coordinator.log_path) - before
            outs.append(_row(f"{label} sidecar", out, args.chunk))
    return outs


def _replications(coordinator_log: str) -> int:
    """Re-replication tasks the coordinator has logged so far."""
    with open(coordinator_log, errors="replace") as f:
        return sum("replicating to" in line for line in f)


def _start_coordinator(cluster: LocalCluster, bind: str, extra: list[str], prefix: list[str]) -> None:
    """``cluster.start_coordinator(bind, *extra)``, in a namespace when ``prefix`` is ``ip netns exec NS``.

    LocalCluster.start_coordinator takes no prefix (start_sidecar does), so with one this builds the same
    ``snapshotd coordinator`` command line and starts it through the cluster, which still stops it on close.
    """
    if not prefix:
        cluster.start_coordinator(bind, *extra)
        return
    argv = [
        "coordinator",
        "--bind",
        bind,
        "--replicas",
        str(cluster.replicas),
        "--heartbeat-interval",
        f"{cluster.heartbeat_interval}s",
        "--heartbeat-timeout",
        f"{cluster.heartbeat_timeout}s",
        *extra,
    ]
    ready = re.compile(r"snapshotd coordinator ready (?P<endpoint>\S+)")
    cluster.coordinator = cluster._start("coordinator", argv, ready, prefix=prefix)


def _run_driver(argv: list[str], log_path: str, timeout: float) -> dict[str, Any]:
    """Run a driver process to completion; its last stdout line as JSON (stderr goes to ``log_path``).

    Raises:
        RuntimeError: it failed or ran past ``timeout`` (it is killed then), with the end of its log.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as err:
        try:
            proc = subprocess.run(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"driver ran past {timeout:.0f} s; log:\n{_tail(log_path)}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"driver exited with {proc.returncode}; log:\n{_tail(log_path)}")
    lines = proc.stdout.decode(errors="replace").strip().splitlines()
    if not lines:
        raise RuntimeError(f"driver printed no result; log:\n{_tail(log_path)}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _tail(path: str, lines: int = 30) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def _rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` in bytes.

    Raises:
        RuntimeError: the process or its VmRSS line is gone.
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise RuntimeError(f"cannot read the memory of process {pid}: {exc}") from exc
    raise RuntimeError(f"process {pid} has no VmRSS (it exited)")
