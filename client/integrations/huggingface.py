"""snapshotd in the Hugging Face ``Trainer``: :class:`SnapshotdCallback` (``pip install snapshotd[huggingface]``).

Two lines in a Trainer script::

    snap = SnapshotdCallback()                                        # job, rank, world size from torchrun
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[snap])
    trainer.train(resume_from_checkpoint=snap.restore(trainer))       # None on a fresh job

After every optimizer step (``on_step_end``) the callback captures the model, the optimizer, the learning-rate
scheduler, the Trainer's state (global step, epoch, log history) and every random generator. :meth:`restore` loads
the newest step that every rank can resume from out of snapshotd's memory (the model in place), writes it as a
Trainer checkpoint in a private local folder, and returns that folder: the Trainer then resumes from it by its own
rules, as from a checkpoint on disk (optimizer, scheduler and generators loaded, the data loader fast-forwarded past
the batches the restored step used). The folder is removed at the first step after the resume.

The snapshot also carries the gradient bucket layout of the Trainer's DDP module, which the resumed Trainer's DDP
takes at ``on_train_begin``: gradients are then summed in the same order as in the run that was snapshotted, at any
number of ranks (the Trainer's own resume from disk starts DDP from its initial layout). DeepSpeed and FSDP
through the Trainer are refused. The optimizer's state sits inside the callback's state, where the Snapshotter does
not see it change, so each capture copies it on the training thread (the model's parameters are copied as for any
Snapshotter).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.training_args import ParallelMode
from transformers.utils import SAFE_WEIGHTS_NAME

from ..ddp import DDPBuckets
from ..rng import RNGState
from ..snapshotter import Snapshotter
from .common import Hold, ddp_layouts

__all__ = ["SnapshotdCallback"]

log = logging.getLogger(__name__)


class _TrainerParts:
    """The Trainer's state beside the model and the generators, as one Stateful: the optimizer's and the scheduler's
    state dicts, the ``TrainerState`` as JSON and DDP's gradient bucket layout, as of the last ``on_step_end``."""

    def __init__(self) -> None:
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.ddp: DDPBuckets | None = None
        """The gradient bucket layout of the Trainer's DDP module, once it wrapped the model."""
        self.trainer_state = ""
        self.loaded: dict[str, Any] | None = None
        """What the last restore loaded (None before one)."""

    def state_dict(self) -> dict[str, Any]:
        """The parts as of the last step; empty before the Trainer's first (a restore's template: the snapshot's
        values are rebuilt from it, new tensors included)."""
        if self.optimizer is None:
            return {}
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "trainer_state": self.trainer_state,
            "ddp": self.ddp.state_dict() if self.ddp is not None else {},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loaded = dict(state_dict)


class SnapshotdCallback(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` that snapshots the Trainer's state after every optimizer step, and :meth:`restore`,
    which turns the newest recoverable step into a checkpoint the Trainer resumes from.

    Args:
        snapshotter: keyword arguments for the :class:`~snapshotd.client.Snapshotter` (``job``, ``rank``,
            ``world_size``, ``sidecar``, ``every``, ``timeout``, ...); by default, all from the environment
            torchrun sets.
    """

    def __init__(self, **snapshotter: Any) -> None:
        self._hold = Hold(snapshotter, "trainer.train(resume_from_checkpoint=callback.restore(trainer))")
        self._parts = _TrainerParts()
        self._trainer: Trainer | None = None
        self._resume_dir: str | None = None

    @property
    def snapshotter(self) -> Snapshotter | None:
        """The Snapshotter, once :meth:`restore` made it."""
        return self._hold.snap

    def restore(self, trainer: Trainer, timeout: float = 600.0) -> str | None:
        """Restore the newest step every rank can resume from; the checkpoint folder to pass to
        ``trainer.train(resume_from_checkpoint=...)``, or None on a fresh job. Call it on every rank, before
        ``train()``.

        Raises:
            RestoreFailed, NotRecoverable: as for :meth:`Snapshotter.restore <snapshotd.client.Snapshotter.restore>`.
        """
        self._trainer = trainer
        step = self._hold.restore(
            {"model": trainer.model, "trainer": self._parts, "rng": RNGState()}, timeout
        )
        if step == 0:
            return None
        snap = self._hold.required()
        self._drop_checkpoint()  # one of an earlier restore()
        self._resume_dir = _write_checkpoint(trainer, self._parts, snap)
        log.info("[job %s rank %d] resuming the Trainer at step %d", snap.job, snap.rank, step)
        return self._resume_dir

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._hold.required()
        trainer = self._trainer
        assert trainer is not None  # restore() keeps it
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise RuntimeError("SnapshotdCallback does not snapshot DeepSpeed or FSDP through the Trainer")
        self._parts.ddp = ddp_layouts(trainer.model_wrapped, (self._parts.loaded or {}).get("ddp"))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        parts = self._parts
        parts.optimizer, parts.scheduler = kwargs["optimizer"], kwargs.get("lr_scheduler")
        parts.trainer_state = json.dumps(dataclasses.asdict(state), sort_keys=True)
        self._hold.required().capture(state.global_step)
        self._drop_checkpoint()  # the Trainer has read it by its first step

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close the Snapshotter: another ``train()`` with this callback restores first, as a new process does."""
        self._drop_checkpoint()
        self._hold.close()
        self._parts.loaded = None

    def _drop_checkpoint(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None


def _write_checkpoint(trainer: Trainer, parts: _TrainerParts, snap: Snapshotter) -> str:
    """The restored state as a Trainer checkpoint in a new local folder (read only by this rank): the model's
    weights, the optimizer, the scheduler, the generators as the restore set them, the TrainerState."""
    loaded = parts.loaded
    if loaded is None:
        raise RuntimeError("the snapshot restored no Trainer state")  # a snapshot always holds it
    model = trainer.model
    if model is None:
        raise RuntimeError("the Trainer has no model")
    folder = tempfile.mkdtemp(prefix=f"snapshotd-trainer-{snap.job}-{snap.rank}-")
    try:
        # save_pretrained() writes on global rank 0 only; every rank reads its own folder
        safetensors.torch.save_model(
            model, os.path.join(folder, SAFE_WEIGHTS_NAME), metadata={"format": "pt"}
        )
        torch.save(loaded["optimizer"], os.path.join(folder, OPTIMIZER_NAME))
        torch.save(loaded["scheduler"], os.path.join(folder, SCHEDULER_NAME))
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
            f.write(loaded["trainer_state"])
        # the Trainer's own layout: the CUDA states of every device under a distributed launch, else one
        rng: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available():
            distributed = trainer.args.parallel_mode == ParallelMode.DISTRIBUTED
            rng["cuda"] = (
                torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
            )
        name = (
            f"rng_state_{trainer.args.process_index}.pth" if trainer.args.world_size > 1 else "rng_state.pth"
        )
        torch.save(rng, os.path.join(folder, name))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder
