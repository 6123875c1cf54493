"""``snapshotd demo``: node loss and bit-identical recovery, on one machine.

The story: a coordinator, two sidecars as nodes A and B, and a 4-rank gloo job (ranks 0-1 on A, 2-3 on B)
training a small GPT and snapshotting every step. Mid-run node B dies (its ranks and its sidecar are SIGKILLed);
the surviving ranks are stopped, as torchrun stops a job's workers after a failure. A replacement sidecar starts
as node C and all four ranks restart, as a launcher would: ranks 0-1 restore from A's shared memory, ranks 2-3
pull their state from A, their buddy. The job runs to the end, and its final state is compared with a
failure-free run of the same job.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from snapshotd.client.schedule import max_steps_lost
from snapshotd.harness.cluster import LocalCluster, held_interrupts
from snapshotd.harness.ports import free_port
from snapshotd.harness.processes import RankProcess, start_module
from snapshotd.harness.ranks import read_progress
from snapshotd.status import fetch_status

__all__ = ["TrainingJob", "run_demo", "run_scenario", "wait_for"]


class TrainingJob:
    """The rank processes of one attempt of a training job."""

    def __init__(
        self,
        workdir: str,
        tag: str,
        *,
        world: int,
        steps: int,
        params: int,
        job: str | None,
        sidecars: dict[int, str],
        step_delay: float = 0.0,
        replicated: bool = False,
        parallel: str = "ddp",
        every: int = 1,
        linger: bool = False,
        init: str | None = None,
        prefix: Mapping[int, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``linger``: each rank keeps its process and snapshots after its last step until :meth:`wait` or
        :meth:`kill` (the trainer's ``--linger``). ``init``: the process group's init method (default: a free
        loopback port); ``prefix``: per rank, what its command runs under (e.g. ``ip netns exec NS``); ``env``:
        the ranks' environment (default: this process's)."""
        self.workdir, self.tag, self.world = workdir, tag, world
        init = init or f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[int, RankProcess] = {}
        for rank in range(world):
            argv = [
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--init",
                init,
                "--steps",
                str(steps),
                "--params",
                str(params),
                "--out",
                self.result_path(rank),
                "--progress",
                self.progress_path(rank),
                "--step-delay",
                str(step_delay),
                "--parallel",
                parallel,
                *(["--linger"] if linger else []),
            ]
            if job is not None:
                argv += [
                    "--job",
                    job,
                    "--sidecar",
                    sidecars[rank],
                    "--every",
                    str(every),
                    *(["--replicated"] if replicated else []),
                ]
            with held_interrupts():
                self.procs[rank] = start_module(
                    "snapshotd.harness.trainer",
                    argv,
                    output=os.path.join(workdir, f"{tag}-rank{rank}.log"),
                    stdin=linger,
                    env=env,
                    prefix=(prefix or {}).get(rank, ()),
                )

    def result_path(self, rank: int) -> str:
        return os.path.join(self.workdir, f"{self.tag}-rank{rank}.json")

    def progress_path(self, rank: int) -> str:
        return os.path.join(self.workdir, f"{self.tag}-rank{rank}.progress")

    def progress(self, rank: int) -> int:
        """The last step ``rank`` completed."""
        return read_progress(self.progress_path(rank))["step"]

    def stride(self, ranks: list[int]) -> int:
        """The widest snapshot stride among ``ranks`` at their last completed step (see ``SnapshotStats.stride``)."""
        return max(read_progress(self.progress_path(r))["stride"] for r in ranks)

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            if proc.stdin is not None:  # lingering ranks finish once their stdin closes
                proc.stdin.close()
        for rank, proc in self.procs.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(
                    f"{self.tag}: rank {rank} did not finish within {timeout:.0f} s; see {self.workdir}"
                ) from None
            if code != 0:
                self.kill()
                log_path = os.path.join(self.workdir, f"{self.tag}-rank{rank}.log")
                raise RuntimeError(
                    f"{self.tag}: rank {rank} exited with {code} ({_last_line(log_path)}); see {log_path}"
                )
        results = []
        for rank in range(self.world):
            with open(self.result_path(rank)) as f:
                results.append(json.load(f))
        return results

    def kill(self, ranks: list[int] | None = None) -> None:
        for rank in ranks if ranks is not None else list(self.procs):
            proc = self.procs[rank]
            try:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)
            finally:
                if proc.stdin is not None:
                    proc.stdin.close()


def _last_line(path: str) -> str:
    """The last line a rank's log ends with (its error, when it failed), or a note that there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"no log: {exc.strerror}"
    return lines[-1].strip() if lines else "its log is empty"


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` until it holds; the seconds that took.

    Raises:
        TimeoutError: it did not hold within ``timeout`` seconds (naming ``what``).
    """
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def run_scenario(
    workdir: str,
    *,
    steps: int = 24,
    kill_at: int = 12,
    params: int = 2_000_000,
    step_delay: float = 0.0,
    data_security: str | None = None,
    replicated: bool = False,
    parallel: str = "ddp",
    reference: list[dict[str, Any]] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the demo's story under ``workdir`` and return its measurements (see :func:`run_demo`).

    With ``data_security`` (``curve`` or ``members``) every process shares a fresh secret, the sidecars run that
    ``--data-security`` mode, and the replacement node C binds its data plane on 127.0.0.3, a host of its own.
    With ``replicated`` the ranks snapshot their model, optimizer and scheduler once across the four of them
    (``Snapshotter(replicated=...)``). ``parallel`` is how every run wraps the model: ``ddp``, or ``fsdp2``
    (``fully_shard``; each rank then snapshots its own shards). ``reference`` is the results of a failure-free run
    of the same 4 ranks (a :class:`TrainingJob` with no job name), when one was run already.
    """
    if not 0 < kill_at < steps:
        raise ValueError(f"--kill-at must be between 1 and {steps - 1}, got {kill_at}")
    world = 4
    job = f"demo-{uuid.uuid4().hex[:6]}"
    jobs: list[TrainingJob] = []
    secret = uuid.uuid4().hex if data_security else None
    side_flags = ["--data-security", data_security] if data_security else []
    with contextlib.ExitStack() as cleanup:
        cluster = cleanup.enter_context(
            LocalCluster(
                workdir,
                replicas=1,
                heartbeat_interval=0.2,
                heartbeat_timeout=1.5,
                env={"SNAPSHOTD_SECRET": secret or ""},
            )
        )

        def stop_ranks() -> None:  # registered last, so it runs first: ranks stop before their sidecars
            for j in jobs:
                j.kill()

        cleanup.callback(stop_ranks)
        cluster.start_coordinator()
        node_a = cluster.start_sidecar("A", *side_flags)
        node_b = cluster.start_sidecar("B", *side_flags)
        say(
            f"coordinator {cluster.coordinator_addr}; sidecars A {node_a.fields['data']}, B {node_b.fields['data']}"
        )

        if reference is None:
            say(
                f"[1/4] failure-free reference run: {world} ranks, {steps} steps, {params / 1e6:.1f}M parameters"
            )
            jobs.append(
                TrainingJob(
                    workdir,
                    "reference",
                    world=world,
                    steps=steps,
                    params=params,
                    job=None,
                    sidecars={},
                    parallel=parallel,
                )
            )
            reference = jobs[-1].wait(600)

        say(
            f"[2/4] snapshotted run (job {job}): ranks 0-1 on node A, ranks 2-3 on node B; node B dies after step {kill_at}"
        )
        on_a_b = {
            0: cluster.ipc_path("A"),
            1: cluster.ipc_path("A"),
            2: cluster.ipc_path("B"),
            3: cluster.ipc_path("B"),
        }
        first = TrainingJob(
            workdir,
            "attempt1",
            world=world,
            steps=steps,
            params=params,
            job=job,
            sidecars=on_a_b,
            step_delay=step_delay,
            replicated=replicated,
            parallel=parallel,
        )
        jobs.append(first)
        wait_for(
            lambda: first.progress(0) >= kill_at or first.procs[0].poll() is not None, 600, f"step {kill_at}"
        )
        cluster.lose_node(node_b, [first.procs[2], first.procs[3]])
        t_dead = time.monotonic()
        reached = max(first.progress(r) for r in range(world))
        stride = first.stride(list(range(world)))
        first.kill([0, 1])  # the launcher stops the job's surviving workers (they would block in all-reduce)
        say(
            f"      node B killed at step {reached} (its sidecar and ranks 2-3); ranks 0-1 stopped by the launcher"
        )

        def b_dead() -> bool:
            nodes = fetch_status(cluster.coordinator_addr, secret=secret)["nodes"]
            return any(n["node"] == "B" and not n["alive"] for n in nodes)

        wait_for(b_dead, 30, "the coordinator to declare node B dead")
        detection = time.monotonic() - t_dead
        say(
            f"[3/4] coordinator declared node B dead after {detection:.2f} s; replacement sidecar starts as node C"
        )
        cluster.start_sidecar(
            "C", *side_flags, data_bind="tcp://127.0.0.3:0" if data_security else "tcp://127.0.0.1:0"
        )
        on_a_c = {
            0: cluster.ipc_path("A"),
            1: cluster.ipc_path("A"),
            2: cluster.ipc_path("C"),
            3: cluster.ipc_path("C"),
        }
        t_restart = time.monotonic()
        second = TrainingJob(
            workdir,
            "attempt2",
            world=world,
            steps=steps,
            params=params,
            job=job,
            sidecars=on_a_c,
            replicated=replicated,
            parallel=parallel,
        )
        jobs.append(second)
        results = second.wait(600)
        say(f"[4/4] restarted ranks finished in {time.monotonic() - t_restart:.1f} s")

    restored = {r["restored"]["step"] for r in results}
    pulled = [r for r in results if r["restored"].get("source") == "pull"]
    pull_bytes = sum(r["restored"]["bytes_pulled"] for r in pulled)
    pull_seconds = max((r["restored"]["seconds"] for r in pulled), default=0.0)
    summary = {
        "job": job,
        "step_reached": reached,
        "step_restored": min(restored),
        "ranks_agree": len(restored) == 1,
        "steps_lost": reached - min(restored),
        "stride_at_loss": stride,
        "detection_seconds": detection,
        "restore_seconds": max(r["restore_seconds"] for r in results),
        "restore_sources": {r["rank"]: r["restored"]["source"] for r in results},
        "bytes_pulled": pull_bytes,
        "pull_GBps": pull_bytes / pull_seconds / 1e9 if pull_seconds else 0.0,
        "bit_identical": all(r["digest"] == ref["digest"] for r, ref in zip(results, reference, strict=True)),
        "losses_identical": all(
            all(r["losses"][k] == ref["losses"][k] for k in r["losses"])
            for r, ref in zip(results, reference, strict=True)
        ),
        "state_bytes_per_rank": results[0]["state_bytes"],
        "snapshot_bytes_per_rank": max(r["stats"]["bytes"] / max(1, r["stats"]["started"]) for r in results),
    }
    return summary


def run_demo(*, steps: int = 24, kill_at: int = 12, params: int = 2_000_000) -> int:
    """Run the story in a temporary directory and print a summary. Exit code 0 when recovery was bit-identical."""
    from snapshotd.units import format_bytes

    with tempfile.TemporaryDirectory(prefix="snapshotd-demo-") as workdir:
        try:
            s = run_scenario(workdir, steps=steps, kill_at=kill_at, params=params, step_delay=0.1)
        except (RuntimeError, TimeoutError) as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            for name in sorted(os.listdir(workdir)):
                if name.endswith(".log"):
                    with open(os.path.join(workdir, name), errors="replace") as f:
                        tail = f.readlines()[-15:]
                    print(f"--- {name}\n{''.join(tail)}", file=sys.stderr)
            return 1
    print()
    print("snapshotd demo summary")
    print(f"  state per rank        {format_bytes(s['state_bytes_per_rank'])} (model + AdamW moments)")
    print(f"  step reached          {s['step_reached']}")
    print(
        f"  step restored         {s['step_restored']} (all 4 ranks agree: {'yes' if s['ranks_agree'] else 'NO'})"
    )
    print(f"  steps lost            {s['steps_lost']}")
    if s["stride_at_loss"] > 1:
        print(
            f"                        (the sidecars had fallen behind: the ranks were snapshotting one step in "
            f"{s['stride_at_loss']}, so up to {max_steps_lost(s['stride_at_loss'])} steps could be lost)"
        )
    print(f"  detection time        {s['detection_seconds']:.2f} s (heartbeat timeout 1.5 s)")
    print(
        f"  restore time          {s['restore_seconds']:.2f} s (slowest rank, including waiting for all ranks)"
    )
    print(
        f"  restored from         {', '.join(f'rank {r}: {src}' for r, src in sorted(s['restore_sources'].items()))}"
    )
    if s["bytes_pulled"]:
        print(f"  pulled from buddies   {format_bytes(s['bytes_pulled'])} at {s['pull_GBps']:.2f} GB/s")
    else:
        print(
            "                        (local: the rank's own shared memory; replica: the copy the coordinator had"
            " re-replicated to C)"
        )
    ok = s["bit_identical"] and s["losses_identical"] and s["ranks_agree"]
    print(
        f"  bit-identical         {'yes' if ok else 'NO'}: final weights, optimizer, scheduler and RNG equal a failure-free run"
    )
    return 0 if ok else 1
