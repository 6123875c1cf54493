"""``snapshotd-bench overhead``: what a snapshot after every step costs training, beside today's disk checkpoints.

A real data-parallel job (``--ranks`` gloo processes of :mod:`snapshotd.harness.trainer`, training the GPT of
:mod:`.workloads` with AdamW; about 12 bytes of state per parameter) trains in runs of ``--steps`` steps, one
variant per run, interleaved round by round (``none, snapshotd, torch_save, dcp_async, none, snapshotd, ...``) so
that drift in the machine's speed (other work on it) hits every variant alike. The runs are blocks of one
training job (the trainer's ``--plan``), so process start-up is paid once; between runs the ranks wait, untimed,
for the previous run's snapshot or save in flight, so that no run's work spills into the next:

- ``none``: no checkpointing.
- ``snapshotd``: :class:`~snapshotd.client.Snapshotter` ``capture()`` after every step (``--every``).
- ``torch_save``: rank 0 ``torch.save``-s the model, optimizer and scheduler state to local disk every N steps.
- ``dcp_async``: every rank ``torch.distributed.checkpoint.async_save``-s every N steps, first waiting for the
  previous save (see :class:`~.baselines.DiskCheckpointer`).

N is each value of ``--interval``. ``--scenario`` picks the machine's shape (default ``both``, in one run):

- ``headroom`` (the headline): one rank per spare core (half the cores), one torch thread each, so that host CPU
  is left to the sidecars, as on a GPU node whose host cores mostly wait for the GPUs. Its summary keys are
  ``headroom_step_ratio`` (median), ``headroom_mean_ratio`` and ``headroom_skipped``.
- ``saturated``: ``--ranks`` ranks of ``--threads`` threads (default 2 of 1: both cores of a 2-core machine
  train), so that the sidecars stream with CPU that training wanted. Keys ``saturated_*`` alike.

Three scenarios run alone, in modules of their own: ``node`` (:mod:`.node`, the rate a node's snapshots
sustain), ``ideal`` (:mod:`.ideal`, headroom's training beside the least work a snapshot's bytes can take, the
yardstick for the sidecars' CPU beside training) and ``sidecars`` (:mod:`.sidecars`, the sidecars' CPU per
snapshot with no training beside them, against the floor of any checked transfer).

The other summary keys (``step_ratio``, ``torch_save_ratio``, ...) are the headline scenario's: headroom when it
ran. Where the time goes, per snapshot and scenario: ``cpu_ms_per_snapshot`` is the CPU a snapshot costs in all,
the sum of ``rank_cpu_ms_per_snapshot`` (the rank processes' extra CPU over ``none``: ``capture()``'s walk, the
staging copy, the announce), ``sidecar_user_ms_per_snapshot`` (both sidecars' own code: checksums, Python,
ZeroMQ) and ``sidecar_system_ms_per_snapshot`` (the kernel's work for them: socket copies, TCP). The sidecars'
parts are what they used during the ``snapshotd`` blocks (each up to the end of the wait for its last snapshot)
beyond what they use idle, at the rate measured during the other blocks (``sidecar_idle_cores``: heartbeats
and the ranks' registrations, which cost the same whether or not snapshots are taken). Beside them,
measured on this machine in the same run for the same bytes (the least of three tries each), the physical
minimum ``minimum_cpu_ms``: ``minimum_copy_ms`` (one memcpy of the state, the staging copy's counterpart) plus
``minimum_wire_ms`` (a loopback TCP transfer of it, both ends' CPU: the sidecars' kernel time's counterpart);
and ``checksum_ms``, one xxh3-64 pass over it (the data path takes two: the sender's sidecar takes the
checksums, the buddy checks them). ``staging_Bps`` is the rate the ranks' staging copies ran at (their bytes
over their time, :attr:`~snapshotd.client.SnapshotStats.copy_seconds`: wall time, so a copy overlapping the
training step that shares its cores and memory reads slower than one alone), against ``copy_Bps``, this
device's best for the same bytes: a memcpy, or with ``--device cuda`` a device-to-host copy into page-locked
memory. With ``--device cuda`` that copy is the GPU's DMA, not the CPU's, so ``minimum_copy_ms`` (a memcpy's
CPU) has no counterpart in the ranks' CPU; the sidecars' parts compare as on the CPU.

The deployment is a coordinator and **two** sidecars, nodes A and B, with every
rank on node A: A streams each snapshot to B, its buddy (``replicas=1``), so this machine pays for one node's
whole snapshot traffic, sending (A) and receiving (B) both, which a real node would split with its buddies.

Per variant (the first ``--warmup`` steps of each run left out; a variant with interval N runs its measured steps
in a multiple of N, so that they hold exactly one save per N steps): the median, mean and p99 step time (per step,
the mean over ranks; with ``--every auto`` most steps carry no snapshot, so the mean is the figure that counts),
the time the training thread was blocked (per step, the largest over ranks: ``capture()`` plus the
optimizer fence; the ``torch.save`` call; or ``async_save`` plus waiting for the previous one), the bytes moved
off the rank processes per step (snapshotd: state streamed to the buddy, counted from the snapshots every buddy
acknowledged; the baselines: bytes written to disk), the effective interval between completed snapshots or
checkpoints, and the ratio of the median step time to ``none``'s. Where the time goes: ``rank_cpu_ms`` is the CPU
time of all rank processes per step (median; every thread, so it includes snapshotd's staging copy and DCP's
writer), ``sidecar_cpu_ms`` the CPU time both sidecars used for the snapshots (as above) divided by the snapshotd
steps (sending on A, receiving and verifying on B).
``--every``, ``--max-rate`` and ``--sidecar-nice`` (the sidecars under ``nice``, so that they take only the cycles
training leaves) show how the cost trades against the effective snapshot interval.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from snapshotd.harness.cluster import LocalCluster
from snapshotd.harness.ranks import every_arg, plan_interval, run_ranks
from snapshotd.proto import checksum
from snapshotd.units import parse_bytes, parse_rate

from .baselines import process_cpu_times
from .ideal import run_ideal
from .node import run_node
from .report import Report, default_plot, progress, save_figure, scratch_dir
from .sidecars import PERIOD, run_sidecars

__all__ = ["VARIANTS", "add_arguments", "plot", "run"]

VARIANTS = ("none", "snapshotd", "torch_save", "dcp_async")
_SUMMARY_RATIO = {"torch_save": "torch_save_ratio", "dcp_async": "dcp_async_ratio"}
SCENARIOS = ("headroom", "saturated")
_COLUMNS = [
    "scenario",
    "variant",
    "interval",
    "runs",
    "step_median_ms",
    "step_mean_ms",
    "step_p99_ms",
    "step_ratio",
    "mean_ratio",
    "blocked_median_ms",
    "blocked_mean_ms",
    "rank_cpu_ms",
    "sidecar_cpu_ms",
    "moved_per_step_bytes",
    "moved_to",
    "completed_every",
]


_CONFIG_KEYS = (
    "scenario",
    "params",
    "ranks",
    "steps",
    "warmup",
    "rounds",
    "batch",
    "interval",
    "variants",
    "every",
    "replicated",
    "max_rate",
    "sidecar_nice",
    "device",
    "threads",
)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _rate(text: str) -> str:
    """A ``--max-rate`` value the sidecar accepts (``auto`` or a rate), passed on as written."""
    if text != "auto":
        try:
            parse_rate(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or "none" not in names:
        raise argparse.ArgumentTypeError(
            f"variants are some of {', '.join(VARIANTS)}, 'none' included; got {text!r}"
        )
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``overhead`` subcommand's flags."""
    parser.add_argument(
        "--params",
        type=parse_bytes,
        default=9_000_000,
        help="model parameters, e.g. 9M (default 9M: ~110 MB of state per rank)",
    )
    parser.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "both", "node", "ideal", "sidecars"),
        default="both",
        help="headroom: one rank per spare core, CPU left to the sidecars (a GPU node); "
        "saturated: --ranks ranks using the cores; both (default): each in turn; node: "
        "--ranks ranks snapshotting back to back, the rate the node sustains "
        "(snapshotd.bench.node); ideal: headroom's training beside the least work a snapshot's bytes can take "
        "(snapshotd.bench.ideal); sidecars: the sidecars' CPU per snapshot with no training beside them "
        "(snapshotd.bench.sidecars)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="saturated: gloo ranks, all on node A (default 2; headroom: half the cores)",
    )
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    parser.add_argument("--rounds", type=int, default=8, help="runs of each variant, interleaved (default 8)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    parser.add_argument(
        "--interval",
        type=_int_list,
        default=[1],
        help="disk checkpoint every N steps; a comma list runs each (default 1)",
    )
    parser.add_argument(
        "--variants",
        type=_variants,
        default=list(VARIANTS),
        help=f"comma list of {','.join(VARIANTS)} (default all)",
    )
    parser.add_argument(
        "--every",
        type=every_arg,
        default=1,
        help="snapshotd: snapshot every K-th step, or auto: as often as 1%% of step time allows (default 1)",
    )
    parser.add_argument(
        "--max-rate", type=_rate, default=None, help="the sidecars' --max-rate, e.g. 2Gbit (default auto)"
    )
    parser.add_argument(
        "--replicated",
        action="store_true",
        help="snapshotd: each rank snapshots its share of the model, optimizer and scheduler, which "
        "every data-parallel rank holds alike (Snapshotter replicated=)",
    )
    parser.add_argument(
        "--sidecar-nice",
        type=int,
        default=10,
        help="the sidecars' --nice (default 10, as `snapshotd serve`; 0: the ranks' priority)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks train")
    parser.add_argument(
        "--threads", type=int, default=1, help="saturated: torch threads per rank (default 1; headroom: 1)"
    )
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for the whole job (default 600)"
    )


