"""``snapshotd-bench overhead``: what a snapshot after every step costs training, beside today's disk checkpoints.

A real data-parallel job (``--ranks`` gloo processes of :mod:`snapshotd.bench.trainer`, training the GPT of
:mod:`.workloads` with AdamW; about 12 bytes of state per parameter) runs again and again, one variant per run,
interleaved round by round (``none, snapshotd, torch_save, dcp_async, none, snapshotd, ...``) so that drift in the
machine's speed hits every variant alike:

- ``none``: no checkpointing.
- ``snapshotd``: :class:`~snapshotd.client.Snapshotter` ``capture()`` after every step (``--every``).
- ``torch_save``: rank 0 ``torch.save``-s the model, optimizer and scheduler state to local disk every N steps.
- ``dcp_async``: every rank ``torch.distributed.checkpoint.async_save``-s every N steps, first waiting for the
  previous save (see :class:`~.baselines.DiskCheckpointer`).

N is each value of ``--interval``. The deployment is a coordinator and **two** sidecars, nodes A and B, with every
rank on node A: A streams each snapshot to B, its buddy (``replicas=1``), so this machine pays for one node's
whole snapshot traffic, sending (A) and receiving (B) both, which a real node would split with its buddies.

Per variant (the first ``--warmup`` steps of each run left out): the median and p99 step time (per step, the mean
over ranks), the time the training thread was blocked (per step, the largest over ranks: ``capture()`` plus the
optimizer fence; the ``torch.save`` call; or ``async_save`` plus waiting for the previous one), the bytes moved
off the rank processes per step (snapshotd: state streamed to the buddy, counted from the snapshots every buddy
acknowledged; the baselines: bytes written to disk), the effective interval between completed snapshots or
checkpoints, and the ratio of the median step time to ``none``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from snapshotd.local_cluster import LocalCluster
from snapshotd.units import parse_bytes, parse_rate

from .report import Progress, Report

__all__ = ["VARIANTS", "add_arguments", "plot", "run"]

VARIANTS = ("none", "snapshotd", "torch_save", "dcp_async")
_SUMMARY_RATIO = {"torch_save": "torch_save_ratio", "dcp_async": "dcp_async_ratio"}
_COLUMNS = ["variant", "interval", "runs", "step_median_ms", "step_p99_ms", "step_ratio", "blocked_median_ms",
            "blocked_mean_ms", "moved_per_step_bytes", "moved_to", "completed_every"]  # fmt: skip


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or "none" not in names:
        raise argparse.ArgumentTypeError(f"variants are some of {', '.join(VARIANTS)}, 'none' included; got {text!r}")
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``overhead`` subcommand's flags."""
    parser.add_argument("--params", type=parse_bytes, default=9_000_000,
                        help="model parameters, e.g. 9M (default 9M: ~110 MB of state per rank)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks, all on node A (default 2)")
    parser.add_argument("--steps", type=int, default=18, help="training steps per run (default 18)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, interleaved (default 2)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    parser.add_argument("--interval", type=_int_list, default=[1],
                        help="disk checkpoint every N steps; a comma list runs each (default 1)")
    parser.add_argument("--variants", type=_variants, default=list(VARIANTS),
                        help=f"comma list of {','.join(VARIANTS)} (default all)")
    parser.add_argument("--every", type=int, default=1, help="snapshotd: snapshot every K-th step (default 1)")
    parser.add_argument("--max-rate", default=None, help="the sidecars' --max-rate, e.g. 2Gbit (default auto)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks train")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds for one run (default 300)")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: str, lines: int = 20) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def _run_ranks(workdir: str, tag: str, ranks: int, flags: list[str], timeout: float) -> list[dict[str, Any]]:
    """Start ``ranks`` trainer processes, wait for all (at most ``timeout`` s) and return their results.

    Raises:
        RuntimeError: a rank failed or ran out of time (every rank is killed first; its log tail is attached).
    """
    port = _free_port()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs = {r: os.path.join(workdir, f"{tag}-rank{r}.log") for r in range(ranks)}
    outs = {r: os.path.join(workdir, f"{tag}-rank{r}.json") for r in range(ranks)}
    try:
        for r in range(ranks):
            argv = [sys.executable, "-m", "snapshotd.bench.trainer", "--rank", str(r), "--world", str(ranks),
                    "--init", f"tcp://127.0.0.1:{port}", "--out", outs[r], *flags]  # fmt: skip
            with open(logs[r], "wb") as log:
                procs[r] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        for r, proc in procs.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{tag}: rank {r} did not finish within {timeout:.0f} s:\n{_tail(logs[r])}") from None
            if code != 0:
                raise RuntimeError(f"{tag}: rank {r} exited with {code}:\n{_tail(logs[r])}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    results = []
    for r in range(ranks):
        with open(outs[r]) as f:
            results.append(json.load(f))
    return results


def _schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """One round of (variant, interval) runs, in order."""
    runs: list[tuple[str, int]] = []
    for name in args.variants:
        if name == "none":
            runs.append((name, 0))
        elif name == "snapshotd":
            runs.append((name, args.every))
        else:
            runs.extend((name, n) for n in args.interval)
    return runs


def _trainer_flags(name: str, interval: int, job: str, ipc: str, ckpt_dir: str) -> list[str]:
    if name == "snapshotd":
        return ["--job", job, "--sidecar", ipc, "--every", str(interval)]
    if name in _SUMMARY_RATIO:
        return ["--checkpoint", name, "--interval", str(interval), "--ckpt-dir", ckpt_dir]
    return []


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[str]:
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="snapshotd-overhead-") as tmp:
            yield tmp


