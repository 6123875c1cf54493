"""Lightning with :class:`~snapshotd.client.integrations.lightning.SnapshotdCallback`: a run that dies after step 5
(mid-epoch) and a new Trainer resumed from the snapshot end bit-identical to a run never stopped (a small model with
dropout, AdamW, a step LR schedule, a shuffled ``StatefulDataLoader``; real sidecars and coordinator in this process
over the in-memory transport)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from snapshotd.client.integrations.lightning import SnapshotdCallback  # noqa: E402

from ..deployments import InProcess  # noqa: E402

# Lightning 2.6 still asks torch's pytree an old question (torch 2.13 warns)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
)

STEPS, DIES_AFTER = 10, 5  # 4 batches an epoch: the loss falls in the second epoch


class _Model(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


class _Died(Exception):
    """Stands for the process's death (Lightning turns a KeyboardInterrupt into a graceful stop)."""


class _Dies(L.Callback):  # type: ignore[misc]
    """The process's death right after ``step``'s snapshot was taken."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise _Died(f"died after step {self.step}")


def _fit(
    out: Path, callbacks: list[Any], restore: SnapshotdCallback | None = None
) -> tuple[Any, _Model, int]:
    """Fit to ``STEPS`` (resuming through ``restore``'s callback when given); the trainer, the model, the step
    restored."""
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    # the sampler draws each epoch's seed from torch's generator, which the snapshot carries (a loader's own
    # generator= is not in its state: a resumed StatefulDataLoader shuffles the next epoch otherwise)
    loader = StatefulDataLoader(data, batch_size=8, shuffle=True)
    model = _Model()
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=callbacks,
    )
    ckpt = restore.restore(trainer) if restore is not None else None
    restored = restore.snapshotter.restored["step"] if restore is not None and restore.snapshotter else 0
    if restored:
        assert ckpt is not None and os.path.isfile(ckpt)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)
    assert ckpt is None or not os.path.exists(ckpt)  # removed once fit read it
    return trainer, model, restored


def _digest(trainer: Any, model: _Model) -> str:
    h = hashlib.sha256()
    tensors = [*model.state_dict().values()]
    tensors += [t for s in trainer.optimizers[0].state_dict()["state"].values() for t in s.values()]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_a_lightning_run_resumed_from_the_snapshot_ends_bit_identical_to_one_never_stopped(
    tmp_path: Path,
) -> None:
    reference, ref_model, _ = _fit(tmp_path / "reference", [])
    job = f"lightning-{os.getpid()}"
    with InProcess() as dep:
        ipc = dep.start_sidecar("a")
        dep.start_sidecar("b")  # the buddy: the snapshots become durable
        first = SnapshotdCallback(job=job, rank=0, world_size=1, sidecar=ipc, when_busy="block")
        with pytest.raises(_Died):
            _fit(tmp_path / "first", [first, _Dies(DIES_AFTER)], restore=first)
        assert (
            first.snapshotter is None
        )  # on_exception closed it as a crash would: the sidecars keep its snapshots

        second = SnapshotdCallback(job=job, rank=0, world_size=1, sidecar=ipc)
        resumed, model, restored = _fit(tmp_path / "second", [second], restore=second)
        assert restored == DIES_AFTER and second.snapshotter is None  # closed at the end of fit
    assert resumed.global_step == STEPS
    assert {s: v for s, v in model.losses.items() if s > DIES_AFTER} == {
        s: v for s, v in ref_model.losses.items() if s > DIES_AFTER
    }
    assert _digest(resumed, model) == _digest(reference, ref_model)


def test_a_fit_that_never_restored_is_told_how() -> None:
    callback = SnapshotdCallback(job="never", rank=0, world_size=1)
    with pytest.raises(RuntimeError, match=r"ckpt_path=callback.restore"):
        callback.on_fit_start(None, None)
