"""Live recovery against the launcher's full restart: ``snapshotd-bench live``.

A job of :mod:`.live_trainer` runs on two emulated nodes, each a sidecar and a torchrun agent of its own
(``--standalone --nnodes 1``, ``--ranks-per-node`` workers), beside a coordinator and the rendezvous store of
``snapshotd rdzv-store`` on loopback. Mid-run the second node dies (its sidecar, agent and workers
SIGKILLed together, its shared memory gone) and a replacement node takes its seat: the first two nodes are placed
by their index (``--node-index``), the replacement asks snapshotd for a seat (``--nodes``) and gets the lost one.
For each size the same job runs once per ``--modes``:

- ``restart``: the launcher's full restart. The survivors exit at the loss (``--on-loss exit``), their torchrun
  restarts its workers, and every rank starts a process, imports torch, builds the model, forms the group and
  restores.
- ``live``: the survivors ``recover()`` in their processes; only the replacement's ranks start.
- ``restart+spare`` / ``live+spare``: the same, with the replacement node started ahead (a warm spare: its
  ranks wait for a seat with their model built, and take whichever comes free), which takes the replacement's
  own start off the recovery; otherwise the replacement starts after the loss, as a scheduler would start it.
- ``shrink``: the job over virtual ranks in exact mode (:mod:`.shrink`): the survivors carry the lost virtual
  ranks at once and the replacement, started after the loss, joins at a step boundary.

Each row splits the time from the kill to the first step every rank completed after recovery into detection
(the kill to the first survivor seeing the loss), group (from there to the new group formed on every rank: a
full restart's process starts, imports and model builds, or waiting for the replacement), restore (the
slowest rank's rollback or restore, DDP's set-up on the new group included) and the first step. With several
``--ranks-per-node`` (2, 4, 8 by default) it shows how each phase grows with the survivors;
``survivor_work_seconds`` is a survivor's own part of a live recovery (moving DDP and rolling back: the slowest
survivor's wall time, waits for the other ranks included) and ``survivor_cpu_seconds`` the CPU time its process
spent in ``recover()`` (every thread: what the live path costs a survivor by itself, without the waits). The
summary (``--json``) holds ``full_restart_seconds``, ``live_seconds`` and ``live_speedup`` for the first size,
the same for the spare modes, and for shrink ``shrink_seconds``, ``shrink_speedup`` (the full restart's time over
shrink's), ``grow_pause_seconds`` beside ``shrunk_step_seconds``, ``shrunk_throughput_ratio``, and ``exact_reduction_cost_ratio`` with the two
step times behind it (:mod:`.reduction`: exact-mode and DDP steps alternating in one job of the first size).

:class:`LiveRanks` (the rank processes of one job, started directly, node by node) is what the live-recovery
test runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Sequence
from typing import Any

from snapshotd.harness.cluster import LocalCluster, held_interrupts
from snapshotd.harness.demo import wait_for
from snapshotd.harness.processes import RankProcess, start_module

from .live_trials import finish, reached_kill_point, read_json, torchrun_node
from .nodes import EmulatedNode, RendezvousStore
from .reduction import measure_reduction_cost
from .report import Report, phases_plot, scratch_dir
from .shrink import run_shrink_trial

log = logging.getLogger(__name__)

__all__ = ["LiveConfig", "LiveRanks", "MODES", "add_arguments", "run", "run_trial"]


class LiveRanks:
    """The rank processes of one live-mode job, started directly, node by node (each node has a label).

    A node started with an ``index`` runs ranks ``index * per_node`` to ``(index + 1) * per_node - 1``; one
    started without asks snapshotd for its seat (``--nodes``, with ``$LOCAL_RANK`` and ``$LOCAL_WORLD_SIZE`` set as
    torchrun sets them). Each rank runs ``trainer`` (:mod:`.live_trainer`, or :mod:`.elastic_trainer`) with ``flags`` (besides its placement, store, job,
    sidecar, out and progress); its output goes to ``workdir/<tag>/<label>-<local rank>.log``, its result and
    progress to ``workdir/<tag>/rank<R>.json`` and ``.progress``, so a replacement's ranks write where the lost
    ones wrote.
    """

    def __init__(
        self,
        workdir: str,
        *,
        tag: str,
        job: str,
        store: str,
        nodes: int,
        per_node: int,
        flags: Sequence[str] = (),
        trainer: str = "snapshotd.bench.live_trainer",
    ) -> None:
        self.dir = os.path.join(workdir, tag)
        self.trainer = trainer
        os.makedirs(self.dir, exist_ok=True)
        self.tag, self.job, self.store = tag, job, store
        self.nodes, self.per_node, self.world = nodes, per_node, nodes * per_node
        self.flags = list(flags)
        self.procs: dict[str, list[RankProcess]] = {}  # label -> its ranks' processes, running or done

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.dir, f"rank{rank}.{kind}")

    def start_node(
        self,
        label: str,
        ipc: str,
        index: int | None = None,
        *,
        local: Sequence[int] | None = None,
        flags: Sequence[str] = (),
    ) -> None:
        """Start node ``label``'s ranks, talking to the sidecar at ``ipc``: those of ``index``, or of the seat
        snapshotd gives the node; only the local ranks ``local`` (default all), with ``flags`` besides the job's
        (one of a node's processes restarted, or given a fault, runs as a label of its own)."""
        self.procs[label] = []
        for local_rank in range(self.per_node) if local is None else local:
            place = (
                ["--nodes", str(self.nodes)]
                if index is None
                else ["--rank", str(index * self.per_node + local_rank), "--world", str(self.world)]
            )
            argv = [
                *place,
                "--store",
                self.store,
                "--job",
                self.job,
                "--sidecar",
                ipc,
                "--out",
                self.dir,
                "--progress",
                self.dir,
                *self.flags,
                *flags,
            ]
            env = {**os.environ, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.per_node)}
            with held_interrupts():
                self.procs[label].append(
                    start_module(
                        self.trainer,
                        argv,
                        env=env,
                        output=os.path.join(self.dir, f"{label}-{local_rank}.log"),
                    )
                )

    def lose(self, label: str) -> list[RankProcess]:
        """Node ``label``'s processes, no longer waited for (the caller kills them with the node)."""
        return self.procs.pop(label)

    def ranks_of(self, label: str) -> list[int]:
        """The ranks node ``label``'s processes run, as their progress files tell (after their first step)."""
        pids = {p.pid for p in self.procs[label]}
        return [r for r in range(self.world) if self.progress(r)["pid"] in pids]

    def progress(self, rank: int) -> dict[str, Any]:
        """The rank's last completed ``step``, when (``time``) and by which ``pid``; step 0 before any."""
        try:
            with open(self.path(rank, "progress")) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            return {"step": 0, "time": 0.0, "pid": 0}

    def log_tail(self, label: str, lines: int = 30) -> str:
        """The end of the logs of node ``label``'s ranks."""
        out = []
        for path in sorted(glob.glob(os.path.join(self.dir, f"{label}-*.log"))):
            with open(path, errors="replace") as f:
                out.append(f"--- {os.path.basename(path)}\n" + "".join(f.readlines()[-lines:]))
        return "".join(out)

    def failed(self) -> dict[str, list[int]]:
        """Nodes with a rank that exited non-zero, with the exit codes."""
        codes = {
            label: [p.returncode for p in procs if p.poll() not in (None, 0)]
            for label, procs in self.procs.items()
        }
        return {label: c for label, c in codes.items() if c}

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for every rank to finish; their results in rank order.

        Raises:
            RuntimeError: a rank exited non-zero or did not finish in time (every rank killed; its node's log tail
                given).
        """
        deadline = time.monotonic() + timeout
        for label, procs in sorted(self.procs.items()):
            for proc in procs:
                try:
                    code = proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.kill()
                    raise RuntimeError(
                        f"{self.tag}: node {label} did not finish within {timeout:.0f} s:\n"
                        f"{self.log_tail(label)}"
                    ) from None
                if code != 0:
                    self.kill()
                    raise RuntimeError(
                        f"{self.tag}: a rank of node {label} exited with {code}:\n{self.log_tail(label)}"
                    )
        results = []
        for rank in range(self.world):
            with open(self.path(rank, "json")) as f:
                results.append(json.load(f))
        return results

    def kill(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)


# -- the benchmark


MODES = ("restart", "live", "restart+spare", "live+spare", "shrink")
"""How the job meets the loss: the launcher restarts every rank, or the survivors recover live; ``+spare``: the
replacement node was started ahead (a warm spare, its ranks waiting in the job's next epoch with their model
built), else the scheduler starts it after the loss; ``shrink``: the survivors carry the lost virtual ranks
(:mod:`.shrink`) and the replacement, started after the loss, joins when it is ready."""


@dataclasses.dataclass(frozen=True)
class LiveConfig:
    """One benchmark run's parameters (see the module docstring)."""

    ranks_per_node: tuple[int, ...] = (2, 4, 8)
    modes: tuple[str, ...] = MODES
    steps: int = 40
    spare_steps: int = 200
    kill_after: int = 5
    step_delay: float = 0.2
    params: int = 200_000
    timeout: float = 300.0

    def check(self) -> None:
        if not self.ranks_per_node or min(self.ranks_per_node) < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}")
        if not 2 <= self.kill_after < self.steps - 1:
            raise ValueError(
                f"--kill-after must be in [2, steps - 1), got {self.kill_after} with {self.steps} steps"
            )
        if (
            not self.modes
            or set(self.modes) - set(MODES)
            or "restart" not in self.modes
            or len(self.modes) < 2
        ):
            raise ValueError(
                f"--modes must include restart and another, of {', '.join(MODES)}; got {self.modes}"
            )
        if self.step_delay < 0 or self.timeout <= 0:
            raise ValueError("--step-delay must be >= 0 and --timeout > 0")