def _block_steps(args: argparse.Namespace, interval: int) -> int:
    """Steps of one block: the warmup, then at least ``--steps - --warmup`` measured steps, a multiple of the
    interval, so that the measured steps hold exactly one snapshot or save per interval."""
    measured = -(-(args.steps - args.warmup) // interval) * interval
    return args.warmup + measured


def _plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """The trainer's ``--plan``: ``--rounds`` times every (variant, interval), in order."""
    one: list[tuple[str, int]] = []
    for name in args.variants:
        if name == "none":
            one.append((name, 1))
        elif name == "snapshotd":
            one.append((name, plan_interval(args.every)))
        else:
            one.extend((name, n) for n in args.interval)
    return [(name, n, _block_steps(args, n)) for name, n in one] * args.rounds


Blocks = list[list[dict[str, Any]]]
"""The blocks of one variant: per block, per rank, its counters and its per-step lists (warmup included)."""

_PER_STEP = ("step_times", "blocked_times", "capture_times", "fence_times", "cpu_times")


CpuTimes = dict[str, tuple[float, float]]
"""node -> (user, system) CPU seconds its sidecar used during the job (empty where /proc cannot tell)."""


class SidecarCpu(NamedTuple):
    """Both sidecars' CPU during a job, apart (empty where /proc cannot tell)."""

    total: CpuTimes
    """Each sidecar's over the whole job."""
    snapshots: tuple[float, float]
    """(user, system) seconds both used during the ``snapshotd`` blocks (each from its start to the end of the
    wait for its last snapshot) beyond what they use idle, at ``idle``'s rate, in the same time: what the
    snapshots cost."""
    idle: tuple[float, float]
    """(user, system) seconds per second both used during the other blocks, where no snapshot is taken
    (heartbeats, the ranks' registrations): cores."""


class _CpuSampler:
    """Samples the summed (user, system) CPU seconds of some processes every ``every`` seconds on a thread, so
    that what they used between two wall-clock times can be read afterwards (linearly between samples)."""

    def __init__(self, pids: list[int], every: float = 0.1) -> None:
        self.pids = pids
        self.every = every
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        times = [process_cpu_times(pid) for pid in self.pids]
        if all(t is not None for t in times):
            self.samples.append((time.time(), sum(t[0] for t in times if t), sum(t[1] for t in times if t)))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.every):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sample()

    def between(self, t0: float, t1: float) -> tuple[float, float]:
        """(user, system) seconds used between wall-clock times ``t0`` and ``t1``."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        ts = [s[0] for s in self.samples]

        def at(t: float, k: int) -> float:
            return float(np.interp(t, ts, [s[k] for s in self.samples]))

        return at(t1, 1) - at(t0, 1), at(t1, 2) - at(t0, 2)


def _attribute(sampler: _CpuSampler, blocks: list[dict[str, Any]], total: CpuTimes) -> SidecarCpu:
    """Split the sidecars' CPU between the snapshotd blocks and idle (see :class:`SidecarCpu`)."""
    snap = [0.0, 0.0, 0.0]  # user, system, seconds
    other = [0.0, 0.0, 0.0]
    for block in blocks:
        user, system = sampler.between(block["began"], block["ended"])
        into = snap if block["variant"] == "snapshotd" else other
        into[0] += user
        into[1] += system
        into[2] += block["ended"] - block["began"]
    idle = (other[0] / other[2], other[1] / other[2]) if other[2] > 0 else (0.0, 0.0)
    beyond = (max(0.0, snap[0] - idle[0] * snap[2]), max(0.0, snap[1] - idle[1] * snap[2]))
    return SidecarCpu(total, beyond, idle)


