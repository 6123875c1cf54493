"""The soak: trial after trial of a real training job meeting a random fault, each checked bit-identical.

``snapshotd-bench soak`` starts a coordinator and two sidecars (nodes) on loopback and runs ``--trials`` trials
of a 2-rank gloo job (the trainer of :mod:`.trainer`, one rank per node, a snapshot after every step). Each trial
draws, from ``--seed`` (printed) and its number, a fault, the process it hits and the step it comes at (or the
first step after it at which some step is durable):

- ``node-kill``: a node dies (its sidecar and rank SIGKILLed, its shared memory gone); a replacement node starts
  and the launcher restarts the job, whose rank on the new node pulls its state from its buddy;
- ``rank-kill`` / ``rank-term``: a rank is SIGKILLed / SIGTERMed; the launcher restarts the job;
- ``sidecar-kill``: a sidecar is SIGKILLed alone and started again on its node, as its supervisor would;
- ``sidecar-stop`` / ``rank-stop`` / ``coordinator-stop``: the process is SIGSTOPped for a drawn time (up to
  ``--max-hang`` seconds, past the coordinator's death timeout at times) and SIGCONTed;
- ``coordinator-kill``: the coordinator is SIGKILLed and started again on its endpoint;
- ``coordinator-in-recovery``: a node dies, and the coordinator is SIGKILLed and started again while the
  restarted job's ranks ask for their recovery plan.

The first run of each trial lingers (the trainer's ``--linger``: its ranks keep their processes and snapshots
after their last step until the harness ends them), so that a fault never races the job's end. After a fault the
job never learns of (a hang, a restarted daemon), training goes on for a step and then every
rank crashes, so that each trial ends in a restore. The restarted job runs to the end and its final state
(weights, optimizer, scheduler, RNG) and every loss must equal those of a failure-free run of the same job, run
once, and the steps lost must be within the bound the README states (``4 * stride - 1`` with the trainer's three slots,
where ``stride`` is the snapshot stride the ranks had fallen back to when they crashed: see
:func:`~snapshotd.client.schedule.max_steps_lost`); a rank of the first run that fails on its own
fails the trial. With ``--noise`` every daemon's messages are also duplicated, delayed and reordered now and
then (:mod:`.faults`). The table has a row per trial; the summary counts trials and passes and gives the steps
lost (max, median) and the detection and restore times. ``passed`` is False when any trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from snapshotd.client.schedule import max_steps_lost
from snapshotd.harness.cluster import LocalCluster, ManagedProcess
from snapshotd.harness.demo import TrainingJob, wait_for
from snapshotd.status import fetch_status
from snapshotd.units import parse_rate

from .faults import FaultPlan, command
from .report import Report, scratch_dir

__all__ = ["FAULTS", "Soak", "add_arguments", "run"]

FAULTS = (
    "node-kill",
    "rank-kill",
    "rank-term",
    "sidecar-kill",
    "sidecar-stop",
    "rank-stop",
    "coordinator-stop",
    "coordinator-kill",
    "coordinator-in-recovery",
)
"""The faults a trial draws from (see the module docstring)."""

_HANGS = ("sidecar-stop", "rank-stop", "coordinator-stop", "coordinator-in-recovery")
"""The faults that last ``Trial.hang`` seconds (for coordinator-in-recovery: until the coordinator is killed)."""

NOISE = FaultPlan(duplicate=0.01, delay=0.02, reorder=0.01, max_delay=0.02)
"""``--noise``: what happens now and then to every daemon message on both planes."""

WORLD = 2
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.5


@dataclasses.dataclass(slots=True)
class Trial:
    """What one trial drew."""

    number: int
    fault: str
    target: int  # the rank (or the node of that rank) hit
    at_step: int
    hang: float  # seconds stopped, for the *-stop faults; for coordinator-in-recovery, when it is killed


class Soak:
    """The cluster the trials share, kept whole between them (a lost node is replaced under a new name).

    Args:
        workdir: logs and ipc paths.
        steps / params / step_delay: the job's length, model size and idle seconds per step.
        noise: interpose every daemon with :data:`NOISE`.
        max_rate: the sidecars' ``--max-rate`` (None: auto); a rate below what the snapshots need is pressure:
            the ranks skip snapshots and their stride grows.
        say: progress lines.
    """

    def __init__(
        self,
        workdir: str,
        *,
        steps: int,
        params: int,
        step_delay: float,
        noise: bool,
        max_hang: float,
        say: Callable[[str], None],
        max_rate: str | None = None,
    ) -> None:
        self.workdir, self.steps, self.params, self.step_delay, self.max_hang = (
            workdir,
            steps,
            params,
            step_delay,
            max_hang,
        )
        self.sidecar_flags = ("--max-rate", max_rate) if max_rate else ()
        self.say = say
        launcher = command(NOISE) if noise else None
        self.cluster = LocalCluster(
            workdir,
            replicas=1,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            launcher=launcher,
        )
        self._names = (f"n{i}" for i in range(1 << 30))
        self.nodes: list[str] = []  # rank r runs on node nodes[r]
        self.endpoint = ""
        self.reference: list[dict[str, Any]] = []
        self._jobs: list[TrainingJob] = []

    def __enter__(self) -> Soak:
        self.endpoint = self.cluster.start_coordinator().fields["endpoint"]
        self.nodes = [self._new_node() for _ in range(WORLD)]
        ref = self._job("reference", None)
        self.reference = ref.wait(600)
        return self

    def __exit__(self, *exc: object) -> None:
        for job in self._jobs:
            job.kill()
        self.cluster.close()

    # -- the cluster

    def _new_node(self) -> str:
        name = next(self._names)
        self.cluster.start_sidecar(name, *self.sidecar_flags)
        return name

    def _sidecar(self, rank: int) -> ManagedProcess:
        return self.cluster.sidecars[self.nodes[rank]]

    def _coordinator(self) -> ManagedProcess:
        assert self.cluster.coordinator is not None
        return self.cluster.coordinator

    def _restart_coordinator(self) -> None:
        self.cluster.kill(self._coordinator())
        self.cluster.start_coordinator(self.endpoint)

    def _heal(self) -> None:
        """Every daemon alive again before the next trial (a failed trial may leave one dead or stopped)."""
        for p in (self._coordinator(), *(self._sidecar(r) for r in range(WORLD))):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
        if not self._coordinator().alive():
            self.cluster.start_coordinator(self.endpoint)
        for r in range(WORLD):
            if not self._sidecar(r).alive():
                self.cluster.kill(self._sidecar(r))
                self.nodes[r] = self._new_node()

    def _job(self, tag: str, job: str | None, *, linger: bool = False) -> TrainingJob:
        sidecars = {r: self.cluster.ipc_path(self.nodes[r]) for r in range(WORLD)}
        j = TrainingJob(
            self.workdir,
            tag,
            world=WORLD,
            steps=self.steps,
            params=self.params,
            job=job,
            sidecars=sidecars,
            step_delay=self.step_delay,
            linger=linger,
        )
        self._jobs.append(j)
        return j

    def _dead(self, node: str) -> bool:
        with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
            nodes = fetch_status(self.endpoint, secret=None, timeout=1.0)["nodes"]
            return any(n["node"] == node and not n["alive"] for n in nodes)
        return False

    def _durable(self, job: str) -> bool:
        """Whether some step of ``job`` is durable (on a buddy of every rank): a node's loss is survivable."""
        with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
            jobs = fetch_status(self.endpoint, secret=None, timeout=1.0)["jobs"]
            return any(j["job"] == job and j["durable"] >= 0 for j in jobs)
        return False

    # -- one trial

    def draw(self, seed: int, number: int, faults: tuple[str, ...], *, cycle: bool = False) -> Trial:
        """Trial ``number``'s fault (from ``faults``; in turn with ``cycle``), target, step and hang time."""
        rng = random.Random(f"{seed}:{number}")
        fault = rng.choice(faults)
        if cycle:
            fault = faults[number % len(faults)]
        return Trial(
            number,
            fault,
            rng.randrange(WORLD),
            rng.randint(2, max(2, self.steps // 4)),
            round(rng.uniform(0.3, self.max_hang), 2),
        )

    def run_trial(self, trial: Trial) -> dict[str, Any]:
        """Run ``trial``; its table row (``passed``, ``steps_lost``, ``detection_s``, ``restore_s``, ``error``)."""
        self._heal()
        row: dict[str, Any] = {
            "trial": trial.number,
            "fault": trial.fault,
            "rank": trial.target,
            "at_step": trial.at_step,
            "passed": False,
            "steps_lost": None,
            "stride": None,
            "hang_s": trial.hang if trial.fault in _HANGS else None,
            "detection_s": None,
            "restore_s": None,
            "error": "",
        }
        job = f"soak{trial.number}-{uuid.uuid4().hex[:6]}"
        try:
            row.update(self._trial(trial, job))
        except Exception as exc:  # noqa: BLE001 - a failed trial is a row of the table, not the end of the soak
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        finally:
            for j in self._jobs[1:]:
                j.kill()
            del self._jobs[1:]
        return row

    @staticmethod
    def _check_alive(job: TrainingJob, when: str) -> None:
        """Every rank of ``job`` still training, or done: a rank that failed on its own fails the trial."""
        failed = {r: p.returncode for r, p in job.procs.items() if p.poll() not in (None, 0)}
        if failed:
            raise RuntimeError(f"ranks exited {when} with codes {failed}; see {job.tag}-rank*.log")

    def _trial(self, trial: Trial, job: str) -> dict[str, Any]:
        # its ranks outlive their last step until killed
        first = self._job(f"t{trial.number}a", job, linger=True)
        r = trial.target

        def due() -> bool:
            """The fault is due: at the drawn step (or the job's last) once some step is durable (before that, a
            node's loss is the NotRecoverable a job that just started gets, which tests/client covers), or a rank
            exited (which fails the trial below)."""
            if any(p.poll() is not None for p in first.procs.values()):
                return True
            done = all(os.path.exists(first.result_path(k)) for k in range(WORLD))
            return (first.progress(0) >= trial.at_step or done) and self._durable(job)

        wait_for(due, 120, f"step {trial.at_step} (or the job's last step) with some step durable")
        self._check_alive(first, "before the fault")
        out: dict[str, Any] = {}
        fault = trial.fault
        if fault in ("node-kill", "coordinator-in-recovery"):
            lost = self.nodes[r]
            self.cluster.lose_node(self._sidecar(r), [first.procs[r]])
            t_dead = time.monotonic()
            reached = max(first.progress(k) for k in range(WORLD))
            first.kill()  # the launcher stops the survivors
            wait_for(lambda: self._dead(lost), 30, f"node {lost} declared dead")
            out["detection_s"] = time.monotonic() - t_dead
            self.nodes[r] = self._new_node()
        elif fault in ("rank-kill", "rank-term"):
            first.procs[r].send_signal(signal.SIGKILL if fault == "rank-kill" else signal.SIGTERM)
            first.procs[r].wait(30)
            reached = max(first.progress(k) for k in range(WORLD))
            first.kill()
        else:
            if fault == "sidecar-kill":
                node = self.nodes[r]
                self.cluster.kill(self._sidecar(r))
                self.cluster.start_sidecar(node, *self.sidecar_flags)  # its supervisor starts it again
            elif fault == "coordinator-kill":
                self._restart_coordinator()
            else:
                target = {
                    "sidecar-stop": self._sidecar(r).pid,
                    "rank-stop": first.procs[r].pid,
                    "coordinator-stop": self._coordinator().pid,
                }[fault]
                os.kill(target, signal.SIGSTOP)
                time.sleep(trial.hang)  # the fault itself: the process hangs this long
                os.kill(target, signal.SIGCONT)
            # the job goes on for a step; then every rank crashes, so that the trial ends in a restore
            at = first.progress(0)
            wait_for(
                lambda: (
                    first.progress(0) >= min(at + 1, self.steps)
                    or any(p.poll() is not None for p in first.procs.values())
                ),
                120,
                "a step after the fault",
            )
            self._check_alive(first, "after the fault")
            reached = max(first.progress(k) for k in range(WORLD))
            first.kill()
        second = self._job(f"t{trial.number}b", job)
        if fault == "coordinator-in-recovery":
            time.sleep(trial.hang)  # the ranks start, register and ask for their plan meanwhile
            self._restart_coordinator()
        stride = max(1, first.stride(list(range(WORLD))))
        results = second.wait(300)
        restored = {res["restored"]["step"] for res in results}
        identical = all(
            res["digest"] == ref["digest"] and res["losses"] == {k: ref["losses"][k] for k in res["losses"]}
            for res, ref in zip(results, self.reference, strict=True)
        )
        lost = reached - min(restored)
        out.update(
            steps_lost=lost,
            stride=stride,
            restore_s=max(res["restore_seconds"] for res in results),
            source="/".join(res["restored"]["source"] for res in results),
        )
        bound = max_steps_lost(stride)
        bounded = lost <= bound
        out["passed"] = len(restored) == 1 and identical and bounded
        if not out["passed"]:
            out["error"] = (
                f"restored steps {sorted(restored)}; bit-identical: {identical}; {lost} steps lost at "
                f"stride {stride} (at most {bound})"
            )
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=100, help="trials to run (default 100)")
    p.add_argument("--seed", type=int, default=None, help="the draws' seed (default: drawn and printed)")
    p.add_argument(
        "--steps",
        type=int,
        default=30,
        help="steps of each run of the job: more than a hang lasts (default 30)",
    )
    p.add_argument("--params", type=int, default=150_000, help="model parameters (default 150,000)")
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.1,
        help="idle seconds per step, the accelerator's share (default 0.1)",
    )
    p.add_argument(
        "--max-hang",
        type=float,
        default=2.5,
        help="the longest a stopped process stays stopped, seconds: past the death timeout, 1.5 s "
        "(default 2.5)",
    )
    p.add_argument(
        "--noise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also duplicate, delay and reorder daemon messages now and then (default on)",
    )
    p.add_argument(
        "--faults", default=",".join(FAULTS), help="comma list of the faults to draw from (default all)"
    )
    p.add_argument("--cycle", action="store_true", help="take the faults in turn instead of drawing them")
    p.add_argument(
        "--max-rate",
        default=None,
        help="the sidecars' --max-rate (default auto); below what the snapshots need, the ranks skip "
        "snapshots and the bound on steps lost grows with their stride",
    )
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")


