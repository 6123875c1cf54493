"""torchrun for real: ``examples/torchrun_ddp/train.py`` under two torchrun agents loses a node and recovers.

Two emulated nodes of two DDP workers each (4 gloo ranks), every node with its own sidecar and torchrun agent
(c10d rendezvous on a store of its own, ``--max-restarts``). Node B (agent, workers, sidecar) is SIGKILLed
after step 11, part-way through the second epoch, and a replacement node C starts; the surviving agent
restarts its workers, and the job runs to the end. Against a failure-free run of the same job (run at the same
time, on nodes of its own): every step's loss and the final state are bit-identical, and the recovery's phases
are found in order. In ``make long``: ``make test`` runs the same job and loss launched by the Slurm script
(tests/integration/test_slurm.py), against the same failure-free reference.
"""

from __future__ import annotations

import time

import pytest

from snapshotd.bench.nodes import marked_processes
from snapshotd.bench.torchrun_trial import TrialConfig, compare
from snapshotd.client.schedule import max_steps_lost
from snapshotd.shm import pid_alive

from .conftest import reference_and_trial

pytestmark = pytest.mark.integration


@pytest.mark.long
@pytest.mark.timeout(240)
def test_torchrun_node_loss_recovers_bit_identically(cluster, tag, tmp_path) -> None:
    # 2 nodes x 2 workers, 16 steps; node 1 (B, ranks 2-3) dies after step 11, in epoch 2; each run takes about
    # 20 s here and stops itself after 90 s, so the test's timeout leaves room for the runs' own cleanup. The
    # failure-free reference runs beside the trial: another job on nodes of its own, as on a shared cluster.
    cfg = TrialConfig(timeout=90)
    t0 = time.monotonic()
    reference, trial = reference_and_trial(cluster, str(tmp_path), cfg)
    elapsed = time.monotonic() - t0

    assert all(len(reference.losses[r]) == cfg.steps for r in range(4)), reference.losses
    assert {r["source"] for r in reference.restored.values()} == {"fresh"}
    same = compare(reference, trial)
    assert same["losses_identical"], f"first differing (rank, step): {same['first_difference']}"
    assert same["reruns_identical"], trial.rerun_mismatches  # the steps run twice gave the same losses
    assert same["digests_equal"], {r: (reference.finals[r], trial.finals.get(r)) for r in range(4)}
    assert same["states_equal"], {r: (reference.finals[r]["parts"], trial.finals[r]["parts"]) for r in (0, 3)}

    # every rank restored the same step: usually one step behind the newest step any rank completed, at most the
    # README's bound at the snapshot stride the ranks had reached (wider than 1 only if a busy machine's sidecars
    # fell behind and due steps found no free slot)
    assert len({r["step"] for r in trial.restored.values()}) == 1, trial.restored
    assert trial.reached is not None and trial.reached >= cfg.kill_after
    stride = max(1, trial.stride_at_loss or 0)
    assert trial.steps_lost is not None and 0 <= trial.steps_lost <= max_steps_lost(stride), (
        trial.reached,
        trial.restored,
        stride,
    )
    sources = {rank: r["source"] for rank, r in trial.restored.items()}
    assert sources[0] == sources[1] == "local", sources  # node A survived: its own shared memory
    assert {sources[2], sources[3]} <= {"replica", "pull"}, sources  # node C: from A, B's buddy

    split = trial.split
    assert all(v == v and v >= 0 for v in split.values()), split  # every milestone was found, in order
    assert split["detection_seconds"] < 5 and split["total_seconds"] < 60, split

    # nothing the trials started outlives them: store, agents, workers, sidecars (shared memory: no_shm_leak)
    assert not [p for p in reference.pids + trial.pids if pid_alive(p)]
    assert not marked_processes(tag)
    lost = cluster.sidecars[cluster.node("B1")]
    for name, sidecar in cluster.sidecars.items():
        assert not sidecar.alive(), name
        assert sidecar is lost or sidecar.proc.returncode == 0, (name, cluster.tail(sidecar))
    print(
        f"torchrun trial: {elapsed:.1f} s for both runs; steps lost {trial.steps_lost} at stride {stride}; "
        f"split {split}"
    )