def _measure(args: argparse.Namespace, workdir: str) -> dict[tuple[str, int], list[list[dict[str, Any]]]]:
    """Run the interleaved schedule; (variant, interval) -> one list of rank results per run."""
    order = _schedule(args) * args.rounds
    out: dict[tuple[str, int], list[list[dict[str, Any]]]] = {key: [] for key in order}
    extra = ("--max-rate", args.max_rate) if args.max_rate else ()
    common = ["--steps", str(args.steps), "--params", str(args.params), "--batch", str(args.batch),
              "--threads", str(args.threads), "--device", args.device, "--no-digest"]  # fmt: skip
    with LocalCluster(workdir, replicas=1, heartbeat_interval=0.5, heartbeat_timeout=5.0) as cluster:
        cluster.start_coordinator()
        cluster.start_sidecar("A", *extra)
        cluster.start_sidecar("B", *extra)
        with Progress(len(order), desc="overhead runs", unit="runs") as progress:
            for i, (name, interval) in enumerate(order):
                tag = f"run{i:02d}-{name}-{interval}"
                ckpt_dir = os.path.join(workdir, f"{tag}-ckpt")
                os.makedirs(ckpt_dir)
                try:
                    job = f"overhead-{uuid.uuid4().hex[:8]}"
                    flags = _trainer_flags(name, interval, job, cluster.ipc_path("A"), ckpt_dir)
                    out[(name, interval)].append(
                        _run_ranks(workdir, tag, args.ranks, common + flags, args.run_timeout)
                    )
                finally:
                    shutil.rmtree(ckpt_dir, ignore_errors=True)
                progress.update()
    return out


def _per_step(runs: list[list[dict[str, Any]]], key: str, warmup: int, combine: Any) -> np.ndarray:
    """``key``'s per-step values after warmup, combined over ranks (``np.mean``/``np.max``), pooled over runs."""
    pooled = [combine(np.array([r[key] for r in ranks], dtype=float), axis=0)[warmup:] for ranks in runs]
    return np.concatenate(pooled) if pooled else np.empty(0)


def _pooled(runs: list[list[dict[str, Any]]], key: str, warmup: int) -> np.ndarray:
    """``key``'s per-step values of every rank after warmup, pooled."""
    return np.array([v for ranks in runs for r in ranks for v in r[key][warmup:]], dtype=float)


def _moved(name: str, runs: list[list[dict[str, Any]]], steps: int) -> tuple[float, float | None]:
    """(bytes moved per step, summed over ranks; steps per completed snapshot or checkpoint) for a variant."""
    total_steps = steps * len(runs)
    if name == "snapshotd":
        moved = completed = 0.0
        for ranks in runs:
            for r in ranks:
                s = r["stats"]
                moved += s["bytes"] / s["started"] * s["durable"] if s["started"] else 0.0
            completed += float(np.mean([r["stats"]["durable"] for r in ranks]))
    elif name in _SUMMARY_RATIO:
        moved = sum(r["checkpoint"]["bytes_written"] * r["checkpoint"]["completed"] for ranks in runs for r in ranks)
        completed = sum(max(r["checkpoint"]["completed"] for r in ranks) for ranks in runs)
    else:
        return 0.0, None
    return moved / total_steps, (total_steps / completed if completed else None)