_PHASES = ("detection_seconds", "group_seconds", "restore_seconds", "first_step_seconds", "total_seconds")


def _torchrun_node(
    cluster: LocalCluster,
    workdir: str,
    name: str,
    addr: str,
    *,
    index: int | None,
    per_node: int,
    script_args: list[str],
) -> EmulatedNode:
    """A node of :mod:`.live_trainer`'s ranks: those of ``index`` or, None, of the seat snapshotd gives it."""
    place = ["--nodes", "2"] if index is None else ["--node-index", str(index), "--world", str(2 * per_node)]
    return torchrun_node(
        cluster,
        workdir,
        name,
        addr,
        trainer="snapshotd.bench.live_trainer",
        per_node=per_node,
        script_args=[*place, *script_args],
    )


def run_trial(
    cluster: LocalCluster, workdir: str, store: str, cfg: LiveConfig, *, mode: str, per_node: int, tag: str
) -> dict[str, Any]:
    """Run the job on two torchrun nodes, lose the second at ``kill_after``, recover by ``mode``; the table row.

    Raises:
        TimeoutError: the job did not reach ``kill_after`` or did not finish within ``cfg.timeout``.
        RuntimeError: an agent exited non-zero, or the recovered run is not bit-identical to its own ranks'
            agreement (every rank must end at the same step with one epoch).
    """
    spare = mode.endswith("+spare")
    name = f"{mode.replace('+', '-')}{per_node}-{tag}"
    out = os.path.join(workdir, name)
    os.makedirs(out)
    world = 2 * per_node
    job = f"live-{name}"
    steps = max(cfg.steps, cfg.spare_steps) if spare else cfg.steps  # still running once the spare is ready
    script_args = [
        "--store",
        store,
        "--job",
        job,
        "--steps",
        str(steps),
        "--params",
        str(cfg.params),
        "--step-delay",
        str(cfg.step_delay),
        "--pg-timeout",
        "10",
        "--on-loss",
        "recover" if mode.startswith("live") else "exit",
        "--out",
        out,
        "--progress",
        out,
    ]
    nodes = [
        _torchrun_node(
            cluster,
            workdir,
            f"{name}-{x}",
            f"127.0.0.{2 + i}",
            index=i,
            per_node=per_node,
            script_args=script_args,
        )
        for i, x in enumerate("AB")
    ]
    try:

        def progress(rank: int) -> int:
            try:
                return int(read_json(os.path.join(out, f"rank{rank}.progress"))["step"])
            except (OSError, ValueError, KeyError):
                return 0

        def replacement() -> EmulatedNode:
            node = _torchrun_node(
                cluster,
                workdir,
                f"{name}-C",
                "127.0.0.4",
                index=None,
                per_node=per_node,
                script_args=script_args,
            )
            nodes.append(node)
            return node

        # once the job runs (its first group formed), the spare's ranks wait for a seat, model built
        if spare:
            wait_for(lambda: progress(0) >= 1, cfg.timeout, "the job's first step")
            replacement()
            wait_for(
                lambda: len(glob.glob(os.path.join(out, "built.*"))) >= 3 * per_node,
                cfg.timeout,
                "the spare's ranks waiting for a seat, model built",
            )
        wait_for(
            lambda: reached_kill_point(cluster, nodes, out, job, world - 1, cfg.kill_after),
            cfg.timeout,
            f"step {cfg.kill_after}, durable",
        )
        pids = {r: read_json(os.path.join(out, f"rank{r}.progress"))["pid"] for r in range(per_node)}
        killed_at = nodes[1].kill()
        if not spare:
            replacement()
        results = finish(nodes, out, world, cfg.timeout)
    finally:
        for node in nodes:
            with contextlib.suppress(RuntimeError):
                node.stop()
    return _row(mode, per_node, results, pids, killed_at, out)