def _measure(args: argparse.Namespace, workdir: str) -> tuple[dict[tuple[str, int], Blocks], int, SidecarCpu]:
    """Run the plan on a fresh cluster.

    Returns:
        (variant, interval) -> its blocks; the state bytes per rank; the sidecars' CPU during the job.
    """
    plan = _plan(args)
    total = sum(k for _, _, k in plan)
    extra = ("--max-rate", args.max_rate) if args.max_rate else ()
    flags = [
        "--steps",
        str(total),
        "--params",
        str(args.params),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--no-digest",
        "--plan",
        json.dumps(plan),
        "--every",
        str(args.every),
        *(["--replicated"] if args.replicated else []),
    ]
    if any(name in _SUMMARY_RATIO for name, _, _ in plan):
        flags += ["--ckpt-dir", os.path.join(workdir, "checkpoints")]
    with LocalCluster(workdir, replicas=1, heartbeat_interval=0.5, heartbeat_timeout=5.0) as cluster:
        cluster.start_coordinator()
        cluster.start_sidecar("A", *extra, "--nice", str(args.sidecar_nice))
        cluster.start_sidecar("B", *extra, "--nice", str(args.sidecar_nice))
        if "snapshotd" in args.variants:
            flags += ["--job", f"overhead-{uuid.uuid4().hex[:8]}", "--sidecar", cluster.ipc_path("A")]
        pids = {node: p.pid for node, p in cluster.sidecars.items()}
        cpu0 = {node: process_cpu_times(pid) for node, pid in pids.items()}
        sampler = _CpuSampler(list(pids.values()))
        try:
            with progress(unit="steps") as bar:
                task = bar.add_task("overhead steps", total=total)
                results = run_ranks(
                    workdir,
                    args.ranks,
                    flags,
                    timeout=args.timeout,
                    on_progress=lambda n: bar.update(task, completed=n),
                )
        finally:
            sampler.stop()
            shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
        cpu1 = {node: process_cpu_times(pid) for node, pid in pids.items()}
    whole: CpuTimes = {}
    for node in pids:
        start, end = cpu0[node], cpu1[node]
        if start is None or end is None:
            whole = {}
            break
        whole[node] = (end[0] - start[0], end[1] - start[1])
    sidecar_cpu = (
        _attribute(sampler, results[0]["blocks"], whole) if whole else SidecarCpu({}, (0.0, 0.0), (0.0, 0.0))
    )
    out: dict[tuple[str, int], Blocks] = {}
    for i, (name, interval, steps) in enumerate(plan):
        ranks = []
        for res in results:
            block = res["blocks"][i]
            assert (block["variant"], block["interval"], block["steps"]) == (name, interval, steps)
            first = block["first"]
            ranks.append({**block, **{key: res[key][first : first + steps] for key in _PER_STEP}})
        out.setdefault((name, interval), []).append(ranks)
    return out, int(results[0]["state_bytes"]), sidecar_cpu


