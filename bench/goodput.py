"""``snapshotd-bench goodput``: useful training time of a long job under failures, snapshotd against disk checkpoints.

A model, not a measurement: it runs no training. It takes the costs that ``snapshotd-bench overhead`` and
``snapshotd-bench recovery`` measured (read from their ``--json`` files, or the defaults below, measured on the
machine named there) and computes the **effective training time ratio** (ETTR: useful training time / wall
time) of a ``--hours`` job for snapshotd and for checkpoint-restart at several intervals.

The wasted-time model
---------------------
Symbols: ``H`` the job's wall time (``--hours``); ``M`` the **job-level** mean time between failures
(``--mtbf``: the time between two failures anywhere in the job, so ``lambda = 1/M`` failures per second; a job of
``n`` nodes whose nodes each fail every ``m`` on average has ``M = m / n``, and the output shows the per-node MTBF
that ``--mtbf`` implies for ``--ranks / --ranks-per-node`` nodes); ``T`` the step time (``--step-seconds``);
``S`` the state per rank (``--state-bytes``); ``D`` the detection time and ``X`` the relaunch of the job's
processes (``--restart``, an assumption, not measured here), both the same for every strategy.

- **snapshotd**: every step runs a fraction ``o`` slower (``snapshotd_overhead``). A failure costs
  ``R_s = D + X + restore(S)`` plus the lost work, at most one step: ``T (1 + o)`` (charged in full).
- **checkpoint-restart** (``torch_save`` and ``dcp_async``, each at every ``--intervals`` value ``I`` of
  training time, and at Young's interval ``sqrt(2 c M)``): each checkpoint stalls training ``c = S / w`` (``w``,
  ``{kind}_Bps``: state bytes per second of stall). A failure costs ``R_c = D + X + load(S)`` plus the lost
  work: the time since the last completed checkpoint, ``(I + c)/2`` on average. ``load(S) = S / r``, ``r`` the
  ``torch.load`` rate from ``recovery``; with ``--storage-rate`` (the checkpoint store's aggregate read rate) at
  least ``ranks x S / storage_rate``, as every rank reloads at once.

From an ``overhead`` report, each variant is charged the larger of its two measured costs: the increase of the
mean step time over ``none`` and the time the training thread was blocked (``blocked_mean_ms``), so a noisy
step time cannot make a cost vanish. ``o`` is that cost over ``none``'s mean step; a checkpoint's stall is that
cost per step times N (its smallest interval), and ``w`` the state it checkpointed (``state_bytes_per_rank``)
over that stall. ``--step-ratio`` sets ``o = ratio - 1`` instead (e.g. from a GPU run).

To first order in ``lambda`` (failures rare against every cost; what the bullets above say)::

    ETTR_snapshotd ~ (1 - lambda (R_s + T (1 + o))) / (1 + o)
    ETTR_ckpt(I)   ~ (1 - lambda (R_c + (I + c) / 2)) * I / (I + c)

``ettr_expected`` is the exact long-run value for Poisson failures, where a failure during a recovery starts
it over (renewal-reward: a stretch between failures is exponential with mean ``M``, a recovery that must run
``R`` without a failure takes ``M (e^(R/M) - 1)`` on average, and a stretch of length ``x`` keeps
``floor(x / (I + c))`` checkpointed intervals)::

    ETTR_snapshotd = exp(-(R_s + T (1 + o)) / M) / (1 + o)
    ETTR_ckpt(I)   = I / (M (exp((I + c) / M) - 1) exp(R_c / M))

Both expand to the first-order forms. The simulation runs ``--trials`` jobs with exponential failure times
from a seeded RNG, the same failure times for every strategy in a trial, with the same rules; work done after
the last failure counts in full at the job's end, so a finite job's mean sits slightly above the long-run value.

Left out, each in checkpoint-restart's favour: snapshotd's fallback to a disk checkpoint when a rank and all its
buddies fail together; an asynchronous checkpoint's commit delay (its write after the stall); a collective's
timeout as the detector of a lost node (``D`` is snapshotd's heartbeat detection for both).

Summary: ``failures_expected``, ``ettr_snapshotd``, ``ettr_best_checkpoint``, ``best_checkpoint``, ``ettr_gain``
(snapshotd minus the best checkpoint strategy) and ``saved_hours`` (that gain over ``H``), all simulated means.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np

from snapshotd.units import format_bytes, parse_bytes, parse_duration, parse_rate

from .report import Report, save_figure

__all__ = ["DEFAULTS", "Strategy", "add_arguments", "expected_ettr", "load_inputs", "plot", "run", "simulate"]

DEFAULTS: dict[str, float] = {
    "detection_seconds": 1.55,
    "restore_seconds": 1.68,
    "torch_load_seconds": 0.806,
    "state_bytes": float(1 << 30),
    "snapshotd_overhead": 0.090,
    "torch_save_Bps": 6.45e8,
    "dcp_async_Bps": 2.71e8,
}
"""Inputs used when no JSON file gives them: figures of ``snapshotd-bench recovery`` and ``snapshotd-bench
overhead`` at their defaults on the project's 2-core development machine (docs/benchmarks.md, "Goodput"). Pass
``--overhead-json`` / ``--recovery-json`` from your own runs, or ``--step-ratio`` from a GPU run."""

_DEFAULT_SOURCE = "default (the development machine's figures, see goodput.DEFAULTS)"
_CHECKPOINTS = ("torch_save", "dcp_async")
_COLUMNS = [
    "strategy",
    "interval_seconds",
    "overhead",
    "recovery_seconds",
    "lost_seconds",
    "ettr_expected",
    "ettr_sim",
    "ettr_sim_p5",
    "ettr_sim_p95",
    "wasted_seconds",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``goodput`` subcommand's flags."""
    parser.add_argument(
        "--mtbf",
        type=parse_duration,
        default=3 * 3600.0,
        help="job-level mean time between failures (any node), e.g. 3h (default 3h)",
    )
    parser.add_argument("--hours", type=float, default=72.0, help="job wall time in hours (default 72)")
    parser.add_argument("--ranks", type=int, default=1024, help="ranks of the job (default 1024)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    parser.add_argument(
        "--overhead-json", default=None, help="JSON of snapshotd-bench overhead (default: DEFAULTS)"
    )
    parser.add_argument(
        "--recovery-json", default=None, help="JSON of snapshotd-bench recovery (default: DEFAULTS)"
    )
    parser.add_argument(
        "--intervals",
        type=_durations,
        default=[600.0, 1800.0, 3600.0, 7200.0],
        help="checkpoint intervals of training time (default 10min,30min,1h,2h)",
    )
    parser.add_argument("--step-seconds", type=float, default=1.0, help="training step time (default 1.0)")
    parser.add_argument(
        "--restart",
        type=parse_duration,
        default=60.0,
        help="relaunching the job's processes after a failure, any strategy (default 60s, assumed)",
    )
    parser.add_argument(
        "--state-bytes", type=parse_bytes, default=None, help="state per rank (default: the recovery run's)"
    )
    parser.add_argument(
        "--step-ratio",
        type=float,
        default=None,
        help="snapshotd's step-time ratio to no snapshots, overriding the overhead run's",
    )
    parser.add_argument(
        "--storage-rate",
        type=parse_rate,
        default=None,
        help="aggregate read rate of the checkpoint store, e.g. 100GB/s (default: no limit)",
    )
    parser.add_argument("--trials", type=int, default=200, help="simulated jobs (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")


