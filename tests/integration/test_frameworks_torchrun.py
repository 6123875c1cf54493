"""The frameworks under torchrun lose a node: ``examples/huggingface/train.py`` (a GPT-2 built from a config, the
Trainer's DDP through accelerate), ``examples/lightning/train.py`` (a small language model, the DDP strategy, a
``StatefulDataLoader``), each with its ``SnapshotdCallback``, and ``examples/torchtitan/train.py`` (torchtitan's
Trainer on its Llama 3 debug model cut to one block, FSDP2 over the four ranks, with ``SnapshotdCheckpointManager``),
on two emulated nodes of two ranks (gloo), each node a sidecar and a torchrun agent. Node B is SIGKILLed after step
6, mid-epoch, and a replacement node starts. Against a failure-free run of the same job, run at the same time on
nodes of its own: every step's loss, and every rank's model and optimizer, are bit-identical (at four ranks under
DDP that needs DDP's gradient bucket layout carried over: without it the Trainer's losses part at the first step
after the restore). In ``make long``; the in-process story of each integration is in ``make test``
(tests/client/test_huggingface.py, test_lightning.py, test_torchtitan.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from snapshotd.bench.torchrun_trial import TrialConfig, compare

from .conftest import reference_and_trial

pytestmark = [pytest.mark.integration, pytest.mark.long]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL = ("--width", "32", "--heads", "2", "--block", "16", "--batch", "8")


@pytest.mark.parametrize(
    ("example", "library", "model"),
    [
        ("huggingface", "transformers", (*MODEL, "--layers", "1")),
        ("lightning", "lightning", MODEL),
        ("torchtitan", "torchtitan", ("--layers", "1", "--block", "32", "--batch", "2")),
    ],
)
@pytest.mark.timeout(300)
def test_a_framework_loses_a_node_under_torchrun_and_ends_bit_identical(
    cluster, tmp_path, example: str, library: str, model: tuple[str, ...]
) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"needs {library} (pip install snapshotd[{example}])")
    cfg = TrialConfig(
        example_dir=str(EXAMPLES / example),
        model_args=model,
        nproc_per_node=2,
        steps=12,
        kill_after=6,
        timeout=150,
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
