"""The torchrun trial: a real multi-node torchrun job loses a node, and a replacement node takes its place.

``examples/torchrun_ddp/train.py`` (DDP, snapshotted every step) runs under real torchrun agents: c10d
rendezvous on a standalone store with an address of its own (127.0.0.9), ``--max-restarts``, and N emulated
nodes of ``nproc_per_node`` workers each, every node with its own sidecar (:mod:`.nodes`). A coordinator must
be running (the caller's :class:`~snapshotd.harness.cluster.LocalCluster`).

:func:`run_trial` with ``fail=False`` runs the job to the end. With ``fail=True`` it SIGKILLs node ``lose``
(agent, workers, sidecar and its shared memory) once that node's first rank logged step ``kill_after``, and at
once starts a replacement node: a new sidecar and a new agent, on an address ordered after the survivors', so
that the survivors keep their ranks when the lost node is the last one (the default). The surviving agents see
their workers fail, rendezvous again with the replacement, and restart their workers, which ``restore()``: the
survivors from their own node's memory, the replacement's ranks from the copy their buddies hold.
:func:`compare` checks a trial against a failure-free run.

The torchrun settings (:data:`TORCHRUN_ENV`, :attr:`TrialConfig.rdzv_conf`) are the ones this needs, and why
is written beside each. The recovery time is split by wall-clock timestamps (``time.time()``) that each
process writes: the driver's kill, the coordinator's log line declaring the node dead, the agents' log lines
(torch logs at ``LOGLEVEL=INFO``), and the example's per-rank events (process start, process group, model
built, restored, first step). See :attr:`TrialResult.split`.

``snapshotd-bench torchrun`` runs a failure-free job and then ``--runs`` trials, and prints the split of each.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from snapshotd.harness.cluster import LocalCluster
from snapshotd.harness.ports import free_port

from .nodes import EmulatedNode, RendezvousStore, agent_lines
from .report import Report, phases_plot, scratch_dir

__all__ = [
    "EXAMPLE_DIR",
    "TORCHRUN_ENV",
    "TrialConfig",
    "TrialResult",
    "add_arguments",
    "compare",
    "read_outcome",
    "run",
    "run_trial",
]

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "torchrun_ddp"
"""The example's folder in a checkout of the repository (it is not installed with the package)."""

TORCHRUN_ENV = {
    # The agent of the round's first node hosts the workers' TCPStore and keeps it across rounds; when that
    # node survives a failure it never publishes MASTER_ADDR in the new round's keys, so a replacement node
    # waits for it until read_timeout and the round fails (torch 2.13). Without sharing, every round publishes
    # a new one.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    # the agents' INFO lines carry the timestamps of the launcher's part of the recovery
    "LOGLEVEL": "INFO",
    # gloo on the loopback interface: the emulated nodes share it, and no traffic leaves 127.0.0.0/8
    "GLOO_SOCKET_IFNAME": "lo",
}
"""The agents' environment (on top of the caller's)."""

_POLL = 0.05


