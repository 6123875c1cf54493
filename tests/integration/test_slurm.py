"""torchrun on Slurm: ``examples/torchrun_ddp/train.py`` launched by deploy/slurm/snapshotd.sbatch loses a node and
ends bit-identical to a failure-free run.

The script runs as the batch script of a 3-node allocation (2 training nodes of 2 DDP workers, and a spare), each
node emulated on a loopback address of its own: ``srun`` and ``scontrol`` are stand-ins (``tests/slurm_shims``)
that run a step's command here as if on the node it names; everything else is real (the daemons the script starts,
torchrun agents, gloo). Node B (agent, workers, sidecar, shared memory) is lost after step 11, part-way through the
second epoch; the script gives its node index to the spare, the surviving agent restarts its workers, and the job
runs to the end. The failure-free reference runs at the same time on nodes of its own, under the torchrun trial's
harness (:func:`snapshotd.bench.torchrun_trial.run_trial`; its own node-loss story, with the recovery's phases,
is tests/integration/test_torchrun.py, in ``make long``): every step's loss and the final state are bit-identical.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from snapshotd.bench.nodes import marked_processes
from snapshotd.bench.torchrun_trial import (
    EXAMPLE_DIR,
    TORCHRUN_ENV,
    TrialConfig,
    TrialResult,
    compare,
    read_outcome,
    run_trial,
)
from snapshotd.client.schedule import max_steps_lost
from snapshotd.harness.ports import free_port
from snapshotd.shm import SHM_DIR, pid_alive, sweep_stale_arenas

from ..waits import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "snapshotd.sbatch"
SHIMS = Path(__file__).resolve().parents[1] / "slurm_shims"
HOSTS = ["127.0.7.2", "127.0.7.3", "127.0.7.4"]  # nodes A and B train, C is the spare
CONFIG = TrialConfig(timeout=90)  # 2 nodes x 2 workers, 16 steps; node B (ranks 2-3) dies after step 11


def _port_free_on_every_host() -> int:
    for _ in range(50):
        port = free_port(HOSTS[0])
        try:
            for host in HOSTS[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every emulated host")


def _last_step(path: Path) -> int:
    """The last step the rank's loss log holds (0 before its first complete line)."""
    lines = (
        [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
        if path.exists()
        else []
    )
    return int(json.loads(lines[-1])["step"]) if lines else 0


def _run_sbatch(tmp_path: Path) -> TrialResult:
    """Run the script on the emulated allocation and lose node B after ``CONFIG.kill_after``; check what the script
    did and left; the trial's outcome."""
    job_id = str(random.randrange(10**6, 10**7))
    marker = f"slurm-{uuid.uuid4().hex[:8]}"
    out, run_dir = tmp_path / "out", tmp_path / "run"
    env = {
        **os.environ,
        **TORCHRUN_ENV,
        "PATH": f"{SHIMS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NODELIST": ",".join(HOSTS),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_SHIM_MARKER": marker,
        "RUN_DIR": str(run_dir),
        "NPROC_PER_NODE": str(CONFIG.nproc_per_node),
        "CONTROL_PORT": str(_port_free_on_every_host()),
        "STORE_PORT": str(_port_free_on_every_host()),
        "DATA_PORT": str(_port_free_on_every_host()),
        "SNAPSHOTD_HEARTBEAT_INTERVAL": "0.2",
        "SNAPSHOTD_HEARTBEAT_TIMEOUT": "1.5",
    }
    for var in ("SNAPSHOTD_SECRET", "SNAPSHOTD_SECRET_FILE", "SNAPSHOTD_COORDINATOR", "SNAPSHOTD_JOB"):
        env.pop(var, None)
    train = [str(EXAMPLE_DIR / "train.py"), *CONFIG.model_args]
    train += ["--steps", str(CONFIG.steps), "--step-delay", str(CONFIG.step_delay), "--out", str(out)]
    with open(tmp_path / "sbatch.log", "w") as log:
        batch = subprocess.Popen(
            ["bash", str(SCRIPT), *train], env=env, stdout=log, stderr=log, start_new_session=True
        )
    try:
        # torchrun ranks the agents by address: node B (127.0.7.3) runs ranks 2-3
        first_of_b = CONFIG.nproc_per_node
        wait_until(
            lambda: (
                _last_step(out / f"losses-rank{first_of_b}.jsonl") >= CONFIG.kill_after
                or batch.poll() is not None
            ),
            f"rank {first_of_b} at step {CONFIG.kill_after}",
            timeout=90,
            every=0.05,
        )
        assert batch.poll() is None, (tmp_path / "sbatch.log").read_text()
        lost = marked_processes(f"{marker}-{HOSTS[1]}", exact=True)
        assert lost, "node B's processes carry its marker"
        killed_at = time.time()
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(pid_alive(p) for p in lost), "node B's processes gone", timeout=10)
        sweep_stale_arenas(HOSTS[1])  # the node's memory went with it
        assert batch.wait(120) == 0, (tmp_path / "sbatch.log").read_text()
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
        for pid in marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    said = (tmp_path / "sbatch.log").read_text()
    assert f"node 1 ({HOSTS[1]}) is lost: its place goes to the spare {HOSTS[2]}" in said, said
    assert (run_dir / f"train-1-{HOSTS[2]}.log").exists()
    # the job's name is Slurm's job id, never torchrun's default "none"
    assert f"slurm-{job_id}" in (run_dir / "coordinator.log").read_text()
    assert not marked_processes(marker)  # the script stopped every daemon it started
    assert not [n for n in os.listdir(SHM_DIR) if f"slurm-{job_id}" in n]
    world = CONFIG.nodes * CONFIG.nproc_per_node
    return read_outcome(str(out), world, f"slurm-{job_id}", {}, killed_at)


@pytest.mark.timeout(240)
def test_a_job_launched_by_the_sbatch_script_loses_a_node_to_the_spare_and_ends_bit_identical(
    cluster, tmp_path: Path
) -> None:
    (tmp_path / "reference").mkdir()
    (tmp_path / "trial").mkdir()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref = pool.submit(
            run_trial,
            cluster,
            str(tmp_path / "reference"),
            CONFIG,
            job=cluster.job("reference"),
            fail=False,
            node_names=[cluster.node(x) for x in "ABC"],
        )
        trial = _run_sbatch(tmp_path / "trial")
        reference = ref.result(timeout=CONFIG.timeout + 30)

    assert {r["source"] for r in reference.restored.values()} == {"fresh"}
    same = compare(reference, trial)
    assert same["losses_identical"], f"first differing (rank, step): {same['first_difference']}"
    assert same["reruns_identical"], trial.rerun_mismatches  # the steps run twice gave the same losses
    assert same["digests_equal"] and same["states_equal"], (reference.finals, trial.finals)
    assert len({r["step"] for r in trial.restored.values()}) == 1, trial.restored
    stride = max(1, trial.stride_at_loss or 0)
    assert trial.steps_lost is not None and 0 <= trial.steps_lost <= max_steps_lost(stride), trial.restored
    sources = {rank: r["source"] for rank, r in trial.restored.items()}
    assert sources[0] == sources[1] == "local", sources  # node A survived: its own shared memory
    assert {sources[2], sources[3]} <= {"replica", "pull"}, sources  # the spare: from A, B's buddy