def run(args: argparse.Namespace) -> Report:
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    faults = tuple(args.faults.split(","))
    unknown = set(faults) - set(FAULTS)
    if unknown or args.steps < 8 or args.trials < 1:
        raise SystemExit(
            f"snapshotd-bench soak: --faults from {','.join(FAULTS)}, --steps >= 8, --trials >= 1"
        )
    if args.max_rate is not None:
        try:
            parse_rate(args.max_rate)
        except ValueError as exc:
            raise SystemExit(f"snapshotd-bench soak: --max-rate: {exc}") from None
    print(f"snapshotd-bench soak: seed {seed}", flush=True)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with (
        scratch_dir(args.workdir, prefix="snapshotd-soak-") as workdir,
        Soak(
            workdir,
            steps=args.steps,
            params=args.params,
            step_delay=args.step_delay,
            noise=args.noise,
            max_hang=args.max_hang,
            say=print,
            max_rate=args.max_rate,
        ) as soak,
    ):
        for number in range(args.trials):
            trial = soak.draw(seed, number, faults, cycle=args.cycle)
            row = soak.run_trial(trial)
            rows.append(row)
            print(
                f"  trial {number:3d} {trial.fault:<24} rank {trial.target} step {trial.at_step:2d}: "
                f"{'passed' if row['passed'] else 'FAILED ' + row['error']}",
                flush=True,
            )
    passed = [r for r in rows if r["passed"]]
    lost = [r["steps_lost"] for r in passed]
    detection = [r["detection_s"] for r in rows if r["detection_s"] is not None]
    restore = [r["restore_s"] for r in passed]
    summary = {
        "seed": seed,
        "trials": len(rows),
        "passed": len(passed),
        "steps_lost_max": max(lost, default=None),
        "steps_lost_median": statistics.median(lost) if lost else None,
        "detection_s_median": statistics.median(detection) if detection else None,
        "detection_s_max": max(detection, default=None),
        "restore_s_median": statistics.median(restore) if restore else None,
        "restore_s_max": max(restore, default=None),
        "faults": {
            f: sum(1 for r in rows if r["fault"] == f) for f in FAULTS if any(r["fault"] == f for r in rows)
        },
        "seconds": time.monotonic() - t0,
    }
    config = {
        "trials": args.trials,
        "seed": seed,
        "steps": args.steps,
        "params": args.params,
        "cycle": args.cycle,
        "step_delay": args.step_delay,
        "max_hang": args.max_hang,
        "noise": args.noise,
        "faults": list(faults),
    }
    columns = [
        "trial",
        "fault",
        "rank",
        "at_step",
        "hang_s",
        "passed",
        "steps_lost",
        "stride",
        "detection_s",
        "restore_s",
        "source",
        "error",
    ]
    return Report("soak", config, rows, summary, columns=columns, passed=len(passed) == len(rows))
