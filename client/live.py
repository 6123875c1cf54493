"""Live recovery: the ranks that survive a node's loss keep their processes; only the lost ranks start anew.

A job in live mode forms its process group with :func:`init_process_group` instead of
``torch.distributed.init_process_group``, and gives the returned :class:`LiveGroup` to its
:class:`~snapshotd.client.Snapshotter` (``live=``). When a peer dies, the survivors' next collective fails
(at once when the peer's process or node is gone and its kernel closes the connections; when the peer hangs,
once the job opens its next epoch for the peer's replacement, which the watchdog of :meth:`LiveGroup.watch` sees,
or else after the group's ``timeout``), :meth:`Snapshotter.guard <snapshotd.client.Snapshotter.guard>` turns that
failure into :class:`~snapshotd.client.PeerLost`, and :meth:`Snapshotter.recover
<snapshotd.client.Snapshotter.recover>` leaves the broken group, waits here for the job's new membership, forms
the new group, gives it to every DDP module and rolls the state back in place to the step every rank restores.
The replacement ranks start as any restarted rank does: :func:`init_process_group`, the model, DDP, and
``restore()``.

Membership lives in a rendezvous store off the training nodes (a ``torch.distributed.TCPStore`` server such as
``snapshotd rdzv-store``; ``$SNAPSHOTD_STORE`` is its ``host:port``), under ``snapshotd/<job>/``.
Each group the job forms is an *epoch* with keys of its own, formed once every rank arrived in it
(:mod:`snapshotd.client.group` states the protocol).

:func:`~snapshotd.client.rebind.rebind_ddp` does what a survivor's DDP module needs in the new group: the reducer
rebuilt for the new group, and the collectives that the replacement's ``DistributedDataParallel(...)``
constructor runs (its parameter shape check and the broadcast of the module's state from rank 0) run here too,
so that both sides issue the same collectives. The restore that follows overwrites whatever the broadcast
brought. The code a replacement runs between :func:`init_process_group` and ``restore()`` must therefore run no
collective other than DDP's constructor (with ``init_sync=True``, the default), one DDP module per state value,
in the order of the state.

The parts: :mod:`snapshotd.client.group` (the :class:`LiveGroup`: its epochs, join, rejoin and leave),
:mod:`snapshotd.client.watchdog` (leaving a group that a hung member holds up), :mod:`snapshotd.client.seat`
(this node's seat, with ``nodes=``), :mod:`snapshotd.client.peers` (which errors are a peer's loss; shutting this
process's connections) and :mod:`snapshotd.client.rebind` (moving DDP modules onto the new group).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from .group import LiveGroup
from .identity import Identity
from .peers import is_peer_failure
from .rebind import check_rebindable, rebind_ddp
from .seat import request_seat
from .watchdog import HANG_CHECK_S

# the parts' public names, re-exported: this module is where users import live mode from
__all__ = [
    "HANG_CHECK_S",
    "STORE_ENV",
    "LiveGroup",
    "check_rebindable",
    "init_process_group",
    "is_peer_failure",
    "rebind_ddp",
]

STORE_ENV = "SNAPSHOTD_STORE"
"""The environment variable naming the rendezvous store, ``host:port``."""


def init_process_group(
    *,
    store: str | None = None,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    nodes: int | None = None,
    sidecar: str | None = None,
    backend: str = "gloo",
    timeout: float = 60.0,
    join_timeout: float = 600.0,
    attempts: int = 3,
    settle: float | None = None,
) -> LiveGroup:
    """Form the job's default process group in live mode (in place of ``torch.distributed.init_process_group``).

    The rank comes from ``rank`` (or ``$RANK``), or, with ``nodes``, from snapshotd: the job then runs on
    ``nodes`` nodes of ``$LOCAL_WORLD_SIZE`` ranks each, the coordinator gives this node a seat (a block of
    ranks; see :mod:`snapshotd.coordinator.seats`) and this process takes rank ``first + $LOCAL_RANK`` of it.
    A node started while every seat is held (a spare) waits, for at most ``join_timeout``, until a node of the
    job dies, and takes its seat.

    Args:
        store: the rendezvous store's ``host:port``; default ``$SNAPSHOTD_STORE``.
        job, rank, world_size: as for the Snapshotter (default ``$SNAPSHOTD_JOB`` or ``$TORCHELASTIC_RUN_ID``,
            ``$RANK``, ``$WORLD_SIZE``). ``rank`` is the rank in the whole job, not on the node.
        nodes: let snapshotd place this node's ranks, in a job of this many nodes (instead of ``rank`` and
            ``world_size``).
        sidecar: the node sidecar's ipc path (with ``nodes``), as for the Snapshotter.
        backend: ``gloo`` (the one live mode is tested with).
        timeout: seconds for the group's collectives and its creation: a hung peer is noticed after this long.
        join_timeout: seconds to wait for the whole membership (the survivors wait this long for a replacement),
            and for a seat.
        attempts: epochs tried before giving up when members die while the group forms.
        settle: an elastic group (virtual ranks, :mod:`snapshotd.client.elastic`): after a loss the survivors form
            a group of whoever arrived once arrivals go quiet (:mod:`snapshotd.client.epochs`), after ``settle``
            seconds at most, instead of waiting for a replacement.

    Raises:
        ValueError: no store, or a malformed one; missing job, rank or world size; ``nodes`` with ``rank`` or
            ``world_size``, or without ``$LOCAL_RANK`` and ``$LOCAL_WORLD_SIZE``.
        RecoveryFailed: no seat came free within ``join_timeout``, or this node's seat was given to another node
            (it was declared dead: hung, or cut off); the membership did not fill within
            ``join_timeout``, or no group formed.
        SnapshotdError: the seat request failed (the sidecar or coordinator refused it, or did not answer).
    """
    if timeout <= 0 or join_timeout <= 0 or attempts < 1 or (settle is not None and settle <= 0):
        raise ValueError("timeout, join_timeout and settle must be > 0, attempts >= 1")  # before connecting
    seat = None
    if nodes is not None:
        if rank is not None or world_size is not None:
            raise ValueError("give nodes= (snapshotd places the ranks) or rank= and world_size=, not both")
        rank, world_size = request_seat(job, nodes, sidecar, join_timeout)
        seat = (nodes, sidecar)
    me = Identity.resolve(job, rank, world_size, None)
    where = store if store is not None else os.environ.get(STORE_ENV, "")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"live mode needs the rendezvous store as host:port (store= or ${STORE_ENV}), got {where!r}"
        )
    client = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=max(timeout, 30.0)),
    )
    group = LiveGroup(
        client,
        job=me.job,
        rank=me.rank,
        world_size=me.world_size,
        backend=backend,
        timeout=timeout,
        join_timeout=join_timeout,
        attempts=attempts,
        seat=seat,
        settle=settle,
    )
    group.join()
    return group