def _per_step(blocks: Blocks, key: str, warmup: int, combine: Any) -> np.ndarray:
    """``key``'s per-step values after warmup, combined over ranks (``np.mean``/``np.max``), pooled over blocks."""
    pooled = [combine(np.array([r[key] for r in ranks], dtype=float), axis=0)[warmup:] for ranks in blocks]
    return np.concatenate(pooled) if pooled else np.empty(0)


def _pooled(blocks: Blocks, key: str, warmup: int) -> np.ndarray:
    """``key``'s per-step values of every rank after warmup, pooled."""
    return np.array([v for ranks in blocks for r in ranks for v in r[key][warmup:]], dtype=float)


def _moved(name: str, blocks: Blocks) -> tuple[float, float | None]:
    """(bytes moved per step, summed over ranks; steps per completed snapshot or checkpoint) for a variant.

    Over every step of the blocks, warmup included, since the counters cover them all.
    """
    steps = sum(ranks[0]["steps"] for ranks in blocks)
    if name == "snapshotd":
        moved = sum(
            r["bytes"] / r["started"] * r["durable"] for ranks in blocks for r in ranks if r["started"]
        )
        completed = sum(float(np.mean([r["durable"] for r in ranks])) for ranks in blocks)
    elif name in _SUMMARY_RATIO:
        moved = sum(r["bytes_written"] * r["saves_completed"] for ranks in blocks for r in ranks)
        completed = sum(max(r["saves_completed"] for r in ranks) for ranks in blocks)
    else:
        return 0.0, None
    return moved / steps, (steps / completed if completed else None)