@dataclasses.dataclass(kw_only=True, slots=True)
class TrialConfig:
    """One trial's shape and torchrun settings."""

    nodes: int = 2
    """Emulated nodes (torchrun ``--nnodes``)."""
    nproc_per_node: int = 2
    """Workers per node."""
    steps: int = 16
    """Optimizer steps of the job."""
    kill_after: int = 11
    """The lost node dies once its first rank has logged this step (with the default model flags an epoch is 9
    steps, so the job restores in its second epoch, part-way through)."""
    lose: int = 1
    """Which node dies (0 is the node torchrun ranks first)."""
    max_restarts: int = 3
    """torchrun ``--max-restarts``."""
    monitor_interval: float = 0.1
    """torchrun ``--monitor-interval``: how often an agent looks at its workers (seconds)."""
    rdzv_conf: str = (
        "is_host=false,join_timeout=60,read_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
    )
    """torchrun ``--rdzv-conf``. ``is_host=false``: no agent hosts the store, it has a host of its own, so no
    node's loss takes it down. ``keep_alive_interval`` x ``keep_alive_max_attempt``: a node silent that long
    is dropped from the rendezvous; until then the survivors cannot form the next round (torch's default:
    5 x 3 s). ``join_timeout`` and ``read_timeout`` bound a round that cannot form and a store read (default
    600 and 60 s)."""
    share_store: bool = False
    """Leave torch's shared rendezvous TCPStore on (without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), to see
    it fail."""
    model_args: tuple[str, ...] = (
        "--width",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--block",
        "32",
        "--batch",
        "32",
    )
    """The example's model and batch flags: a model of 15k parameters, 9 steps an epoch on 4 ranks."""
    step_delay: float = 0.1
    """The example's ``--step-delay``: idle seconds per step, the accelerator's share of a step on a GPU node,
    during which the sidecars stream (on a 2-core machine they would otherwise fall behind and skip steps)."""
    timeout: float = 120.0
    """Seconds for the whole job (the trial raises TimeoutError past it)."""
    replacement_first: bool = False
    """Give the replacement node an address that sorts before every survivor's (127.0.0.1): torchrun then
    gives it the first ranks, and the survivors' workers restart as other ranks than before."""
    store_on: int | None = None
    """None: the rendezvous store runs on a host of its own (``store_host``). A node's index: that node's
    agent hosts it (``is_host=true``, as torchrun's default does for the node named in ``--rdzv-endpoint``),
    to see the job go down with that node."""
    store_host: str = "127.0.0.9"
    """The rendezvous store's address: a host of its own."""
    example_dir: str = str(EXAMPLE_DIR)
    """The folder holding ``train.py``."""

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.nproc_per_node < 1:
            raise ValueError(f"need at least 2 nodes of 1 worker, got {self.nodes} x {self.nproc_per_node}")
        if not 0 < self.kill_after < self.steps:
            raise ValueError(
                f"kill_after must be between 1 and steps - 1 ({self.steps - 1}), got {self.kill_after}"
            )
        if self.store_on is not None and not 0 <= self.store_on < self.nodes:
            raise ValueError(f"store_on must name one of the {self.nodes} nodes, got {self.store_on}")
        if not 0 <= self.lose < self.nodes:
            raise ValueError(f"lose must name one of the {self.nodes} nodes, got {self.lose}")
        if self.max_restarts < 1 or self.timeout <= 0 or self.step_delay < 0 or self.monitor_interval <= 0:
            raise ValueError("max_restarts must be >= 1, timeout and monitor_interval > 0, step_delay >= 0")
        if not os.path.isfile(os.path.join(self.example_dir, "train.py")):
            raise FileNotFoundError(
                f"train.py not found in {self.example_dir} (a checkout of the repository has it)"
            )

    def node_addr(self, index: int) -> str:
        """Node ``index``'s ``--local-addr``; the replacement is index ``nodes``, ordered after every survivor
        (before them with ``replacement_first``)."""
        return "127.0.0.1" if index == self.nodes and self.replacement_first else f"127.0.0.{2 + index}"


@dataclasses.dataclass(slots=True)
class TrialResult:
    """What one run of the job left behind, read from its files."""

    job: str
    out: str
    """The example's ``--out`` folder."""
    world: int
    losses: dict[int, dict[int, float]]
    """Rank -> step -> loss, the last one logged for the step (a restored run logs the steps it re-ran)."""
    rerun_mismatches: dict[int, list[int]]
    """Rank -> the steps whose re-run after the restore logged another loss than before the failure."""
    finals: dict[int, dict[str, Any]]
    """Rank -> its ``final-rank{R}.json`` (``digest``: model and optimizer; ``state_digest``: all of it)."""
    restored: dict[int, dict[str, Any]]
    """Rank -> the last ``restored`` event of the rank (``step``, ``source``)."""
    exit_codes: dict[str, int | None]
    """Agent -> its exit code."""
    pids: list[int] = dataclasses.field(default_factory=list)
    """Every process the trial started itself: the store, sidecars and agents (all ended on return)."""
    reached: int | None = None
    """With a failure: the newest step any rank logged before the kill."""
    steps_lost: int | None = None
    """``reached`` minus the restored step."""
    stride_at_loss: int | None = None
    """With a failure: the widest snapshot stride (``SnapshotStats.stride``) any rank logged at its last step
    before the kill; a node loss costs at most ``max_steps_lost(stride)`` steps."""
    milestones: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall-clock times (``time.time()``) of the recovery, see :attr:`split`."""
    split: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds of each phase of the recovery; each milestone is the latest of its ranks or agents:

    - ``detection_seconds``: kill -> the coordinator declares the node dead (alongside the launcher's
      restart);
    - ``launcher_restart_seconds``: kill -> the new rendezvous round formed on every agent, made of
      ``worker_error_seconds`` (kill -> the surviving workers' collective raised), ``worker_exit_seconds``
      (-> their agent saw them exit: the failed process's own teardown) and ``rendezvous_seconds`` (-> the
      round: the dead node must first miss its rendezvous keep-alives);
    - ``process_start_seconds``: round -> every new worker runs the script's first line;
    - ``process_group_seconds``: -> ``init_process_group`` returned (imports, the workers' own rendezvous);
    - ``model_build_seconds``: -> dataset, model, DDP (which imports ``torch._dynamo``), optimizer built;
    - ``restore_seconds``: -> ``restore()`` returned on every rank (it waits until every rank asked);
    - ``first_step_seconds``: -> the first step after the recovery completed on every rank;
    - ``total_seconds``: kill -> that first step.
    """


