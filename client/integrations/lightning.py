"""snapshotd in Lightning: :class:`SnapshotdCallback` (``pip install snapshotd[lightning]``).

Two lines in a Lightning script::

    snap = SnapshotdCallback()                                         # job, rank, world size from torchrun
    trainer = L.Trainer(..., callbacks=[snap])
    trainer.fit(model, datamodule=data, ckpt_path=snap.restore(trainer))   # None on a fresh job

After every optimizer step (``on_train_batch_end`` once ``global_step`` moved) the callback captures the checkpoint
Lightning would write at that point (model, optimizers, LR schedulers, loops with their progress and the stateful
data loaders' positions, callbacks, precision plugin, hyper-parameters), with every random generator beside it.
:meth:`restore` loads the newest step every rank can resume from, out of snapshotd's memory, writes that checkpoint
to a private local file and returns its path: ``fit`` resumes from it by Lightning's own rules (the file is
removed when training starts), and the generators are set as they were at ``on_train_batch_start`` of the first
batch after the resume. Lightning fetches that batch first: random numbers drawn in the main process to fetch it
(a transform, a sampler without its own generator starting an epoch) are drawn from other states than in the run
that was snapshotted, so the resume is exact when fetching a batch draws none in the main process. The
strategy's DDP module takes the snapshot's gradient bucket layout when training starts, so that the resumed run
sums gradients in the same order as the one snapshotted (Lightning's own checkpoints carry neither the generators
nor the layout).

A mid-epoch resume continues the epoch where it was only with data loaders that have a state
(``torchdata.stateful_dataloader.StatefulDataLoader``): Lightning restarts a plain ``DataLoader``'s epoch.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from ..ddp import DDPBuckets
from ..rng import RNGState
from ..snapshotter import Snapshotter
from .common import Hold, ddp_layouts

__all__ = ["SnapshotdCallback"]

log = logging.getLogger(__name__)


class _Checkpoint:
    """Lightning's checkpoint as of the last optimizer step, the generators then and DDP's gradient bucket layout,
    as one Stateful."""

    def __init__(self) -> None:
        self.trainer: pl.Trainer | None = None
        self.ddp: DDPBuckets | None = None
        """The gradient bucket layout of the strategy's DDP module, once it wrapped the model."""
        self.loaded: dict[str, Any] | None = None
        """What the last restore loaded (None before one)."""

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint now (empty before the first step: a restore's template, the snapshot's values are rebuilt
        from it)."""
        if self.trainer is None:
            return {}
        # what ModelCheckpoint writes at the same hook, without the file, and without the hyper-parameters (the
        # resumed fit does not read them, and they may hold values a snapshot cannot carry)
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for module in (pl.LightningModule, pl.LightningDataModule):
            for name in (
                "CHECKPOINT_HYPER_PARAMS_KEY",
                "CHECKPOINT_HYPER_PARAMS_NAME",
                "CHECKPOINT_HYPER_PARAMS_TYPE",
            ):
                checkpoint.pop(getattr(module, name), None)
        ddp = self.ddp.state_dict() if self.ddp is not None else {}
        return {"lightning": checkpoint, "rng": RNGState().state_dict(), "ddp": ddp}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loaded = dict(state_dict)


class SnapshotdCallback(pl.Callback):
    """A Lightning ``Callback`` that snapshots the training state after every optimizer step, and :meth:`restore`,
    which turns the newest recoverable step into a checkpoint ``fit`` resumes from.

    Args:
        snapshotter: keyword arguments for the :class:`~snapshotd.client.Snapshotter` (``job``, ``rank``,
            ``world_size``, ``sidecar``, ``every``, ``timeout``, ...); by default, all from the environment
            torchrun sets.
    """

    def __init__(self, **snapshotter: Any) -> None:
        self._hold = Hold(snapshotter, "trainer.fit(..., ckpt_path=callback.restore(trainer))")
        self._parts = _Checkpoint()
        self._path: str | None = None  # the checkpoint file a restore wrote, until fit has read it
        self._rng: Mapping[str, Any] | None = (
            None  # the generators to set at the first batch after the resume
        )
        self._captured = -1

    @property
    def snapshotter(self) -> Snapshotter | None:
        """The Snapshotter, once :meth:`restore` made it."""
        return self._hold.snap

    def restore(self, trainer: pl.Trainer, timeout: float = 600.0) -> str | None:
        """Restore the newest step every rank can resume from; the checkpoint path to pass to
        ``trainer.fit(..., ckpt_path=...)``, or None on a fresh job. Call it on every rank, before ``fit``.

        Raises:
            RestoreFailed, NotRecoverable: as for :meth:`Snapshotter.restore <snapshotd.client.Snapshotter.restore>`.
        """
        step = self._hold.restore({"lightning": self._parts}, timeout)
        snap, loaded = self._hold.required(), self._parts.loaded
        if step == 0 or loaded is None:
            return None
        self._drop_checkpoint()  # one of an earlier restore()
        fd, path = tempfile.mkstemp(prefix=f"snapshotd-lightning-{snap.job}-{snap.rank}-", suffix=".ckpt")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(loaded["lightning"], f)
        except BaseException:
            os.unlink(path)
            raise
        self._path, self._rng = path, loaded["rng"]
        log.info("[job %s rank %d] resuming Lightning at step %d", snap.job, snap.rank, step)
        return path

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hold.required()
        if isinstance(trainer.strategy, (pl.strategies.FSDPStrategy, pl.strategies.DeepSpeedStrategy)):
            raise RuntimeError("SnapshotdCallback does not snapshot the FSDP or DeepSpeed strategies")
        self._parts.trainer = trainer
        self._captured = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parts.ddp = ddp_layouts(trainer.strategy.model, (self._parts.loaded or {}).get("ddp"))
        self._drop_checkpoint()  # fit has read it

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:  # the first batch after the resume: the generators as they were
            RNGState().load_state_dict(self._rng)
            self._rng = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._captured:  # an optimizer step, not an accumulated micro-batch
            self._captured = trainer.global_step
            self._hold.required().capture(trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the Snapshotter: another ``fit`` with this callback restores first, as a new process does."""
        self._hold.close()
        self._parts.loaded = None

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """A failed fit keeps its snapshots where they are (the copy in flight completes), as a crash would."""
        self._drop_checkpoint()
        self._hold.close(unregister=False)

    def _drop_checkpoint(self) -> None:
        if self._path is not None:
            os.unlink(self._path)
            self._path = None
