"""snapshotd in torchtitan: :class:`SnapshotdCheckpointManager` (``pip install snapshotd[torchtitan]``).

One line in a torchtitan config function::

    config.checkpoint = SnapshotdCheckpointManager.Config()        # DCP checkpoints too: Config(enable=True)

torchtitan's Trainer calls its checkpoint manager's ``load()`` before the first step and ``save()`` after every
step. This manager snapshots the training state into snapshotd at every ``save()`` and, at ``load()``, restores the
newest step every rank can resume from (the Trainer then goes on from it). With nothing in snapshotd's memory (a
fresh job) ``load()`` is that of torchtitan's own DCP manager, which the fields inherited from
``CheckpointManager.Config`` drive as always: ``enable=True`` keeps DCP checkpoints every ``interval`` steps beside
the snapshots, and a job that restarts from nothing resumes from the newest one.

A snapshot holds each model part's parameters and buffers (FSDP2's local shards as they are), the state of each of
the container's optimizers, the LR schedulers, the data loader's position for this rank, the Trainer's step and
token count, and every random generator. The job, rank and world size come from torchrun's environment, as for
any :class:`~snapshotd.client.Snapshotter`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer.base import BaseCheckpointManager

from ..errors import NotRecoverable
from ..rng import RNGState
from ..snapshotter import Snapshotter

__all__ = ["SnapshotdCheckpointManager"]

log = logging.getLogger(__name__)


class SnapshotdCheckpointManager(BaseCheckpointManager):
    """A torchtitan checkpoint manager that snapshots every step into snapshotd and restores from it, beside
    torchtitan's DCP checkpoints (off unless ``enable``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """``CheckpointManager.Config`` (its fields drive the DCP checkpoints) and the snapshots' own settings."""

        snapshot_every: int = 1
        """Snapshot every this many steps (the Snapshotter's ``every``)."""

        snapshot_timeout: float = 30.0
        """Seconds a snapshot may wait for the sidecar (the Snapshotter's ``timeout``)."""

        restore_timeout: float = 600.0
        """Seconds ``load()`` waits for every rank of the job to ask for a restore."""

        sidecar: str | None = None
        """The sidecar's ipc socket; by default from the environment (``SNAPSHOTD_SIDECAR``)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.disk = CheckpointManager(
            config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=dict(states),
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        """torchtitan's DCP manager over the same state (it does nothing unless ``config.enable``)."""
        self.enable = True  # the Trainer's calls always reach the hooks below
        self.restore_timeout = config.restore_timeout
        # each module and optimizer a value of its own: their tensors are then copied as any model's
        state: dict[str, Any] = {f"model.{i}": part for i, part in enumerate(model_parts)}
        state.update({f"optimizer.{i}": optimizer for i, optimizer in enumerate(optimizers.optimizers)})
        state.update(states)  # the Trainer's own ("train_state": its step and token count)
        state.update({"lr_schedulers": lr_schedulers, "rng": RNGState()})
        if dataloader is not None:
            state["dataloader"] = dataloader
        self.snapshotter = Snapshotter(
            state, sidecar=config.sidecar, every=config.snapshot_every, timeout=config.snapshot_timeout
        )

    @property
    def save_future(self) -> Any:  # type: ignore[override]
        """The DCP manager's asynchronous save in flight, if any."""
        return getattr(self.disk, "save_future", None)

    def _load(self, step: int = -1) -> bool:
        """Restore the newest step every rank holds in snapshotd; without one, torchtitan's DCP load of ``step``.

        Raises:
            NotRecoverable: snapshots exist but no step is complete for every rank, and DCP checkpoints are off.
            RestoreFailed: as for :meth:`Snapshotter.restore <snapshotd.client.Snapshotter.restore>`.
        """
        try:
            restored = self.snapshotter.restore(timeout=self.restore_timeout)
        except NotRecoverable:
            if not self.disk.enable:
                raise
            log.warning("no snapshot step is complete for every rank: loading torchtitan's DCP checkpoint")
            return self.disk.load(step)
        if restored:
            log.info(
                "[job %s rank %d] resuming at step %d", self.snapshotter.job, self.snapshotter.rank, restored
            )
            return True
        return self.disk.load(step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Snapshot ``curr_step`` (returns at once; the copy runs in the background), then the DCP manager's save."""
        self.snapshotter.capture(curr_step)
        return self.disk.save(curr_step, last_step)

    def _maybe_wait_for_staging(self) -> None:
        self.disk.maybe_wait_for_staging()

    def _wait_for_saving(self) -> None:
        self.disk.maybe_wait_for_saving()

    def _close(self) -> None:
        """Close the Snapshotter (finishing the copy in flight) and the DCP manager.

        The rank's arena in the sidecar is freed unless an exception is being handled: torchtitan's ``train.py``
        closes a Trainer whose step raised (a lost peer's collective among the causes) in its ``except`` clause,
        and that rank's restarted process restores from the arena (the rule of the Snapshotter's own ``with``).
        """
        self.snapshotter.close(unregister=sys.exc_info()[0] is None)
        self.disk.close()