def _durations(text: str) -> list[float]:
    try:
        values = [parse_duration(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive durations separated by commas, got {text!r}")
    return values


# ------------------------------------------------------------------------------------------ inputs


def _overhead_inputs(doc: dict[str, Any]) -> dict[str, float]:
    """``snapshotd_overhead`` and ``{kind}_Bps`` from an overhead report, as the module docstring says."""
    rows = doc.get("results", [])
    none = next((r for r in rows if r.get("variant") == "none"), None)
    if none is None:
        return {}

    def mean_ms(row: dict[str, Any]) -> float:
        return float(np.mean(row["step_ms"])) if row.get("step_ms") else float(row["step_median_ms"])

    def cost_ms(row: dict[str, Any]) -> float:
        return max(mean_ms(row) - mean_ms(none), float(row.get("blocked_mean_ms") or 0.0), 0.0)

    out = {}
    snap = next((r for r in rows if r.get("variant") == "snapshotd"), None)
    if snap is not None:
        out["snapshotd_overhead"] = cost_ms(snap) / mean_ms(none)
    state = doc.get("summary", {}).get("state_bytes_per_rank")
    for kind in _CHECKPOINTS:
        at = sorted(
            (r for r in rows if r.get("variant") == kind and r.get("interval")), key=lambda r: r["interval"]
        )
        if at and state:
            stall = cost_ms(at[0]) * at[0]["interval"] / 1e3
            out[f"{kind}_Bps"] = state / stall if stall > 0 else math.inf
    return out


def load_inputs(
    overhead_json: str | None, recovery_json: str | None
) -> tuple[dict[str, float], dict[str, str]]:
    """The model's measured inputs and where each came from (a file, or :data:`DEFAULTS`).

    Raises:
        OSError: a file cannot be read. ValueError: it is not a report of the right benchmark.
    """
    values, sources = dict(DEFAULTS), dict.fromkeys(DEFAULTS, _DEFAULT_SOURCE)
    for path, bench in ((recovery_json, "recovery"), (overhead_json, "overhead")):
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("bench") != bench:
            raise ValueError(f"{path} is not a snapshotd-bench {bench} report")
        found = dict(doc.get("summary", {}))
        if bench == "overhead":
            found = _overhead_inputs(doc)
            for kind in _CHECKPOINTS:  # a kind that run left out is left out here too
                if f"{kind}_Bps" not in found:
                    del values[f"{kind}_Bps"], sources[f"{kind}_Bps"]
        for key in values:
            value = found.get(key)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and (value > 0 or value == 0 == DEFAULTS[key])
            ):
                values[key], sources[key] = float(value), path
    return values, sources


# ------------------------------------------------------------------------------------------ the model


class Strategy:
    """One way to survive failures: a slowdown, a checkpoint cycle, and what each failure costs.

    Args:
        name: row label.
        recovery: seconds from a failure until training runs again (detection, restart, loading the state).
        overhead: fractional slowdown of every step (snapshotd); 0 for checkpoints.
        interval: training seconds between checkpoints; None for snapshotd.
        cost: seconds each checkpoint stalls training.
        step: seconds of work lost per failure for snapshotd (one step, before the slowdown).
    """

    def __init__(
        self,
        name: str,
        *,
        recovery: float,
        overhead: float = 0.0,
        interval: float | None = None,
        cost: float = 0.0,
        step: float = 0.0,
    ) -> None:
        self.name, self.recovery, self.overhead = name, recovery, overhead
        self.interval, self.cost, self.step = interval, cost, step

    def lost(self) -> float:
        """Expected wall seconds of work lost per failure."""
        if self.interval is None:
            return self.step * (1 + self.overhead)
        return (self.interval + self.cost) / 2


def expected_ettr(s: Strategy, mtbf: float) -> float:
    """The exact long-run ETTR of the module docstring, for failures at rate ``1 / mtbf``."""
    if s.interval is None:
        return math.exp(-(s.recovery + s.step * (1 + s.overhead)) / mtbf) / (1 + s.overhead)
    return s.interval / (mtbf * math.expm1((s.interval + s.cost) / mtbf) * math.exp(s.recovery / mtbf))


def simulate(s: Strategy, failures: np.ndarray, horizon: float) -> float:
    """ETTR of one job of ``horizon`` wall seconds whose failures strike at the sorted times ``failures``."""
    t = useful = 0.0
    for f in failures:
        if f >= horizon:
            break
        if f < t:  # during a recovery: it starts over
            t = f + s.recovery
            continue
        useful += _work(s, f - t, final=False)
        t = f + s.recovery
    if t < horizon:
        useful += _work(s, horizon - t, final=True)
    return useful / horizon


def _work(s: Strategy, seconds: float, *, final: bool) -> float:
    """Useful seconds kept from ``seconds`` of running; ``final``: the job ends then instead of failing."""
    if s.interval is None:
        done = seconds / (1 + s.overhead)
        return done if final else done - min(done, s.step)
    cycle = s.interval + s.cost
    full, rest = divmod(seconds, cycle)
    return full * s.interval + (min(rest, s.interval) if final else 0.0)


def _failure_times(rng: np.random.Generator, mtbf: float, horizon: float) -> np.ndarray:
    times: list[np.ndarray] = []
    last = 0.0
    while last < horizon:
        batch = last + np.cumsum(rng.exponential(mtbf, size=max(16, int(2 * horizon / mtbf))))
        times.append(batch)
        last = float(batch[-1])
    return np.concatenate(times)


def _strategies(args: argparse.Namespace, v: dict[str, float]) -> list[Strategy]:
    state = float(args.state_bytes or v["state_bytes"])
    fixed = v["detection_seconds"] + args.restart
    restore = v["restore_seconds"] * state / v["state_bytes"]
    load = v["torch_load_seconds"] * state / v["state_bytes"]
    if args.storage_rate:
        load = max(load, args.ranks * state / args.storage_rate)
    overhead = max(0.0, args.step_ratio - 1) if args.step_ratio is not None else v["snapshotd_overhead"]
    out = [Strategy("snapshotd", recovery=fixed + restore, overhead=overhead, step=args.step_seconds)]
    for kind in (k for k in _CHECKPOINTS if f"{k}_Bps" in v):
        cost = state / v[f"{kind}_Bps"]
        young = math.sqrt(2 * cost * args.mtbf)
        for interval in sorted({*args.intervals, young} if young > 0 else set(args.intervals)):
            label = f"{kind} every {_span(interval)}" + (" (Young)" if interval == young else "")
            out.append(Strategy(label, recovery=fixed + load, interval=interval, cost=cost))
    return out


def _span(seconds: float) -> str:
    """A duration for a label: ``93 s``, ``30 min``, ``2 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


def _check(args: argparse.Namespace) -> None:
    if args.mtbf <= 0 or args.hours <= 0 or args.trials < 1 or args.ranks < 1 or args.ranks_per_node < 1:
        raise ValueError("--mtbf, --hours, --trials, --ranks and --ranks-per-node must be positive")
    if args.step_seconds < 0 or args.restart < 0 or (args.step_ratio is not None and args.step_ratio <= 0):
        raise ValueError("--step-seconds and --restart must be >= 0, --step-ratio > 0")


def run(args: argparse.Namespace) -> Report:
    """Model the job as the module docstring says; see :func:`add_arguments` for ``args``.

    Raises:
        ValueError: bad arguments or a JSON file of another benchmark. OSError: a file cannot be read.
    """
    _check(args)
    values, sources = load_inputs(args.overhead_json, args.recovery_json)
    if args.step_ratio is not None:
        values["snapshotd_overhead"], sources["snapshotd_overhead"] = (
            max(0.0, args.step_ratio - 1),
            "--step-ratio",
        )
    horizon = args.hours * 3600
    strategies = _strategies(args, values)
    if len(strategies) < 2:
        raise ValueError(
            f"nothing to compare snapshotd with: the overhead report {args.overhead_json} ran neither torch_save nor "
            "dcp_async; pass a report that did (--step-ratio then overrides snapshotd's own figure)"
        )
    rng = np.random.default_rng(args.seed)
    sims = np.empty((args.trials, len(strategies)))
    for i in range(args.trials):
        failures = _failure_times(rng, args.mtbf, horizon)
        sims[i] = [simulate(s, failures, horizon) for s in strategies]
    rows = []
    for j, s in enumerate(strategies):
        mean = float(sims[:, j].mean())
        rows.append(
            {
                "strategy": s.name,
                "interval_seconds": s.interval,
                "overhead": s.overhead if s.interval is None else s.cost / s.interval,
                "recovery_seconds": s.recovery,
                "lost_seconds": s.lost(),
                "ettr_expected": expected_ettr(s, args.mtbf),
                "ettr_sim": mean,
                "ettr_sim_p5": float(np.percentile(sims[:, j], 5)),
                "ettr_sim_p95": float(np.percentile(sims[:, j], 95)),
                "wasted_seconds": (1 - mean) * horizon,
            }
        )
    best = max(rows[1:], key=lambda r: r["ettr_sim"])
    nodes = math.ceil(args.ranks / args.ranks_per_node)
    summary = {
        "failures_expected": horizon / args.mtbf,
        "ettr_snapshotd": rows[0]["ettr_sim"],
        "ettr_best_checkpoint": best["ettr_sim"],
        "best_checkpoint": best["strategy"],
        "ettr_gain": rows[0]["ettr_sim"] - best["ettr_sim"],
        "saved_hours": (rows[0]["ettr_sim"] - best["ettr_sim"]) * args.hours,
    }
    config = {
        k: getattr(args, k)
        for k in (
            "mtbf",
            "hours",
            "ranks",
            "ranks_per_node",
            "intervals",
            "step_seconds",
            "restart",
            "storage_rate",
            "trials",
            "seed",
        )
    }
    config.update(
        state_bytes=float(args.state_bytes or values["state_bytes"]),
        node_mtbf_seconds=args.mtbf * nodes,
        inputs={k: {"value": values[k], "source": sources[k]} for k in values},
    )
    print(
        f"goodput: {args.hours:g} h job, {args.ranks} ranks on {nodes} nodes, job MTBF {_span(args.mtbf)} "
        f"(= {_span(args.mtbf * nodes)} per node), {format_bytes(config['state_bytes'])} per rank"
    )
    for key in values:
        print(f"  input {key} = {values[key]:.4g} from {sources[key]}")
    return Report("goodput", config, rows, summary, columns=list(_COLUMNS))


def plot(report: Report, path: str) -> None:
    """ETTR per strategy: bars (simulation mean, p5-p95 whiskers) and the closed-form expectation as dots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report.results
    fig = Figure(figsize=(8.0, 1.8 + 0.45 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ys = range(len(rows))
    sims = [r["ettr_sim"] for r in rows]
    err = [
        [r["ettr_sim"] - r["ettr_sim_p5"] for r in rows],
        [r["ettr_sim_p95"] - r["ettr_sim"] for r in rows],
    ]
    ax.barh(
        ys, sims, xerr=err, color=["tab:green"] + ["tab:blue"] * (len(rows) - 1), capsize=3, label="simulated"
    )
    ax.plot([r["ettr_expected"] for r in rows], ys, "k.", label="expected (closed form)")
    ax.set_yticks(ys, [r["strategy"] for r in rows])
    ax.invert_yaxis()
    left = max(0.0, min(r["ettr_sim_p5"] for r in rows) - 0.05)
    ax.set_xlim(left, 1.0)
    for y, s in zip(ys, sims, strict=True):
        ax.text(left, y, f" {s:.3f}", va="center", color="white", fontsize="small", fontweight="bold")
    ax.set_xlabel("effective training time ratio (useful / wall time); whiskers: simulated p5-p95")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1 - 1.2 / len(rows) / 4), ncol=2, fontsize="small")
    c = report.config
    fig.suptitle(
        f"snapshotd-bench goodput: {c.get('hours'):g} h, job MTBF {_span(c.get('mtbf', 0))}, "
        f"{c.get('ranks')} ranks"
    )
    fig.tight_layout()
    save_figure(fig, path)
