"""Live recovery against the launcher's full restart: ``snapshotd-bench live``.

A job of :mod:`.live_trainer` runs on two emulated nodes (a sidecar each, ``--ranks-per-node`` rank processes
each, a coordinator and the rendezvous store of ``examples/torchrun_ddp/rdzv_store.py`` beside them on
loopback). Mid-run the second node dies (its sidecar and ranks SIGKILLed together, its shared memory gone) and a
replacement node starts (a sidecar, then the same ranks, as a scheduler would start them). The same job runs
twice in one invocation:

- ``restart``: every rank meets the loss as a full restart does: the survivors exit (``--on-loss exit``) and
  their launcher starts them again, as torchrun restarts every worker of a node; every rank then starts a
  process, imports torch, forms the group, builds the model and restores.
- ``live``: the survivors ``recover()`` in their processes; only the replacement's ranks start.

For each, the time from the kill to the first step every rank completed after recovery, split into detection
(the kill to the first survivor's failure surfacing), membership and group (from there to the new group formed on
every rank: in ``restart``, process start, imports and group formation; in ``live``, waiting for the
replacement and forming the group), rollback or restore (the slowest rank's), and the first step. With
``--ranks-per-node`` several sizes (2, 4, 8 by default) show how each phase grows with the survivors. The summary
(``--json``) holds ``full_restart_seconds``, ``live_seconds`` and ``live_speedup`` for the first size.

:class:`LiveRanks` (the rank processes of one job, node by node) is also what the live-recovery test runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from snapshotd.local_cluster import held_interrupts

__all__ = ["LiveRanks", "STORE_SCRIPT"]

STORE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "torchrun_ddp",
                            "rdzv_store.py")  # fmt: skip
"""The example's standalone rendezvous store, which live mode keeps its membership in."""


class LiveRanks:
    """The rank processes of one live-mode job: node ``i`` runs ranks ``i * per_node`` to ``(i + 1) * per_node - 1``.

    Each rank runs :mod:`.live_trainer` with ``flags`` (besides rank, world, store, job, sidecar, out and
    progress); its output goes to ``workdir/<tag>-rank<R>.log``, its result to ``<tag>-rank<R>.json``. Starting a
    node's ranks again (a replacement, or the launcher's restart) appends to the same log and result paths.
    """

    def __init__(self, workdir: str, *, tag: str, job: str, store: str, nodes: int, per_node: int,
                 flags: Sequence[str] = ()) -> None:  # fmt: skip
        self.workdir, self.tag, self.job, self.store = workdir, tag, job, store
        self.nodes, self.per_node, self.world = nodes, per_node, nodes * per_node
        self.flags = list(flags)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def ranks(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.workdir, f"{self.tag}-rank{rank}.{kind}")

    def start_node(self, node: int, ipc: str) -> None:
        """Start node ``node``'s ranks, talking to the sidecar at ``ipc``."""
        for rank in self.ranks(node):
            argv = [sys.executable, "-m", "snapshotd.bench.live_trainer", "--rank", str(rank), "--world",
                    str(self.world), "--store", self.store, "--job", self.job, "--sidecar", ipc,
                    "--out", self.path(rank, "json"), "--progress", self.path(rank, "progress"), *self.flags]  # fmt: skip
            with open(self.path(rank, "log"), "ab") as log, held_interrupts():  # kill() stops what procs holds
                self.procs[rank] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL)  # fmt: skip

    def node_procs(self, node: int) -> list[subprocess.Popen[bytes]]:
        return [self.procs[r] for r in self.ranks(node)]

    def progress(self, rank: int) -> dict[str, Any]:
        """The rank's last completed ``step``, when (``time``) and by which ``pid``; step 0 before any."""
        try:
            with open(self.path(rank, "progress")) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            return {"step": 0, "time": 0.0, "pid": 0}

    def log_tail(self, rank: int, lines: int = 30) -> str:
        try:
            with open(self.path(rank, "log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def failed(self) -> dict[int, int]:
        """Ranks that exited non-zero, with their codes."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() not in (None, 0)}

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for every rank to finish; their results in rank order.

        Raises:
            RuntimeError: a rank exited non-zero or did not finish in time (every rank killed; its log tail given).
        """
        deadline = time.monotonic() + timeout
        for rank, proc in sorted(self.procs.items()):
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"{self.tag}: rank {rank} did not finish within {timeout:.0f} s:\n"
                                   f"{self.log_tail(rank)}") from None  # fmt: skip
            if code != 0:
                self.kill()
                raise RuntimeError(f"{self.tag}: rank {rank} exited with {code}:\n{self.log_tail(rank)}")
        results = []
        for rank in range(self.world):
            with open(self.path(rank, "json")) as f:
                results.append(json.load(f))
        return results

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
