"""What ``snapshotd-bench live``'s trials share (:mod:`.live` and :mod:`.shrink`): a node of their own torchrun, the
files their ranks write, and the point at which a trial kills its second node."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from typing import Any

from snapshotd.harness.cluster import LocalCluster
from snapshotd.status import fetch_status

from .nodes import EmulatedNode
from .torchrun_trial import TORCHRUN_ENV

__all__ = ["finish", "read_json", "reached_kill_point", "torchrun_node"]


def torchrun_node(
    cluster: LocalCluster,
    workdir: str,
    name: str,
    addr: str,
    *,
    trainer: str,
    per_node: int,
    script_args: Sequence[str],
) -> EmulatedNode:
    """A node: its sidecar and a torchrun agent of its own (``--standalone --nnodes 1``, one node per torchrun
    job, as live mode runs; up to 3 restarts of its workers), running ``python -m <trainer> <script_args>``."""
    return EmulatedNode(
        cluster,
        name,
        addr,
        torchrun_args=[
            *("--standalone", "--nnodes", "1", "--nproc-per-node", str(per_node)),
            *("--max-restarts", "3", "--monitor-interval", "0.1"),
        ],
        script="-m",
        script_args=[trainer, *script_args],
        env=dict(TORCHRUN_ENV),
        workdir=workdir,
    )


def read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return dict(json.load(f))


def reached_kill_point(
    cluster: LocalCluster, nodes: Sequence[EmulatedNode], out: str, job: str, rank: int, kill_after: int
) -> bool:
    """Whether ``rank`` (the second node's last) completed step ``kill_after`` and step ``kill_after - 1`` is
    durable for ``job``.

    Raises:
        RuntimeError: an agent of ``nodes`` exited before the kill.
    """
    for node in nodes:
        if node.agent.poll() is not None:
            raise RuntimeError(f"{node.name}'s agent exited with {node.agent.returncode} before the kill")
    try:
        step = int(read_json(os.path.join(out, f"rank{rank}.progress"))["step"])
    except (OSError, ValueError, KeyError):
        return False
    if step < kill_after:
        return False
    with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
        jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=1.0)["jobs"]
        return any(j["job"] == job and j["durable"] >= kill_after - 1 for j in jobs)
    return False


def finish(nodes: Sequence[EmulatedNode], out: str, world: int, timeout: float) -> list[dict[str, Any]]:
    """Wait for the survivors' agent (the first node's) and the replacement's (the last node's) to end; the
    ranks' results, in rank order.

    Raises:
        RuntimeError: one of the two agents exited non-zero, or did not end within ``timeout``.
    """
    for node in (nodes[0], nodes[-1]):
        code = node.wait(timeout)
        if code != 0:
            raise RuntimeError(f"{node.name}'s agent exited with {code}; see {node.log_path}")
    return [read_json(os.path.join(out, f"rank{r}.json")) for r in range(world)]