def _is_host(conf: str, is_host: bool) -> str:
    """``conf`` (a ``--rdzv-conf`` value) with ``is_host`` set to ``is_host``."""
    items = [item for item in conf.split(",") if item and not item.startswith("is_host=")]
    return ",".join([*items, f"is_host={str(is_host).lower()}"])


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]
    return []


def _last_step(path: str) -> int:
    lines = _read_jsonl(path)
    return int(lines[-1]["step"]) if lines else 0


def _coordinator_dead_at(log_path: str, node: str) -> float | None:
    """When the coordinator's log declared ``node`` dead (its heartbeats missed, or a probe refused; its
    ``asctime``: local time, milliseconds)."""
    pattern = re.compile(
        rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*node {re.escape(node)} (missed|refused) .*: declared dead"
    )
    with contextlib.suppress(FileNotFoundError), open(log_path, errors="replace") as f:
        for line in f:
            if m := pattern.match(line):
                return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def read_outcome(
    out: str, world: int, job: str, exit_codes: dict[str, int | None], killed_at: float | None
) -> TrialResult:
    """What the example left in ``out`` for a job of ``world`` ranks (its per-rank losses, events and final
    state), the node loss at ``killed_at`` (``time.time()``; None: no loss) placed among them."""
    losses: dict[int, dict[int, float]] = {}
    mismatches: dict[int, list[int]] = {}
    finals: dict[int, dict[str, Any]] = {}
    restored: dict[int, dict[str, Any]] = {}
    for rank in range(world):
        per_step: dict[int, float] = {}
        bad = []
        for rec in _read_jsonl(os.path.join(out, f"losses-rank{rank}.jsonl")):
            step, loss = int(rec["step"]), float(rec["loss"])
            if step in per_step and per_step[step] != loss:
                bad.append(step)
            per_step[step] = loss
        losses[rank], mismatches[rank] = per_step, bad
        with contextlib.suppress(FileNotFoundError), open(os.path.join(out, f"final-rank{rank}.json")) as f:
            finals[rank] = json.load(f)
        events = _read_jsonl(os.path.join(out, f"events-rank{rank}.jsonl"))
        restored[rank] = next((e for e in reversed(events) if e["event"] == "restored"), {})
    result = TrialResult(job, out, world, losses, mismatches, finals, restored, exit_codes)
    if killed_at is not None:
        before = set()
        for rank in range(world):
            before |= {
                e["pid"]
                for e in _read_jsonl(os.path.join(out, f"events-rank{rank}.jsonl"))
                if e["event"] == "start" and e["t"] < killed_at
            }
        logged = (_read_jsonl(os.path.join(out, f"losses-rank{rank}.jsonl")) for rank in range(world))
        last = [
            max((r for r in lines if r["pid"] in before), key=lambda r: int(r["step"]), default=None)
            for lines in logged
        ]  # each rank's last step before the kill
        result.reached = max((int(r["step"]) for r in last if r is not None), default=0)
        result.stride_at_loss = max((int(r.get("stride", 0)) for r in last if r is not None), default=0)
        restored_steps = {e.get("step") for e in restored.values()}
        if len(restored_steps) == 1 and isinstance(step0 := restored_steps.pop(), int):
            result.steps_lost = result.reached - step0
    return result


