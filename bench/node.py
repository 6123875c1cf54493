"""``snapshotd-bench overhead --scenario node``: the rate one node's snapshots sustain, and what it costs per GB.

``--ranks`` ranks on node A snapshot at once, each its own ``12 * --params`` bytes (fp32 parameters and two Adam
moments: the state of the training scenarios, without the training), back to back: each captures its next step
as soon as its previous one is durable on node B (:mod:`.drivers`' transport driver, one job per rank), so the
streams of the node are never short of work and what is measured is what the node sustains, not what training
asks of it. The sidecars run with a fixed ``--max-rate`` far above any link (or the ``--max-rate`` given): the
pacer's ``auto`` mode spreads each stream over two thirds of its rank's step on purpose, and a rank's step here
is its stream.

Summary keys (a run of this scenario alone): ``node_ranks``, ``node_state_bytes_per_rank``, ``node_durable_Bps``
(the ranks' state bytes over the median time each took from ``capture()`` to durable, summed over the ranks,
which streamed side by side), ``node_raw_socket_Bps`` (one plain TCP connection moving the same bytes on the same
machine, just after; :func:`~.baselines.raw_socket_transfer`), ``node_ratio`` (their quotient), and
``node_sidecar_user_ms_per_GB`` / ``node_sidecar_system_ms_per_GB`` (both sidecars' CPU while the ranks ran, per GB
made durable; their idle heartbeats, a few thousandths of a core, are left in).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import numpy as np

from snapshotd.harness.cluster import LocalCluster

from .baselines import process_cpu_times, raw_socket_transfer
from .drivers import UNPACED

__all__ = ["run_node"]


def _cpu(pids: list[int]) -> tuple[float, float]:
    times = [process_cpu_times(pid) or (0.0, 0.0) for pid in pids]
    return sum(t[0] for t in times), sum(t[1] for t in times)


def run_node(args: argparse.Namespace, workdir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measure the node scenario (see the module docstring): its result row and summary.

    Raises:
        RuntimeError: a rank failed (with its output's tail).
    """
    size = max(4, 12 * args.params // 4 * 4)
    repeat = max(3, args.steps // 2)
    flags = ["--max-rate", args.max_rate or UNPACED, "--nice", str(args.sidecar_nice)]
    with LocalCluster(
        os.path.join(workdir, "node"), replicas=1, heartbeat_interval=0.5, heartbeat_timeout=8.0
    ) as cluster:
        cluster.start_coordinator()
        pids = [cluster.start_sidecar(node, *flags).pid for node in ("A", "B")]
        procs = []
        for rank in range(args.ranks):
            argv = [
                sys.executable,
                "-m",
                "snapshotd.bench.drivers",
                "transport",
                "--size",
                str(size),
                "--repeat",
                str(repeat),
                "--settle",
                "2",
                "--job",
                f"node-{rank}-{uuid.uuid4().hex[:6]}",
                "--sidecar",
                cluster.ipc_path("A"),
                "--timeout",
                str(args.timeout),
            ]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        c0 = _cpu(pids)
        outputs = [proc.communicate(timeout=args.timeout)[0].decode() for proc in procs]
        c1 = _cpu(pids)
    results = []
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode != 0:
            raise RuntimeError(f"node rank {rank} exited with {proc.returncode}:\n{out[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    durable_Bps = sum(size / float(np.median(r["seconds"])) for r in results)
    moved = sum(r["stats"]["bytes"] / max(1, r["stats"]["started"]) * r["stats"]["durable"] for r in results)
    used = [b - a for a, b in zip(c0, c1, strict=True)]
    raw_Bps = raw_socket_transfer(size * args.ranks, repeat=3, timeout=args.timeout)
    summary = {
        "node_ranks": args.ranks,
        "node_state_bytes_per_rank": size,
        "node_durable_Bps": durable_Bps,
        "node_raw_socket_Bps": raw_Bps,
        "node_ratio": durable_Bps / raw_Bps,
        "node_sidecar_user_ms_per_GB": used[0] * 1e3 / (moved / 1e9),
        "node_sidecar_system_ms_per_GB": used[1] * 1e3 / (moved / 1e9),
    }
    row = {
        "scenario": "node",
        "variant": "snapshotd",
        "interval": 1,
        "runs": args.ranks,
        "moved_per_step_bytes": size,
        "moved_to": "node B (tcp)",
    }
    return [row], summary
