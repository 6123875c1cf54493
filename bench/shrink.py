"""The ``shrink`` mode of ``snapshotd-bench live``: zero-wait recovery over virtual ranks.

The same job as the other modes (the GPT of :mod:`snapshotd.harness.workloads`, two torchrun nodes, the second
SIGKILLed once it completed ``kill_after`` steps) runs as :mod:`.elastic_trainer`: ``2 x ranks_per_node`` virtual
ranks in exact mode, ``--step-delay`` idle seconds per virtual rank carried (the accelerator's share of each
micro-batch). The survivors carry the lost node's virtual ranks at once; the replacement node is started cold
right after the loss and joins at a step boundary once its processes are up.

The row's phases run from the kill to the first step every survivor completed after the loss (as for the other
modes), and it adds what only this mode has: the survivors' throughput while shrunk over their throughput before
the loss (``shrunk_throughput_ratio``; ``P / W`` is what the work allows), how long after the kill the replacement
joined (``joined_after_seconds``), and the pause that cost the survivors (``grow_pause_seconds``: making the step
durable, forming the larger group, restoring) beside a shrunk step's time (``shrunk_step_seconds``, the median).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Any

from snapshotd.harness.cluster import LocalCluster
from snapshotd.harness.demo import wait_for

from .live_trials import finish, reached_kill_point, read_json, torchrun_node
from .nodes import EmulatedNode

__all__ = ["run_shrink_trial"]


def _node(
    cluster: LocalCluster,
    workdir: str,
    name: str,
    addr: str,
    index: int,
    per_node: int,
    script_args: list[str],
) -> EmulatedNode:
    """A node of :mod:`.elastic_trainer`'s processes, those of node ``index``."""
    return torchrun_node(
        cluster,
        workdir,
        name,
        addr,
        trainer="snapshotd.bench.elastic_trainer",
        per_node=per_node,
        script_args=["--node-index", str(index), *script_args],
    )


def run_shrink_trial(
    cluster: LocalCluster, workdir: str, store: str, cfg: Any, *, per_node: int, tag: str
) -> dict[str, Any]:
    """Run the elastic job, lose the second node, start its replacement cold; the table row.

    Raises:
        TimeoutError: the job did not reach ``kill_after`` or did not finish within ``cfg.timeout``.
        RuntimeError: an agent exited non-zero; the survivors did not shrink and grow once each.
    """
    name = f"shrink{per_node}-{tag}"
    out = os.path.join(workdir, name)
    os.makedirs(out)
    world = 2 * per_node
    job = f"live-{name}"
    script_args = [
        *("--store", store, "--job", job, "--world", str(world), "--steps", str(cfg.steps)),
        *("--params", str(cfg.params), "--step-delay", str(cfg.step_delay), "--pg-timeout", "10"),
        *("--out", out, "--progress", out, "--until-grown"),
    ]
    nodes = [
        _node(cluster, workdir, f"{name}-{x}", f"127.0.0.{2 + i}", i, per_node, script_args)
        for i, x in enumerate("AB")
    ]
    try:
        wait_for(
            lambda: reached_kill_point(cluster, nodes, out, job, world - 1, cfg.kill_after),
            cfg.timeout,
            f"step {cfg.kill_after}, durable",
        )
        pids = {r: read_json(os.path.join(out, f"rank{r}.progress"))["pid"] for r in range(per_node)}
        killed_at = nodes[1].kill()
        nodes.append(_node(cluster, workdir, f"{name}-C", "127.0.0.4", 1, per_node, script_args))
        results = finish(nodes, out, world, cfg.timeout)
    finally:
        for node in nodes:
            with contextlib.suppress(RuntimeError):
                node.stop()
    return _row(per_node, results, pids, killed_at, cfg.kill_after)


def _interval(done_at: dict[str, float], first: int, last: int) -> float:
    """The median seconds between completing consecutive steps ``first .. last``."""
    gaps = [done_at[str(s)] - done_at[str(s - 1)] for s in range(first + 1, last + 1)]
    return statistics.median(gaps) if gaps else float("nan")


def _row(
    per_node: int, results: list[dict[str, Any]], pids: dict[int, int], killed_at: float, kill_after: int
) -> dict[str, Any]:
    survivors = results[:per_node]
    if any(len(r["recoveries"]) != 1 or len(r["growths"]) != 1 for r in survivors):
        raise RuntimeError("shrink: a survivor did not shrink and grow exactly once")
    recoveries = [r["recoveries"][0] for r in survivors]
    step = recoveries[0]["step"]
    failed = min(rec["failed_at"] for rec in recoveries)
    grouped = max(rec["recovered_at"] - rec["restore_s"] for rec in recoveries)
    restored = max(rec["recovered_at"] for rec in recoveries)
    first = max(r["done_at"][str(step + 1)] for r in survivors)
    grew = survivors[0]["growths"][0]["step"]
    done_at = survivors[0]["done_at"]
    shrunk_step = _interval(done_at, step + 1, grew)
    steps = {max(map(int, r["done_at"]), default=r["start_step"]) for r in results}
    if len(steps) != 1 or len({r["epoch"] for r in results}) != 1:
        raise RuntimeError(f"shrink x{per_node}: the processes ended apart (steps {steps})")
    return {
        "mode": "shrink",
        "ranks_per_node": per_node,
        "step_restored": step,
        "survivors_kept": sum(r["pid"] == pids[r["rank"]] for r in survivors),
        "detection_seconds": failed - killed_at,
        "group_seconds": grouped - failed,
        "restore_seconds": restored - grouped,
        "first_step_seconds": first - restored,
        "total_seconds": first - killed_at,
        "epochs": len({r["epoch"] for r in results}),
        "shrunk_step_seconds": shrunk_step,
        "shrunk_throughput_ratio": _interval(done_at, 2, kill_after) / shrunk_step,
        "joined_after_seconds": min(r["growths"][0]["at"] for r in survivors) - killed_at,
        "grow_pause_seconds": max(r["growths"][0]["seconds"] for r in survivors),
    }