def _recovery_split(
    result: TrialResult,
    killed_at: float,
    dead_at: float | None,
    survivors: list[EmulatedNode],
    agents: list[EmulatedNode],
) -> None:
    """Fill ``result.milestones`` and ``result.split`` from the logs (see :attr:`TrialResult.split`)."""
    nan = float("nan")
    year = datetime.datetime.fromtimestamp(killed_at).year
    noticed, rounds = [], []
    for node in agents:
        lines = [a for a in agent_lines(node.log_path, year) if a.t >= killed_at - 0.001]
        if node in survivors:
            noticed.append(next((a.t for a in lines if "will restart worker group" in a.message), nan))
        rounds.append(next((a.t for a in lines if "Rendezvous complete for workers" in a.message), nan))
    raised: list[float] = []
    new: dict[str, list[float]] = {}
    for rank in range(result.world):
        events = _read_jsonl(os.path.join(result.out, f"events-rank{rank}.jsonl"))
        raised += [e["t"] for e in events if e["event"] == "failed" and e["t"] >= killed_at]
        pids = {e["pid"] for e in events if e["event"] == "start" and e["t"] > killed_at}
        for e in events:
            if e["pid"] in pids:
                new.setdefault(e["event"], []).append(e["t"])
    m = {
        "kill": killed_at,
        "detected": nan if dead_at is None else dead_at,
        "workers_raised": max(raised, default=nan),
        "workers_failed": max(noticed, default=nan),
        "round": max(rounds, default=nan),
        **{
            f"rank_{e}": max(new.get(e, [nan]))
            for e in ("start", "pg_ready", "built", "restored", "first_step")
        },
    }
    result.milestones = m
    result.split = {
        "detection_seconds": m["detected"] - m["kill"],
        "launcher_restart_seconds": m["round"] - m["kill"],
        "worker_error_seconds": m["workers_raised"] - m["kill"],
        "worker_exit_seconds": m["workers_failed"] - m["workers_raised"],
        "rendezvous_seconds": m["round"] - m["workers_failed"],
        "process_start_seconds": m["rank_start"] - m["round"],
        "process_group_seconds": m["rank_pg_ready"] - m["rank_start"],
        "model_build_seconds": m["rank_built"] - m["rank_pg_ready"],
        "restore_seconds": m["rank_restored"] - m["rank_built"],
        "first_step_seconds": m["rank_first_step"] - m["rank_restored"],
        "total_seconds": m["rank_first_step"] - m["kill"],
    }


@contextlib.contextmanager
def _nodes_stopped(nodes: list[EmulatedNode]) -> Iterator[None]:
    try:
        yield
    finally:
        errors = []
        for node in reversed(nodes):
            try:
                node.stop()
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("; ".join(errors))


