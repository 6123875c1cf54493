"""``snapshotd export``: one complete step, from the sidecars' memory into a torch.distributed.checkpoint (DCP).

:func:`export_checkpoint` gathers the step from the job's sidecars (:mod:`.gather`: the coordinator says which
live nodes hold it, the snapshots are pulled from them and checked), assembles the checkpoint's state dict from
the ranks' snapshots (:mod:`.assembly`) and writes it through DCP's own planner and storage writer
(:mod:`.checkpoint`, ``dcp.save(..., no_dist=True)``), so that it loads at any world size, into the same kind of
mapping the job gave its ``Snapshotter`` (the model wrapped as it was then: a DDP wrapper's keys start with
``module.``)::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": model, "optim": optim, "sched": sched, "loop": loop}   # built as the job built them
    get_optimizer_state_dict(model, optim)   # an optimizer that has not stepped gets its moments (lr 0 step)
    dcp.load(state, checkpoint_id=DIR)       # DCP calls state_dict() / load_state_dict() on Statefuls

What the checkpoint holds, per top-level key of the ``Snapshotter``'s state: a Stateful value's ``state_dict()``,
a plain value as it is; snapshotd's own keys (DDP bucket layouts) are left out. A DTensor (FSDP2) is written as
its global tensor, assembled from every rank's shard; any other value is rank 0's, or the rank's that kept it
under ``replicated=`` (see :mod:`.assembly`).

Only the snapshots needed are pulled, up to ``parallel`` at once, each dropped once merged: the exporter holds
the checkpoint, plus at most ``parallel`` snapshots. When no step was named and the step being exported is
collected meanwhile, the export starts again at the newer durable step, up to :data:`ATTEMPTS` times (see
:mod:`.gather`). The checkpoint goes to a sibling directory first and is renamed to ``out`` when complete.

Errors: everything the user can act on is an :class:`ExportError` with one line saying what is wrong (an unknown
job, no complete step, a step not held for some ranks, a snapshot from a build that did not record DTensor
layouts, a pull that failed, an output directory that is not empty).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from .checkpoint import check_out, write_checkpoint
from .gather import ATTEMPTS, gather
from .result import Exported, ExportError

__all__ = ["ATTEMPTS", "ExportError", "Exported", "export_checkpoint"]

log = logging.getLogger(__name__)


def export_checkpoint(
    coordinator: str,
    job: str,
    out: str,
    *,
    step: int | None = None,
    secret: str | None = None,
    timeout: float = 10.0,
    parallel: int = 4,
) -> Exported:
    """Write step ``step`` of ``job`` (default: its newest durable step) as a DCP checkpoint in directory ``out``.

    Args:
        coordinator: the job's coordinator.
        job: the job name.
        out: the checkpoint directory; it must not exist or be empty. Written in a sibling directory first and
            renamed when complete.
        step: the step to export; None: the newest durable step, and the newer one when that one is collected
            while exporting.
        secret: the job's secret (``SNAPSHOTD_SECRET``): the connections are then CurveZMQ clients.
        timeout: seconds any one reply may take (the coordinator's, a holder's).
        parallel: snapshots pulled at once at most.

    Raises:
        ExportError: the export cannot be done (see the module docstring); nothing is left at ``out``.
    """
    out = check_out(out)
    state, done = asyncio.run(gather(coordinator, job, step, secret, timeout, parallel))
    write_checkpoint(state, out)
    log.info(
        "exported job %s step %d (%d ranks; pulled ranks %s, %d bytes) to %s",
        job,
        done.step,
        done.world_size,
        done.pulled,
        done.pulled_bytes,
        out,
    )
    return dataclasses.replace(done, out=out)
