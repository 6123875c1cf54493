"""The Hugging Face Trainer with :class:`~snapshotd.client.integrations.huggingface.SnapshotdCallback`: a run that
dies after step 5 and a new Trainer resumed from the snapshot end bit-identical to a run never stopped (a tiny
GPT-2 built from a config, dropout on, AdamW, a cosine schedule with warm-up, a shuffled data set; real sidecars
and coordinator in this process over the in-memory transport). The same story under torchrun with a node lost is
tests/integration/test_frameworks_torchrun.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from snapshotd.client.integrations.huggingface import SnapshotdCallback  # noqa: E402

from ..deployments import InProcess  # noqa: E402

STEPS, DIES_AFTER = 9, 5


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Dies(transformers.TrainerCallback):  # type: ignore[misc]
    """The process's death right after ``step``'s snapshot was taken."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"died after step {self.step}")


def _trainer(out: Path, callbacks: list[Any]) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
    )
    model = transformers.GPT2LMHeadModel(config)
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)


def _digest(trainer: Any) -> str:
    h = hashlib.sha256()
    for t in [*trainer.model.state_dict().values()]:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in trainer.optimizer.state_dict()["state"].values():
        for t in state.values():
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_a_trainer_resumed_from_the_snapshot_ends_bit_identical_to_one_never_stopped(tmp_path: Path) -> None:
    never_stopped = _trainer(tmp_path / "reference", [])
    never_stopped.train()
    job = f"hf-{os.getpid()}"
    with InProcess() as dep:
        ipc = dep.start_sidecar("a")
        dep.start_sidecar("b")  # the buddy: the snapshots become durable
        first = SnapshotdCallback(job=job, rank=0, world_size=1, sidecar=ipc, when_busy="block")
        dying = _trainer(tmp_path / "first", [first, _Dies(DIES_AFTER)])
        assert first.restore(dying) is None  # a fresh job: the Trainer starts from scratch
        with pytest.raises(KeyboardInterrupt):
            dying.train(resume_from_checkpoint=None)
        snap = first.snapshotter
        assert snap is not None and snap.wait(30)
        snap.close(unregister=False)  # the process is gone; the sidecars keep its snapshots

        second = SnapshotdCallback(job=job, rank=0, world_size=1, sidecar=ipc)
        resumed = _trainer(tmp_path / "second", [second])
        folder = second.restore(resumed)
        assert folder is not None and os.path.isfile(os.path.join(folder, "trainer_state.json"))
        resumed.train(resume_from_checkpoint=folder)
        assert not os.path.exists(folder)  # removed once training ran again
    assert resumed.state.global_step == STEPS
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > DIES_AFTER] == [
        h["loss"] for h in never_stopped.state.log_history if "loss" in h and h["step"] > DIES_AFTER
    ]
    assert _digest(resumed) == _digest(never_stopped)


def test_a_trainer_that_never_restored_is_told_how() -> None:
    callback = SnapshotdCallback(job="never", rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="resume_from_checkpoint=callback.restore"):
        callback.on_train_begin(None, None, None)
