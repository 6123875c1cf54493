"""Moving a survivor's DDP modules onto the job's new group, issuing the collectives a replacement's DDP
constructor issues.

In live mode a survivor keeps its DDP modules across a peer's loss; :func:`rebind_ddp` gives each one the new
default group and a new reducer, then runs what ``DistributedDataParallel(...)`` runs in the replacement
(``init_sync=True``): the parameter shape check and the broadcast of the module's state from rank 0. Both
sides then issue the same collectives, in the order of the state (the restore that follows overwrites whatever
the broadcast brought). :func:`check_rebindable` refuses, up front, a module whose constructor's collectives
cannot be repeated exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from .ddp import rebuild_reducer

__all__ = ["check_rebindable", "rebind_ddp"]


def check_rebindable(ddp: Any, where: str) -> None:
    """Refuse a DDP module whose constructor's collectives :func:`rebind_ddp` cannot repeat exactly.

    Raises:
        ValueError: DDP with mixed precision (its constructor broadcasts the buffers before casting them), or
            with buffers and ``forward_sync_buffers`` off (the constructor then broadcast them or not depending
            on which argument turned it off, which the module no longer tells).
    """
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError(f"{where}: live mode does not support DDP with mixed_precision")
    if not getattr(ddp, "forward_sync_buffers", True) and any(True for _ in ddp.module.buffers()):
        raise ValueError(
            f"{where}: live mode needs DDP's default buffer sync (broadcast_buffers / "
            "forward_sync_buffers left on) for a model with buffers"
        )


def rebind_ddp(modules: Mapping[str, Any], order: Sequence[str]) -> None:
    """Move each DDP module of ``modules`` (where in the state -> module) onto the current default group, in the
    order of the state's keys ``order`` (the order a replacement's script constructs them in).

    Each gets a new reducer (DDP's initial bucket layout: the restore that follows gives it the snapshot's) and
    runs the collectives of DDP's constructor (``init_sync=True``): the parameter shape check, then the
    broadcast of the module's parameters and buffers from rank 0.

    Raises:
        ValueError: a module :func:`check_rebindable` refuses.
    """
    from torch.nn.parallel.distributed import _sync_module_states, _verify_param_shape_across_processes

    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("rebind_ddp() needs the default process group formed")
    rank_of = {key: i for i, key in enumerate(order)}
    for where in sorted(modules, key=lambda w: rank_of.get(w.split(".", 1)[0], len(rank_of))):
        ddp = modules[where]
        check_rebindable(ddp, f"state[{where!r}]")
        ddp.process_group = group
        rebuild_reducer(ddp, None, f"state[{where!r}]")
        params, _ = ddp._build_params_for_reducer()
        _verify_param_shape_across_processes(group, params)
        _sync_module_states(
            module=ddp.module,
            process_group=group,
            broadcast_bucket_size=ddp.broadcast_bucket_size,
            src=0,
            params_and_buffers_to_ignore=ddp.parameters_to_ignore,
            broadcast_buffers=True,
        )
