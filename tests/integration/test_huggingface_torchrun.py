"""The Hugging Face Trainer under torchrun loses a node: ``examples/huggingface/train.py`` (a GPT-2 built from a
config, the Trainer's DDP through accelerate on gloo, :class:`~snapshotd.client.integrations.huggingface.
SnapshotdCallback`) on two emulated nodes of two ranks, each node a sidecar and a torchrun agent; node B is
SIGKILLed after step 6 and a replacement node starts. Against a failure-free run of the same job, run at the same
time on nodes of its own: every step's logged loss, and every rank's model and optimizer, are bit-identical (at
four ranks that needs DDP's gradient bucket layout carried over: without it the losses part at the first step
after the restore). In ``make long`` (the
in-process story of the callback is tests/client/test_huggingface.py, in ``make test``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotd.bench.torchrun_trial import TrialConfig, compare

from .conftest import reference_and_trial

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.long]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "huggingface"
MODEL = ("--width", "32", "--layers", "1", "--heads", "2", "--block", "16", "--batch", "8")


@pytest.mark.timeout(300)
def test_the_trainer_loses_a_node_under_torchrun_and_ends_bit_identical(cluster, tmp_path) -> None:
    cfg = TrialConfig(
        example_dir=str(EXAMPLE), model_args=MODEL, nproc_per_node=2, steps=12, kill_after=6, timeout=150
    )
    reference, trial = reference_and_trial(cluster, str(tmp_path), cfg)
    assert all(len(reference.losses[r]) == cfg.steps for r in range(4)), reference.losses
    same = compare(reference, trial)
    assert same["losses_identical"], f"first differing (rank, step): {same['first_difference']}"
    assert same["digests_equal"] and same["states_equal"], (reference.finals, trial.finals)
    assert len({r["step"] for r in trial.restored.values()}) == 1 and trial.restored[0]["step"] > 0, (
        trial.restored
    )
    sources = {rank: r["source"] for rank, r in trial.restored.items()}
    assert sources[0] == sources[1] == "local", sources  # node A survived: its own shared memory
    assert {sources[2], sources[3]} <= {"replica", "pull"}, sources  # node C: from A, B's buddy
