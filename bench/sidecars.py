"""``snapshotd-bench overhead --scenario sidecars``: the sidecars' own CPU per snapshot, with no training beside it.

A coordinator and two sidecars on loopback, started as headroom's (``--sidecar-nice``, ``--max-rate``), and one
rank in this process holding headroom's state (the same model's parameters and optimizer moments, after one
training step). ``--rounds`` times: an idle block of :data:`IDLE_SECONDS`, then a block of ``--steps`` steps, a
snapshot taken every :data:`PERIOD` seconds (headroom's step on a 2-core machine: the streams are paced to it as
to a training step) and the block waited on until its last step is durable. The sidecars' CPU is read from
``/proc`` around each block; a snapshot block's, beyond the idle rate of every idle block pooled, is divided by the
snapshots the block started.

With no training beside them, the sidecars' figure moves little from run to run, where headroom's moves by a
third: this is the scenario to tell two builds of the data path apart, run alternately. Beside it, the run
measures the least any checked transfer of the same bytes costs, the *floor*: one loopback transfer between two
threads (``minimum_wire_ms``) and two xxh3 passes (``checksum_ms``; the sender's, and the receiver's check).

Summary keys: ``sidecars_state_bytes`` (the parameters' and moments' bytes); ``sidecars_cpu_ms_per_snapshot``,
``sidecars_user_ms_per_snapshot`` and ``sidecars_system_ms_per_snapshot`` (each the median over blocks, taken
apart: user + system need not sum to the whole); ``sidecars_idle_cores`` (the pooled idle rate, user and system);
``sidecars_floor_ms`` and ``sidecars_vs_floor``; ``sidecars_started``, ``sidecars_skipped`` and
``sidecars_failed`` (snapshots the rank started, skipped and saw fail, as its ``SnapshotStats`` count them).
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import numpy as np

from snapshotd.harness.cluster import LocalCluster

from .baselines import process_cpu_times

__all__ = ["IDLE_SECONDS", "PERIOD", "run_sidecars"]

PERIOD = 0.3
"""Seconds between snapshots."""
IDLE_SECONDS = 2.0
"""Seconds of each idle block."""
_TIMEOUT = 60.0


def _cpu(pids: list[int]) -> tuple[float, float]:
    """The sidecars' (user, system) CPU seconds so far.

    Raises:
        RuntimeError: a sidecar is gone.
    """
    user = system = 0.0
    for pid in pids:
        times = process_cpu_times(pid)
        if times is None:
            raise RuntimeError(f"sidecar process {pid} is gone")
        user, system = user + times[0], system + times[1]
    return user, system


def run_sidecars(args: argparse.Namespace, workdir: str) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Measure the sidecars scenario (see the module docstring): its rows (one per block), its summary and the
    state's bytes.

    Raises:
        RuntimeError: a block's last snapshot did not become durable within a minute.
    """
    import torch

    from snapshotd.client import Snapshotter
    from snapshotd.harness.workloads import GPT, config_for_params, make_batch, make_optimizer, train_step

    torch.set_num_threads(1)
    cfg = config_for_params(args.params)
    model = GPT(cfg, seed=0)
    opt = make_optimizer(model)
    train_step(model, opt, *make_batch(cfg, args.batch, torch.Generator().manual_seed(1)))
    state = {"model": model, "optim": opt}
    tensors: list[torch.Tensor] = [*model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flags = ["--nice", str(args.sidecar_nice), *(("--max-rate", args.max_rate) if args.max_rate else ())]
    blocks: list[tuple[int, float, float, float]] = []  # (snapshots started, seconds, user, system)
    idle = [0.0, 0.0, 0.0]  # seconds, user, system
    with LocalCluster(workdir, replicas=1, heartbeat_interval=0.5, heartbeat_timeout=5.0) as cluster:
        cluster.start_coordinator()
        cluster.start_sidecar("A", *flags)
        cluster.start_sidecar("B", *flags)
        pids = [p.pid for p in cluster.sidecars.values()]
        job = f"sidecars-{uuid.uuid4().hex[:8]}"
        with Snapshotter(state, job=job, rank=0, world_size=1, sidecar=cluster.ipc_path("A")) as snap:
            snap.restore(timeout=_TIMEOUT)
            step = 0
            for _ in range(3):  # the slots' and the buddy's buffers touched once
                step += 1
                snap.capture(step)
                snap.flush(step, _TIMEOUT)
            started0, skipped0, failed0 = snap.stats.started, snap.stats.skipped, snap.stats.failed
            for _ in range(args.rounds):
                c0, t0 = _cpu(pids), time.perf_counter()
                time.sleep(IDLE_SECONDS)
                c1, t1 = _cpu(pids), time.perf_counter()
                idle = [idle[0] + t1 - t0, idle[1] + c1[0] - c0[0], idle[2] + c1[1] - c0[1]]
                before = snap.stats.started
                for _ in range(args.steps):
                    step += 1
                    due = time.perf_counter() + PERIOD
                    snap.capture(step)
                    time.sleep(max(0.0, due - time.perf_counter()))
                if not snap.flush(step, _TIMEOUT):
                    raise RuntimeError(f"step {step} was not durable within {_TIMEOUT:.0f} s: {snap.stats}")
                c2, t2 = _cpu(pids), time.perf_counter()
                blocks.append((snap.stats.started - before, t2 - t1, c2[0] - c1[0], c2[1] - c1[1]))
            stats = snap.stats
    idle_user, idle_system = idle[1] / idle[0], idle[2] / idle[0]
    rows = []
    for block, (started, seconds, user, system) in enumerate(blocks):
        user_ms = (user - idle_user * seconds) / max(1, started) * 1e3
        system_ms = (system - idle_system * seconds) / max(1, started) * 1e3
        rows.append(
            {
                "scenario": "sidecars",
                "block": block,
                "snapshots": started,
                "user_ms": user_ms,
                "system_ms": system_ms,
                "cpu_ms": user_ms + system_ms,
            }
        )
    summary = {
        "sidecars_state_bytes": nbytes,
        "sidecars_cpu_ms_per_snapshot": float(np.median([r["cpu_ms"] for r in rows])),
        "sidecars_user_ms_per_snapshot": float(np.median([r["user_ms"] for r in rows])),
        "sidecars_system_ms_per_snapshot": float(np.median([r["system_ms"] for r in rows])),
        "sidecars_idle_cores": [idle_user, idle_system],
        "sidecars_started": stats.started - started0,
        "sidecars_skipped": stats.skipped - skipped0,
        "sidecars_failed": stats.failed - failed0,
    }
    return rows, summary, nbytes