def _row(name: str, interval: int, runs: list[list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    step = _per_step(runs, "step_times", args.warmup, np.mean)
    blocked = _per_step(runs, "blocked_times", args.warmup, np.max)
    moved, every = _moved(name, runs, args.steps)
    return {
        "variant": name,
        "interval": interval or None,
        "runs": len(runs),
        "step_median_ms": float(np.median(step)) * 1e3,
        "step_p99_ms": float(np.percentile(step, 99)) * 1e3,
        "step_ratio": None,
        "blocked_median_ms": float(np.median(blocked)) * 1e3,
        "blocked_mean_ms": float(np.mean(blocked)) * 1e3,
        "moved_per_step_bytes": moved,
        "moved_to": {"snapshotd": "node B (tcp)", "none": "-"}.get(name, "local disk"),
        "completed_every": every,
        "step_ms": [float(v) * 1e3 for v in step],
    }


def _check(args: argparse.Namespace) -> None:
    if args.ranks < 1 or args.rounds < 1 or args.every < 1 or args.threads < 1 or args.batch < 1:
        raise ValueError("--ranks, --rounds, --every, --threads and --batch must be >= 1")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"need 0 <= --warmup < --steps, got {args.warmup} and {args.steps}")
    if args.max_rate:
        parse_rate(args.max_rate)  # a bad value fails here, not in the sidecar


def run(args: argparse.Namespace) -> Report:
    """Measure every variant as the module docstring says; see :func:`add_arguments` for ``args``.

    Raises:
        ValueError: bad arguments.
        RuntimeError: a rank or a sidecar failed (with its log's tail).
    """
    _check(args)
    setup = (f"{args.ranks} gloo ranks on node A, each snapshot streamed to node B (replicas=1, loopback TCP); "
             f"both sidecars share this machine's {os.cpu_count()} cores with the ranks")  # fmt: skip
    print(f"overhead: {setup}", flush=True)
    with _workdir(args.workdir) as workdir:
        measured = _measure(args, workdir)
    rows = [_row(name, interval, runs, args) for (name, interval), runs in measured.items()]
    base = next(r["step_median_ms"] for r in rows if r["variant"] == "none")
    for row in rows:
        row["step_ratio"] = row["step_median_ms"] / base
    snap_runs = measured.get(("snapshotd", args.every), [])
    first = next(iter(measured.values()))[0][0]
    summary: dict[str, Any] = {
        "state_bytes_per_rank": first["state_bytes"],
        "step_ratio": None,
        "capture_ms_median": None,
        "fence_ms_median": None,
        "snapshots_durable": sum(r["stats"]["durable"] for ranks in snap_runs for r in ranks),
        "snapshots_skipped": sum(r["stats"]["skipped"] for ranks in snap_runs for r in ranks),
        "torch_save_ratio": None,
        "dcp_async_ratio": None,
    }
    if snap_runs:
        summary["step_ratio"] = next(r["step_ratio"] for r in rows if r["variant"] == "snapshotd")
        summary["capture_ms_median"] = float(np.median(_pooled(snap_runs, "capture_times", args.warmup))) * 1e3
        summary["fence_ms_median"] = float(np.median(_pooled(snap_runs, "fence_times", args.warmup))) * 1e3
    for name, key in _SUMMARY_RATIO.items():
        at = [r for r in rows if r["variant"] == name and r["interval"] == min(args.interval)]
        if at:
            summary[key] = at[0]["step_ratio"]
    config = {key: getattr(args, key) for key in ("params", "ranks", "steps", "warmup", "rounds", "batch",
                                                  "interval", "variants", "every", "max_rate", "device", "threads")}  # fmt: skip
    config["setup"] = setup
    return Report("overhead", config, rows, summary, columns=list(_COLUMNS))


def plot(report: Report, path: str) -> None:
    """Step times per variant: a box per variant (the ``none`` median as a line), and each run's steps in turn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report.results
    labels = [r["variant"] + (f" N={r['interval']}" if r.get("interval") else "") for r in rows]
    fig = Figure(figsize=(8.0, 7.0), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1)
    top.boxplot([r["step_ms"] for r in rows], whis=(1, 99), showfliers=True)
    top.set_xticks(range(1, len(rows) + 1), [f"{lab}\nx{r['step_ratio']:.3f}" for lab, r in zip(labels, rows, strict=True)])
    base = next((r["step_median_ms"] for r in rows if r["variant"] == "none"), None)
    if base is not None:
        top.axhline(base, color="grey", linestyle="--", linewidth=1, label="none (median)")
        top.legend(loc="upper left")
    top.set_ylabel("step time (ms)")
    top.set_title("step time per variant (box: quartiles, whiskers: p1-p99; x = median ratio to none)")
    top.grid(True, axis="y", alpha=0.3)
    for lab, r in zip(labels, rows, strict=True):
        bottom.plot(r["step_ms"], marker=".", linewidth=0.8, label=lab)
    bottom.set_xlabel("measured step (runs of a variant one after another)")
    bottom.set_ylabel("step time (ms)")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize="small")
    cfg = report.config
    fig.suptitle(f"snapshotd-bench overhead: {cfg.get('ranks')} ranks, {cfg.get('params', 0) / 1e6:.1f}M params, "
                 f"{cfg.get('device')}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, format="png")
