"""The disk checkpoints users take today, which snapshotd's per-step cost is measured against: ``torch.save`` or
``torch.distributed.checkpoint.async_save`` every N steps (:class:`DiskCheckpointer`, torch imported only here)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["CHECKPOINT_KINDS", "DiskCheckpointer", "checkpoint_state_dict"]

log = logging.getLogger(__name__)


CHECKPOINT_KINDS = ("torch_save", "dcp_async")
"""The disk checkpoints :class:`DiskCheckpointer` takes, the ways users checkpoint today."""


def checkpoint_state_dict(state: Mapping[str, Any], *, dcp: bool = False) -> dict[str, Any]:
    """What a user's disk checkpoint holds: the state dicts of the model, optimizers and schedulers in ``state``.

    Other values (the RNG state, a few KB) are left out: they change nothing in the cost. With ``dcp`` the model
    and optimizer state dicts come from :func:`torch.distributed.checkpoint.state_dict.get_state_dict`
    (parameter-name keys, which DCP needs), as torchtitan builds them; otherwise from ``state_dict()``, as a
    ``torch.save`` user writes ``{"model": model.state_dict(), "optim": opt.state_dict(), ...}``.

    The tensors are references to the live state, not copies: save them before the next optimizer step.
    """
    import torch

    models = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    scheds = {k: v for k, v in state.items() if isinstance(v, torch.optim.lr_scheduler.LRScheduler)}
    out: dict[str, Any] = {}
    if dcp and len(models) == 1:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        ((mkey, model),) = models.items()
        model_sd, optim_sd = get_state_dict(model, list(optims.values()))
        out[mkey] = model_sd
        if optims:
            out["optim"] = optim_sd
    else:
        stateful: dict[str, Any] = {**models, **optims}
        out.update({k: v.state_dict() for k, v in stateful.items()})
    out.update({k: v.state_dict() for k, v in scheds.items()})
    return out


class DiskCheckpointer:
    """Save a rank's training state to local disk every ``interval`` steps, the way users checkpoint today.

    - ``torch_save``: rank 0 writes ``torch.save(checkpoint_state_dict(state))`` to a temporary file and renames
      it over ``directory/checkpoint.pt``, on the training thread (the DDP idiom: every rank holds the same
      replica, so one writes it; the others wait for it in the next all-reduce). No fsync, as ``torch.save``
      users get by default.
    - ``dcp_async``: every rank calls :func:`torch.distributed.checkpoint.async_save` into ``directory`` (one
      folder, overwritten), after waiting for the previous save's future, as users do. DCP copies the state to
      CPU memory on the training thread, then plans, writes and fsyncs in a background thread, deduplicating
      replicated tensors across ranks. Its collectives run on ``process_group``, which must be a gloo group
      of its own: the training's collectives on the default group must never interleave with them.

    ``started``, ``completed`` count saves; ``bytes_written`` is the size of this rank's files of the newest
    completed save (0 on a rank that writes nothing).

    Args:
        kind: one of :data:`CHECKPOINT_KINDS`.
        state: the rank's state mapping (as given to the Snapshotter); tensors are read, never changed.
        directory: an existing folder on local disk, this job's alone.
        interval: save after every ``interval``-th step.
        rank: this process's rank.
        process_group: ``dcp_async`` only; see above.

    Raises:
        ValueError: an unknown kind, or ``interval < 1``.
    """

    def __init__(
        self,
        kind: str,
        state: Mapping[str, Any],
        directory: str,
        *,
        interval: int = 1,
        rank: int = 0,
        process_group: Any = None,
    ) -> None:
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"checkpoint kind must be one of {CHECKPOINT_KINDS}, got {kind!r}")
        if interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        self.kind = kind
        self.state = state
        self.directory = directory
        self.interval = interval
        self.rank = rank
        self.process_group = process_group
        self.started = 0
        self.completed = 0
        self.bytes_written = 0
        self._future: Any = None

    def after_step(self, step: int) -> float:
        """Call after optimizer step ``step`` (1-based) completed; saves if ``step`` is due.

        Returns:
            Seconds the calling (training) thread spent here: the whole save for ``torch_save``; waiting for the
            previous save plus ``async_save`` itself (state dict, staging copy) for ``dcp_async``.

        Raises:
            OSError, RuntimeError: the save failed (a benchmark wants to know, not to go on).
        """
        if step % self.interval:
            return 0.0
        t0 = time.perf_counter()
        if self.kind == "torch_save":
            if self.rank == 0:
                self._torch_save()
        else:
            self._finish_previous(timeout=None)
            from torch.distributed.checkpoint import async_save

            sd = checkpoint_state_dict(self.state, dcp=True)
            self._future = async_save(sd, checkpoint_id=self.directory, process_group=self.process_group)
            self.started += 1
        return time.perf_counter() - t0

    def finish(self, timeout: float = 120.0) -> None:
        """Wait for the save in flight, if any.

        Raises:
            TimeoutError: it did not finish within ``timeout`` seconds.
        """
        self._finish_previous(timeout)

    def _torch_save(self) -> None:
        import torch

        path = os.path.join(self.directory, "checkpoint.pt")
        tmp = f"{path}.tmp"
        torch.save(checkpoint_state_dict(self.state), tmp)
        os.replace(tmp, path)
        self.started += 1
        self.completed += 1
        self.bytes_written = os.path.getsize(path)

    def _finish_previous(self, timeout: float | None) -> None:
        if self._future is None:
            return
        future, self._future = self._future, None
        try:
            future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise TimeoutError(f"dcp async_save did not finish within {timeout} s") from exc
        self.completed += 1
        prefix = f"__{self.rank}_"
        self.bytes_written = sum(
            os.path.getsize(os.path.join(self.directory, name))
            for name in os.listdir(self.directory)
            if name.startswith(prefix) and name.endswith(".distcp")
        )