def run_trial(
    cluster: LocalCluster, workdir: str, cfg: TrialConfig, *, job: str, fail: bool, node_names: list[str]
) -> TrialResult:
    """Run the example under torchrun on ``cfg.nodes`` emulated nodes, losing one of them when ``fail``.

    Args:
        cluster: its coordinator runs; the trial starts (and stops) a sidecar per node through it.
        workdir: logs (``agent-NODE.log``, ``rdzv-store.log``) and the example's ``--out`` folder ``out-JOB``.
        cfg: the trial's shape.
        job: the rendezvous id, and so the snapshotd job (``TORCHELASTIC_RUN_ID``); fresh for every run.
        fail: lose node ``cfg.lose`` after step ``cfg.kill_after`` and start a replacement node.
        node_names: ``cfg.nodes`` names, and one more for the replacement (sidecar ``--node`` names).

    Returns:
        What the run left: losses, final digests, restores and, with ``fail``, steps lost and the recovery
        split. Every process it started has ended, the sidecars with SIGTERM (the lost one with SIGKILL).

    Raises:
        ValueError: not ``cfg.nodes + 1`` node names.
        TimeoutError: the job ran past ``cfg.timeout``, or the lost node never reached ``kill_after``.
        RuntimeError: an agent exited non-zero (the others are then stopped), or a process would not end.
    """
    if len(node_names) != cfg.nodes + 1:
        raise ValueError(f"need {cfg.nodes + 1} node names (the last for the replacement), got {node_names}")
    out = os.path.join(workdir, f"out-{job}")
    world = cfg.nodes * cfg.nproc_per_node
    env = dict(TORCHRUN_ENV)
    if cfg.share_store:
        del env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
    script = os.path.join(cfg.example_dir, "train.py")
    script_args = [
        *cfg.model_args,
        "--steps",
        str(cfg.steps),
        "--step-delay",
        str(cfg.step_delay),
        "--out",
        out,
    ]
    deadline = time.monotonic() + cfg.timeout
    store = None
    if cfg.store_on is None:
        store = RendezvousStore(workdir, host=cfg.store_host)
        endpoint = store.endpoint
    else:
        endpoint = f"{cfg.node_addr(cfg.store_on)}:{free_port(cfg.node_addr(cfg.store_on))}"
    nodes: list[EmulatedNode] = []
    try:

        def start(index: int) -> EmulatedNode:
            conf = cfg.rdzv_conf if cfg.store_on is None else _is_host(cfg.rdzv_conf, index == cfg.store_on)
            torchrun_args = [
                "--nnodes",
                str(cfg.nodes),
                "--nproc-per-node",
                str(cfg.nproc_per_node),
                "--max-restarts",
                str(cfg.max_restarts),
                "--monitor-interval",
                str(cfg.monitor_interval),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                job,
                "--rdzv-conf",
                conf,
            ]
            node = EmulatedNode(
                cluster,
                node_names[index],
                cfg.node_addr(index),
                torchrun_args=torchrun_args,
                script=script,
                script_args=script_args,
                env=env,
                workdir=workdir,
            )
            nodes.append(node)
            return node

        with _nodes_stopped(nodes):
            for i in range(cfg.nodes):
                start(i)
            killed_at = None
            running = list(nodes)
            if fail:
                lost = nodes[cfg.lose]
                progress = os.path.join(out, f"losses-rank{cfg.lose * cfg.nproc_per_node}.jsonl")
                while _last_step(progress) < cfg.kill_after:
                    if ended := {n.name: n.agent.poll() for n in nodes if n.agent.poll() is not None}:
                        raise RuntimeError(f"agents exited before step {cfg.kill_after}: {ended}; {workdir}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"node {lost.name} did not reach step {cfg.kill_after}; {workdir}")
                    time.sleep(_POLL)
                killed_at = lost.kill()
                running.remove(lost)
                running.append(start(cfg.nodes))
            while any(n.agent.poll() is None for n in running):
                if any(n.agent.poll() not in (None, 0) for n in running):
                    break  # one agent gave up: the job is down (the others are stopped below)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job} did not finish within {cfg.timeout:.0f} s; see {workdir}")
                time.sleep(_POLL)
            exit_codes = {n.name: n.agent.returncode for n in nodes}
    finally:
        if store is not None:
            store.stop()
    failed = {n: c for n, c in exit_codes.items() if c != 0 and not (fail and n == node_names[cfg.lose])}
    if failed:
        raise RuntimeError(f"torchrun agents exited non-zero: {failed}; see {workdir}/agent-*.log")
    result = read_outcome(out, world, job, exit_codes, killed_at)
    result.pids = [p for n in nodes for p in (n.sidecar.pid, n.agent.pid)]
    if store is not None:
        result.pids.append(store.proc.pid)
    if killed_at is not None:
        assert cluster.coordinator is not None
        dead_at = _coordinator_dead_at(cluster.coordinator.log_path, node_names[cfg.lose])
        _recovery_split(result, killed_at, dead_at, [n for n in running if n is not nodes[-1]], running)
    return result


def compare(reference: TrialResult, trial: TrialResult) -> dict[str, Any]:
    """How ``trial`` differs from the failure-free ``reference``: ``losses_identical`` (every step of every
    rank, bit for bit), ``first_difference`` ((rank, step) or None), ``digests_equal`` (model and optimizer of
    every rank), ``states_equal`` (everything snapshotted: scheduler and RNG too), ``reruns_identical``."""
    diffs = sorted(
        (rank, step)
        for rank, steps in reference.losses.items()
        for step, loss in steps.items()
        if trial.losses.get(rank, {}).get(step) != loss
    )
    missing = sorted(
        (rank, step)
        for rank, steps in trial.losses.items()
        for step in steps
        if step not in reference.losses.get(rank, {})
    )
    ranks = range(reference.world)
    return {
        "losses_identical": not diffs and not missing and reference.losses.keys() == trial.losses.keys(),
        "first_difference": next(iter(diffs or missing), None),
        "digests_equal": all(
            trial.finals.get(r, {}).get("digest") == reference.finals[r]["digest"] for r in ranks
        ),
        "states_equal": all(
            trial.finals.get(r, {}).get("state_digest") == reference.finals[r]["state_digest"] for r in ranks
        ),
        "reruns_identical": not any(trial.rerun_mismatches.values()),
    }


_SPLIT_COLUMNS = (
    "detection_seconds",
    "launcher_restart_seconds",
    "worker_error_seconds",
    "worker_exit_seconds",
    "rendezvous_seconds",
    "process_start_seconds",
    "process_group_seconds",
    "model_build_seconds",
    "restore_seconds",
    "first_step_seconds",
    "total_seconds",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``torchrun`` subcommand's flags."""
    d = TrialConfig()
    parser.add_argument("--runs", type=int, default=3, help="trials with a node loss (default 3)")
    parser.add_argument("--nodes", type=int, default=d.nodes, help=f"emulated nodes (default {d.nodes})")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=d.nproc_per_node,
        help=f"workers per node (default {d.nproc_per_node})",
    )
    parser.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    parser.add_argument(
        "--kill-after",
        type=int,
        default=d.kill_after,
        help=f"lose the node once its first rank logged this step (default {d.kill_after})",
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=d.step_delay,
        help=f"idle seconds per step, the accelerator's share (default {d.step_delay})",
    )
    parser.add_argument(
        "--model-args",
        default=" ".join(d.model_args),
        help=f"the example's model flags (default {' '.join(d.model_args)!r})",
    )
    parser.add_argument(
        "--rdzv-conf", default=d.rdzv_conf, help=f"torchrun --rdzv-conf (default {d.rdzv_conf})"
    )
    parser.add_argument(
        "--share-store",
        action="store_true",
        help="leave torch's shared rendezvous TCPStore on (fails on torch 2.13)",
    )
    parser.add_argument(
        "--replacement-first",
        action="store_true",
        help="the replacement node takes the first ranks (its address sorts first)",
    )
    parser.add_argument(
        "--store-on-node",
        type=int,
        default=None,
        metavar="INDEX",
        help="node INDEX's agent hosts the rendezvous store (not a host of its own)",
    )
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, help=f"seconds per job (default {d.timeout:.0f})"
    )