def _row(scenario: str, name: str, interval: int, blocks: Blocks, warmup: int) -> dict[str, Any]:
    step = _per_step(blocks, "step_times", warmup, np.mean)
    blocked = _per_step(blocks, "blocked_times", warmup, np.max)
    moved, every = _moved(name, blocks)
    cpu = _per_step(blocks, "cpu_times", warmup, np.sum)
    return {
        "scenario": scenario,
        "variant": name,
        "interval": None if name == "none" else interval,
        "runs": len(blocks),
        "step_median_ms": float(np.median(step)) * 1e3,
        "step_mean_ms": float(np.mean(step)) * 1e3,
        "step_p99_ms": float(np.percentile(step, 99)) * 1e3,
        "step_ratio": None,
        "mean_ratio": None,
        "blocked_median_ms": float(np.median(blocked)) * 1e3,
        "blocked_mean_ms": float(np.mean(blocked)) * 1e3,
        "rank_cpu_ms": float(np.median(cpu)) * 1e3,
        "rank_cpu_mean_ms": float(np.mean(cpu)) * 1e3,
        "sidecar_cpu_ms": None,
        "moved_per_step_bytes": moved,
        "moved_to": {"snapshotd": "node B (tcp)", "none": "-"}.get(name, "local disk"),
        "completed_every": every,
        "step_ms": [float(v) * 1e3 for v in step],
        "step_index": [
            i
            for ranks in blocks
            for i in range(ranks[0]["first"] + warmup, ranks[0]["first"] + ranks[0]["steps"])
        ],
    }


def _check(args: argparse.Namespace) -> None:
    if args.ranks < 1 or args.rounds < 1 or args.threads < 1 or args.batch < 1:
        raise ValueError("--ranks, --rounds, --every, --threads and --batch must be >= 1")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"need 0 <= --warmup < --steps, got {args.warmup} and {args.steps}")