def _row(
    mode: str, per_node: int, results: list[dict[str, Any]], pids: dict[int, int], killed_at: float, out: str
) -> dict[str, Any]:
    """The phases of one recovery from the ranks' results (wall-clock times, every rank on one machine)."""
    survivors, lost = results[:per_node], results[per_node:]
    if mode.startswith("live"):
        step = survivors[0]["recoveries"][-1]["step"]
        failed = min(r["recoveries"][0]["failed_at"] for r in survivors)
        recoveries = [r["recoveries"][-1] for r in survivors]
        grouped = [rec["recovered_at"] - rec["restore_s"] - rec["ddp_s"] for rec in recoveries]
        restored = [rec["recovered_at"] for rec in recoveries]
        fresh = lost
    else:
        step = survivors[0]["start_step"]
        # the first survivor to see the loss exits; torchrun then stops the others, which may not have seen it yet
        lost_files = [os.path.join(out, f"rank{r}.json.lost") for r in range(per_node)]
        failed = min(read_json(p)["failed_at"] for p in lost_files if os.path.exists(p))
        grouped, restored, fresh = [], [], results
    grouped += [r["started"]["group_formed"] for r in fresh]
    restored += [r["started"]["restored"] for r in fresh]
    first = max(r["done_at"][str(step + 1)] for r in results)
    steps = {len(r["losses"]) + r["start_step"] for r in results}
    kept = sum(r["pid"] == pids[r["rank"]] for r in survivors)
    row = {
        "mode": mode,
        "ranks_per_node": per_node,
        "step_restored": step,
        "survivors_kept": kept,
        "detection_seconds": failed - killed_at,
        "group_seconds": max(grouped) - failed,
        "restore_seconds": max(restored) - max(grouped),
        "first_step_seconds": first - max(restored),
        "total_seconds": first - killed_at,
        "epochs": len({r["epoch"] for r in results}),
    }
    if mode.startswith("live"):
        row["survivor_work_seconds"] = max(rec["ddp_s"] + rec["restore_s"] for rec in recoveries)
        row["survivor_cpu_seconds"] = max(rec["cpu_s"] for rec in recoveries)
    if len(steps) != 1 or row["epochs"] != 1:
        raise RuntimeError(
            f"{mode} x{per_node}: the ranks ended apart (steps {steps}, {row['epochs']} epochs)"
        )
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``live`` subcommand's flags."""
    d = LiveConfig()
    parser.add_argument(
        "--ranks-per-node",
        default=",".join(map(str, d.ranks_per_node)),
        help="comma-separated sizes, each run in both modes (default %(default)s)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES) + " (default all)"
    )
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps (default %(default)s)")
    parser.add_argument(
        "--spare-steps",
        type=int,
        default=d.spare_steps,
        help="training steps of the spare modes' jobs, which must outlast the spare's start "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--kill-after",
        type=int,
        default=d.kill_after,
        help="lose the second node once its last rank completed this step (and a spare waits) (default %(default)s)",
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=d.step_delay,
        help="idle seconds per step, the accelerator's share (default %(default)s)",
    )
    parser.add_argument("--params", type=int, default=d.params, help="model parameters (default %(default)s)")
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds per job (default %(default)s)"
    )