def run(args: argparse.Namespace) -> Report:
    """A failure-free run, then ``--runs`` trials each losing a node; one row per trial.

    Raises:
        ValueError: bad arguments.
        RuntimeError, TimeoutError: as :func:`run_trial`.
    """
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    cfg = TrialConfig(
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        steps=args.steps,
        kill_after=args.kill_after,
        step_delay=args.step_delay,
        model_args=tuple(args.model_args.split()),
        rdzv_conf=args.rdzv_conf,
        share_store=args.share_store,
        timeout=args.timeout,
        store_on=args.store_on_node,
        replacement_first=args.replacement_first,
    )
    tag = uuid.uuid4().hex[:6]
    rows = []
    with (
        scratch_dir(args.workdir, prefix="snapshotd-torchrun-") as workdir,
        LocalCluster(workdir, heartbeat_interval=0.2, heartbeat_timeout=1.5) as cluster,
    ):
        cluster.start_coordinator()
        letters = [chr(ord("A") + i) for i in range(cfg.nodes + 1)]
        reference = run_trial(
            cluster,
            workdir,
            cfg,
            job=f"reference-{tag}",
            fail=False,
            node_names=[f"{x}0-{tag}" for x in letters],
        )
        for i in range(1, args.runs + 1):
            trial = run_trial(
                cluster,
                workdir,
                cfg,
                job=f"trial{i}-{tag}",
                fail=True,
                node_names=[f"{x}{i}-{tag}" for x in letters],
            )
            same = compare(reference, trial)
            sources = sorted({str(r.get("source")) for r in trial.restored.values()})
            identical = same["losses_identical"] and same["digests_equal"] and same["states_equal"]
            rows.append(
                {
                    "run": i,
                    "steps_lost": trial.steps_lost,
                    **trial.split,
                    "bit_identical": identical,
                    "sources": "/".join(sources),
                }
            )
    summary: dict[str, Any] = {f"median_{c}": statistics.median(r[c] for r in rows) for c in _SPLIT_COLUMNS}
    summary["max_steps_lost"] = max(
        (r["steps_lost"] for r in rows if r["steps_lost"] is not None), default=None
    )
    summary["all_bit_identical"] = all(r["bit_identical"] for r in rows)
    config = {**dataclasses.asdict(cfg), "runs": args.runs, "torchrun_env": TORCHRUN_ENV}
    return Report(
        "torchrun",
        config,
        rows,
        summary,
        columns=["run", "steps_lost", *_SPLIT_COLUMNS, "bit_identical", "sources"],
    )


def plot(report: Report, path: str) -> None:
    """Each run's recovery as a stacked bar of its phases in turn (the kill to the first step, its total at the
    end): detection overlaps the launcher's restart, so the bar is the launcher's path."""
    phases = ("launcher_restart_seconds", *_SPLIT_COLUMNS[5:-1])
    phases_plot(report, path, phases, lambda r: f"run {r['run']}")