def _shaped(args: argparse.Namespace, scenario: str) -> argparse.Namespace:
    """``args`` for ``scenario``: headroom runs one single-threaded rank per spare core (half the cores)."""
    if scenario == "headroom":
        return argparse.Namespace(**{**vars(args), "ranks": max(1, (os.cpu_count() or 2) // 2), "threads": 1})
    return args


class Minimum(NamedTuple):
    """The physical minimum for one snapshot of the state, measured on this machine (see :func:`physical_minimum`)."""

    copy_s: float
    """CPU seconds of one memcpy of the state."""
    wire_s: float
    """CPU seconds, both ends, of a loopback TCP transfer of it: the kernel's copy in at the sender and out at
    the receiver."""
    checksum_s: float
    """CPU seconds of one xxh3-64 pass over it, in the sidecar's blocks (a snapshot is checked twice: its own
    sidecar takes the checksums, the buddy checks them)."""
    copy_Bps: float
    """The rate of the staging copy's best case on this device: memcpy, or a CUDA device-to-host copy into
    page-locked memory."""


def physical_minimum(nbytes: int, device: str = "cpu", tries: int = 3) -> Minimum:
    """The least of ``tries`` measurements of each part of the physical minimum of a snapshot of ``nbytes``."""
    src: Any = np.full(nbytes, 7, dtype=np.uint8)
    dst: Any = np.zeros(nbytes, dtype=np.uint8)
    copies = [_copy_seconds(src, dst) for _ in range(tries)]
    copy_Bps = nbytes / min(wall for _, wall in copies)
    if device == "cuda":
        copy_Bps = _device_to_host_Bps(nbytes, tries)
    return Minimum(
        copy_s=min(cpu for cpu, _ in copies),
        wire_s=min(_send_cpu_seconds(src, dst) for _ in range(tries)),
        checksum_s=min(_checksum_cpu_seconds(src) for _ in range(tries)),
        copy_Bps=copy_Bps,
    )


def _copy_seconds(src: Any, dst: Any) -> tuple[float, float]:
    """(CPU, wall) seconds of one memcpy of ``src`` into ``dst``."""
    c0, t0 = time.process_time(), time.perf_counter()
    np.copyto(dst, src)
    return time.process_time() - c0, time.perf_counter() - t0


def _checksum_cpu_seconds(src: Any, block: int = 4 << 20) -> float:
    view = memoryview(src)
    c0 = time.process_time()
    for at in range(0, view.nbytes, block):
        checksum(view[at : at + block])
    return time.process_time() - c0


def _send_cpu_seconds(src: Any, dst: Any) -> float:
    nbytes = src.nbytes
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname(), timeout=60)
        receiver, _ = server.accept()
        receiver.settimeout(60)
        with sender, receiver:
            c0 = time.process_time()
            thread = threading.Thread(target=sender.sendall, args=(memoryview(src),), daemon=True)
            thread.start()
            view, got = memoryview(dst), 0
            while got < nbytes:
                n = receiver.recv_into(view[got:])
                if not n:
                    raise RuntimeError("the loopback transfer ended early")
                got += n
            thread.join(60)
            return time.process_time() - c0


def _device_to_host_Bps(nbytes: int, tries: int) -> float:
    """The best rate of a copy of ``nbytes`` from the current CUDA device into page-locked host memory."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(tries):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return nbytes / best


def _scenario(
    args: argparse.Namespace, scenario: str, workdir: str
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Measure ``scenario``: its rows, its summary (keys without the scenario's prefix), state bytes per rank."""
    shaped = _shaped(args, scenario)
    measured, state_bytes, sidecar_cpu = _measure(shaped, os.path.join(workdir, scenario))
    rows = [
        _row(scenario, name, interval, blocks, args.warmup) for (name, interval), blocks in measured.items()
    ]
    snap_runs = measured.get(("snapshotd", plan_interval(args.every)), [])
    snap_steps = sum(ranks[0]["steps"] for ranks in snap_runs)
    none = next(r for r in rows if r["variant"] == "none")
    for row in rows:
        row["step_ratio"] = row["step_median_ms"] / none["step_median_ms"]
        row["mean_ratio"] = row["step_mean_ms"] / none["step_mean_ms"]
        if row["variant"] == "snapshotd" and sidecar_cpu.total and snap_steps:
            row["sidecar_cpu_ms"] = sum(sidecar_cpu.snapshots) / snap_steps * 1e3
    out: dict[str, Any] = {
        "ranks": shaped.ranks,
        "threads": shaped.threads,
        "step_ratio": None,
        "mean_ratio": None,
        "capture_ms_median": None,
        "fence_ms_median": None,
        "snapshots_durable": sum(r["durable"] for ranks in snap_runs for r in ranks),
        "snapshots_skipped": sum(r["skipped"] for ranks in snap_runs for r in ranks),
        "cpu_ms_per_snapshot": None,
        "rank_cpu_ms_per_snapshot": None,
        "sidecar_user_ms_per_snapshot": None,
        "sidecar_system_ms_per_snapshot": None,
        "torch_save_ratio": None,
        "dcp_async_ratio": None,
        "staging_Bps": None,
        # per node, over the whole job: A sends, B receives
        "sidecar_cpu_seconds": {node: sum(times) for node, times in sidecar_cpu.total.items()},
        "sidecar_idle_cores": sum(sidecar_cpu.idle) if sidecar_cpu.total else None,
    }
    if snap_runs:
        snap = next(r for r in rows if r["variant"] == "snapshotd")
        out.update(
            step_ratio=snap["step_ratio"],
            mean_ratio=snap["mean_ratio"],
            capture_ms_median=float(np.median(_pooled(snap_runs, "capture_times", args.warmup))) * 1e3,
            fence_ms_median=float(np.median(_pooled(snap_runs, "fence_times", args.warmup))) * 1e3,
        )
        started = sum(r["started"] for ranks in snap_runs for r in ranks)
        if sidecar_cpu.total and started:  # the ranks' extra CPU over none (all ranks), plus both sidecars'
            rank = max(0.0, snap["rank_cpu_mean_ms"] - none["rank_cpu_mean_ms"]) * snap_steps / started
            user, system = (seconds * 1e3 / started for seconds in sidecar_cpu.snapshots)
            out.update(
                cpu_ms_per_snapshot=rank + user + system,
                rank_cpu_ms_per_snapshot=rank,
                sidecar_user_ms_per_snapshot=user,
                sidecar_system_ms_per_snapshot=system,
            )
        copied = sum(r["copy_seconds"] for ranks in snap_runs for r in ranks)
        if copied > 0:
            out["staging_Bps"] = sum(r["bytes"] for ranks in snap_runs for r in ranks) / copied
    for name, key in _SUMMARY_RATIO.items():
        at = [r for r in rows if r["variant"] == name and r["interval"] == min(args.interval)]
        if at:
            out[key] = at[0]["step_ratio"]
    return rows, out, state_bytes


def run(args: argparse.Namespace) -> Report:
    """Measure every variant in each scenario as the module docstring says; see :func:`add_arguments`.

    Raises:
        ValueError: bad arguments.
        RuntimeError: a rank or a sidecar failed (with its log's tail).
    """
    _check(args)
    if args.scenario == "node":
        return _run_node(args)
    if args.scenario == "ideal":
        return _run_ideal(args)
    if args.scenario == "sidecars":
        return _run_sidecars(args)
    scenarios = SCENARIOS if args.scenario == "both" else (args.scenario,)
    setup = (
        f"gloo ranks on node A, each snapshot streamed to node B (replicas=1, loopback TCP); both sidecars "
        f"share this machine's {os.cpu_count()} cores with the ranks"
    )
    print(f"overhead: {setup}", flush=True)
    load = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    per: dict[str, dict[str, Any]] = {}
    state_bytes = 0
    with scratch_dir(args.workdir, prefix="snapshotd-overhead-") as workdir:
        for scenario in scenarios:
            shaped = _shaped(args, scenario)
            print(f"  {scenario}: {shaped.ranks} rank(s) of {shaped.threads} thread(s)", flush=True)
            measured, per[scenario], state_bytes = _scenario(args, scenario, workdir)
            rows += measured
    minimum = physical_minimum(state_bytes, args.device)
    minimum_ms = (minimum.copy_s + minimum.wire_s) * 1e3
    head = per[scenarios[0]]
    summary: dict[str, Any] = {
        "scenario": scenarios[0],
        "state_bytes_per_rank": state_bytes,
        **{
            key: head[key]
            for key in (
                "step_ratio",
                "mean_ratio",
                "capture_ms_median",
                "fence_ms_median",
                "snapshots_durable",
                "snapshots_skipped",
                "torch_save_ratio",
                "dcp_async_ratio",
            )
        },
        "minimum_cpu_ms": minimum_ms,
        "minimum_copy_ms": minimum.copy_s * 1e3,
        "minimum_wire_ms": minimum.wire_s * 1e3,
        "checksum_ms": minimum.checksum_s * 1e3,
        "copy_Bps": minimum.copy_Bps,
    }
    for scenario, figures in per.items():
        summary[f"{scenario}_step_ratio"] = figures["step_ratio"]
        summary[f"{scenario}_mean_ratio"] = figures["mean_ratio"]
        summary[f"{scenario}_skipped"] = figures["snapshots_skipped"]
        summary[f"{scenario}_cpu_ms_per_snapshot"] = figures["cpu_ms_per_snapshot"]
        per_snapshot = figures["cpu_ms_per_snapshot"]
        summary[f"{scenario}_cpu_vs_minimum"] = (
            per_snapshot / minimum_ms if per_snapshot and minimum_ms > 0 else None
        )
        for key in (
            "rank_cpu_ms_per_snapshot",
            "sidecar_user_ms_per_snapshot",
            "sidecar_system_ms_per_snapshot",
            "staging_Bps",
        ):
            summary[f"{scenario}_{key}"] = figures[key]
    config = {key: getattr(args, key) for key in _CONFIG_KEYS}
    config.update(
        setup=setup,
        scenarios={
            k: {key: v[key] for key in ("ranks", "threads", "sidecar_cpu_seconds")} for k, v in per.items()
        },
    )
    config["loadavg_1min"] = [
        load,
        os.getloadavg()[0],
    ]  # before and after: other work on the machine skews all
    return Report("overhead", config, rows, summary, columns=list(_COLUMNS))


def _run_node(args: argparse.Namespace) -> Report:
    setup = (
        f"{args.ranks} rank(s) on node A snapshotting back to back, each streamed to node B (replicas=1, "
        f"loopback TCP); {os.cpu_count()} cores"
    )
    return _run_apart(
        args, setup, run_node, ["scenario", "variant", "runs", "moved_per_step_bytes", "moved_to"]
    )


def _run_ideal(args: argparse.Namespace) -> Report:
    setup = (
        f"1 rank of 1 thread training; after each step its state copied into shared memory and sent whole to "
        f"another process over loopback TCP by a third; {os.cpu_count()} cores"
    )

    def measure(args: argparse.Namespace, workdir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        rows, summary, nbytes = run_ideal(args, workdir)
        minimum = physical_minimum(nbytes)
        minimum_ms = (minimum.copy_s + minimum.wire_s) * 1e3
        summary.update(
            minimum_cpu_ms=minimum_ms,
            minimum_copy_ms=minimum.copy_s * 1e3,
            minimum_wire_ms=minimum.wire_s * 1e3,
            ideal_vs_minimum=summary["ideal_cpu_ms_per_snapshot"] / minimum_ms if minimum_ms > 0 else None,
        )
        return rows, summary

    return _run_apart(
        args, setup, measure, ["scenario", "variant", "steps", "step_median_s", "step_mean_s", "rank_cpu_ms"]
    )


def _run_sidecars(args: argparse.Namespace) -> Report:
    setup = f"the sidecars alone: 1 rank snapshotting headroom's state every {PERIOD} s, no training; {os.cpu_count()} cores"

    def measure(args: argparse.Namespace, workdir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        rows, summary, nbytes = run_sidecars(args, workdir)
        minimum = physical_minimum(nbytes)
        floor_ms = (minimum.wire_s + 2 * minimum.checksum_s) * 1e3
        summary.update(
            minimum_wire_ms=minimum.wire_s * 1e3,
            checksum_ms=minimum.checksum_s * 1e3,
            sidecars_floor_ms=floor_ms,
            sidecars_vs_floor=summary["sidecars_cpu_ms_per_snapshot"] / floor_ms if floor_ms > 0 else None,
        )
        return rows, summary

    return _run_apart(
        args, setup, measure, ["scenario", "block", "snapshots", "user_ms", "system_ms", "cpu_ms"]
    )


def _run_apart(
    args: argparse.Namespace,
    setup: str,
    measure: Callable[[argparse.Namespace, str], tuple[list[dict[str, Any]], dict[str, Any]]],
    columns: list[str],
) -> Report:
    """A scenario measured by a module of its own: ``measure(args, workdir)`` gives its rows and summary."""
    print(f"overhead: {setup}", flush=True)
    with scratch_dir(args.workdir, prefix="snapshotd-overhead-") as workdir:
        rows, summary = measure(args, workdir)
    config = {key: getattr(args, key) for key in _CONFIG_KEYS}
    config.update(setup=setup)
    return Report("overhead", config, rows, summary, columns=columns)


def plot(report: Report, path: str) -> None:
    """Step times per variant: a box per variant (the ``none`` median as a line), and each run's steps in turn.
    The node, ideal and sidecars scenarios, which keep no steps per row, get the default plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report.results
    if any("step_ms" not in r for r in rows):
        default_plot(report, path)
        return
    labels = [
        f"{r.get('scenario', '')} {r['variant']}" + (f" N={r['interval']}" if r.get("interval") else "")
        for r in rows
    ]
    fig = Figure(figsize=(8.0, 7.0), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1)
    top.boxplot([r["step_ms"] for r in rows], whis=(1, 99), showfliers=True)
    top.set_xticks(
        range(1, len(rows) + 1),
        [f"{lab}\nx{r['step_ratio']:.3f}" for lab, r in zip(labels, rows, strict=True)],
    )
    for r in rows:
        if r["variant"] == "none":
            top.axhline(r["step_median_ms"], color="grey", linestyle="--", linewidth=1)
    top.set_ylabel("step time (ms)")
    top.set_title("step time per variant (box: quartiles, whiskers: p1-p99; x = median ratio to none)")
    top.grid(True, axis="y", alpha=0.3)
    for lab, r in zip(labels, rows, strict=True):
        bottom.plot(r["step_index"], r["step_ms"], marker=".", linestyle="none", label=lab)
    bottom.set_xlabel("step of the training job (runs interleaved; warmup steps left out)")
    bottom.set_ylabel("step time (ms)")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize="small")
    cfg = report.config
    fig.suptitle(
        f"snapshotd-bench overhead: {cfg.get('scenario')}, {cfg.get('params', 0) / 1e6:.1f}M params, "
        f"{cfg.get('device')}"
    )
    fig.tight_layout()
    save_figure(fig, path)