def run(args: argparse.Namespace) -> Report:
    """For each ``--ranks-per-node``, the job recovered by a full restart and then live; one row each.

    Raises:
        ValueError: bad arguments.
        RuntimeError, TimeoutError: as :func:`run_trial`.
    """
    try:
        sizes = tuple(int(x) for x in str(args.ranks_per_node).split(","))
    except ValueError:
        raise ValueError(
            f"--ranks-per-node must be comma-separated integers, got {args.ranks_per_node!r}"
        ) from None
    cfg = LiveConfig(
        ranks_per_node=sizes,
        modes=tuple(str(args.modes).split(",")),
        steps=args.steps,
        kill_after=args.kill_after,
        step_delay=args.step_delay,
        params=args.params,
        timeout=args.timeout,
        spare_steps=args.spare_steps,
    )
    cfg.check()
    tag = uuid.uuid4().hex[:6]
    rows: list[dict[str, Any]] = []
    with (
        scratch_dir(args.workdir, prefix="snapshotd-live-") as workdir,
        LocalCluster(workdir, heartbeat_interval=0.2, heartbeat_timeout=1.5) as cluster,
    ):
        cluster.start_coordinator()
        store = RendezvousStore(workdir)
        try:
            for per_node in sizes:
                for mode in cfg.modes:
                    try:
                        if mode == "shrink":
                            row = run_shrink_trial(
                                cluster, workdir, store.endpoint, cfg, per_node=per_node, tag=tag
                            )
                        else:
                            row = run_trial(
                                cluster, workdir, store.endpoint, cfg, mode=mode, per_node=per_node, tag=tag
                            )
                        rows.append(row)
                    except Exception as exc:  # noqa: BLE001 - a failed trial is a row, not the end of the run
                        log.warning("live bench: %s x%d failed: %s", mode, per_node, exc)
                        rows.append({"mode": mode, "ranks_per_node": per_node, "error": str(exc)[:300]})
        finally:
            store.stop()
    by = {(r["mode"], r["ranks_per_node"]): r for r in rows if "error" not in r}
    first = sizes[0]
    missing = [m for m in cfg.modes if (m, first) not in by]
    if missing:
        failed = "; ".join(f"{r['mode']} x{r['ranks_per_node']}: {r['error']}" for r in rows if "error" in r)
        raise RuntimeError(f"the first size's {', '.join(missing)} trial failed: {failed}")
    full = by["restart", first]["total_seconds"]
    summary: dict[str, Any] = {"ranks_per_node": first, "full_restart_seconds": full}
    if "live" in cfg.modes:
        live = by["live", first]["total_seconds"]
        summary.update(live_seconds=live, live_speedup=full / live)
    if {"restart+spare", "live+spare"} <= set(cfg.modes):
        full_s, live_s = by["restart+spare", first]["total_seconds"], by["live+spare", first]["total_seconds"]
        summary.update(
            full_restart_spare_seconds=full_s, live_spare_seconds=live_s, live_spare_speedup=full_s / live_s
        )
    if ("shrink", first) in by:
        shrink = by["shrink", first]
        summary.update(
            shrink_seconds=shrink["total_seconds"],
            shrink_speedup=full / shrink["total_seconds"],
            grow_pause_seconds=shrink["grow_pause_seconds"],
            shrunk_step_seconds=shrink["shrunk_step_seconds"],
            shrunk_throughput_ratio=shrink["shrunk_throughput_ratio"],
        )
        summary.update(measure_reduction_cost(2 * first, cfg.params, steps=max(cfg.steps, 10)))
    spare_mode = "live+spare" if "live+spare" in cfg.modes else "live"
    work_of = {k: by[spare_mode, k]["survivor_work_seconds"] for k in sizes if (spare_mode, k) in by}
    cpu_of = {k: by[spare_mode, k]["survivor_cpu_seconds"] for k in sizes if (spare_mode, k) in by}
    work, cpu = list(work_of.values()), list(cpu_of.values())
    summary.update(
        survivor_work_mode=spare_mode,
        survivor_work_seconds={str(k): v for k, v in work_of.items()},
        survivor_work_spread=max(work) / min(work) - 1 if work and min(work) > 0 else None,
        survivor_cpu_seconds={str(k): v for k, v in cpu_of.items()},
        survivor_cpu_spread=max(cpu) / min(cpu) - 1 if cpu and min(cpu) > 0 else None,
        failed_trials=sum("error" in r for r in rows),
        survivors_kept_live=all(
            r["survivors_kept"] == r["ranks_per_node"] for r in rows if r["mode"].startswith("live")
        ),
    )
    return Report(
        "live",
        dataclasses.asdict(cfg),
        rows,
        summary,
        columns=[
            "mode",
            "ranks_per_node",
            "step_restored",
            "survivors_kept",
            *_PHASES,
            "survivor_work_seconds",
            "survivor_cpu_seconds",
            "shrunk_step_seconds",
            "shrunk_throughput_ratio",
            "joined_after_seconds",
            "grow_pause_seconds",
            "epochs",
            "error",
        ],
    )


def plot(report: Report, path: str) -> None:
    """The recovery's phases as a stacked bar per mode and size (the kill to the first step, its total at the end)."""
    phases_plot(report, path, _PHASES[:-1], lambda r: f"{r['mode']}, {r['ranks_per_node']} ranks/node")
