"""Zero-wait recovery: the survivors of a node's loss carry the lost ranks' work at once (:class:`ElasticJob`).

A data-parallel job of ``W`` ranks is ``W`` virtual ranks (:mod:`snapshotd.client.virtual`), reduced in exact mode
(:class:`~snapshotd.client.reducers.ExactReducer`). Each virtual rank is a snapshotd rank of its own: a
:class:`~snapshotd.client.Snapshotter` per virtual rank a process carries, over the shared state (model,
optimizer, scheduler) and that virtual rank's :class:`~snapshotd.client.virtual.VirtualRank` (its data and random
streams). So whichever process carries a virtual rank, its copies are where a restore finds them.

- **Shrink.** A peer's loss fails the survivors' collective; :meth:`ElasticJob.guard` raises
  :class:`~snapshotd.client.PeerLost`, and :meth:`ElasticJob.recover` forms the group of the survivors (an elastic
  :class:`~snapshotd.client.group.LiveGroup`: whoever arrived once arrivals go quiet, within its ``settle``
  seconds; :mod:`snapshotd.client.epochs`), spreads the lost
  virtual ranks over them (:func:`~snapshotd.client.virtual.spread`), and restores every virtual rank at the
  job's step G in one plan round: the survivors' own roll back from their slots, the lost ones are pulled from
  their copies. Nobody waits for a replacement.
- **Grow.** A replacement (a fresh process, started whenever the scheduler starts it) opens the job's next epoch
  and waits there. While the group is shrunk, :meth:`ElasticJob.capture` looks once per step whether one waits
  (group rank 0 reads the store; a one-element all-reduce tells the others); if so every member makes the step
  durable (:meth:`Snapshotter.flush <snapshotd.client.Snapshotter.flush>`; the members agree that every flush
  succeeded, else they try again at the next step), arrives in the newcomer's epoch (which waits for every
  member), lets go of the virtual ranks that move (their Snapshotters unregister), and forms the larger group; the replacement restores its virtual ranks at that
  step from the copies the survivors streamed, and the survivors roll back to that same step (their own state).
  No step is repeated.

A process carrying several virtual ranks streams the shared state once per virtual rank: the price of each
virtual rank's copies being complete wherever it moves.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from snapshotd.proto import PeerLostReport

from .errors import PeerLost, RecoveryFailed
from .group import LiveGroup
from .peers import is_peer_failure
from .reducers import EquivalentReducer, ExactReducer
from .snapshotter import Snapshotter
from .virtual import Layout, VirtualRank

__all__ = ["MODES", "ElasticJob"]

MODES = {"exact": ExactReducer, "equivalent": EquivalentReducer}
"""The reductions a job may use, by name: bit-identical to the failure-free run, or equal up to the order of the
floating-point sum (see :mod:`snapshotd.client.reducers`)."""

log = logging.getLogger(__name__)

VRANK_KEY = "vrank"
"""The state key under which each virtual rank's Snapshotter keeps its :class:`VirtualRank`."""


class ElasticJob:
    """A data-parallel job over virtual ranks (exact or equivalent mode), with zero-wait recovery.

    Args:
        group: the job's elastic live group (:func:`snapshotd.client.live.init_process_group` with ``settle=``);
            its world size is the job's number of virtual ranks.
        state: the state every virtual rank shares (model, optimizer, scheduler: alike on every process); must not
            hold ``"vrank"``.
        params: the parameters to reduce (the model's).
        data: ``data(v)`` makes virtual rank ``v``'s data (a ``StatefulDataLoader`` or anything with a state dict),
            or None.
        seed: the job's seed for the virtual ranks' random streams.
        mode: ``"exact"`` or ``"equivalent"`` (:data:`MODES`); the failure-free run must use the same.
        sidecar, timeout: as for the Snapshotter (each virtual rank's).

    The loop (``examples/zero_wait``)::

        with ElasticJob(group, state, model.parameters(), data=make_loader) as job:
            step = job.restore()
            while step < steps:
                try:
                    with job.guard():
                        opt.zero_grad(set_to_none=True)
                        for vr in job.carried:
                            with vr.active():
                                loss = loss_of(model, vr.next_batch())
                                loss.backward()
                            job.collect(vr)
                        job.reduce()
                        opt.step()
                        job.capture(step + 1)
                except PeerLost:
                    step = job.recover()
                    continue
                step += 1
    """

    def __init__(
        self,
        group: LiveGroup,
        state: Mapping[str, Any],
        params: Iterable[torch.nn.Parameter],
        *,
        data: Callable[[int], Any] | None = None,
        seed: int = 0,
        mode: str = "exact",
        sidecar: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if group.settle is None:
            raise ValueError("an ElasticJob needs an elastic live group (init_process_group(settle=...))")
        if group.seat is not None:
            raise ValueError(
                "an ElasticJob's nodes are placed by index (init_process_group(rank=, world_size=)): while "
                "shrunk, a survivor carries the lost node's ranks, so its seat never comes free"
            )
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        if VRANK_KEY in state:
            raise ValueError(f"state key {VRANK_KEY!r} is the virtual rank's own")
        self.group, self.world = group, group.world_size
        self._state, self._data, self._seed = dict(state), data, seed
        self._sidecar, self._timeout = sidecar, timeout
        self.layout = Layout.of(self.world, group.members, group.group_rank)
        self.reducer = MODES[mode](
            params, self.layout
        )  # first: it refuses bad parameters before anything opens
        self.vranks: dict[int, VirtualRank] = {}
        self._snaps: dict[int, Snapshotter] = {}
        self._carry()
        self.recovered: dict[str, Any] = {}
        self.grown: dict[str, Any] = {}

    @property
    def carried(self) -> list[VirtualRank]:
        """The virtual ranks this process carries now, in order."""
        return [self.vranks[v] for v in self.layout.mine]

    @property
    def shrunk(self) -> bool:
        """Whether fewer processes than virtual ranks carry the job now."""
        return self.layout.processes < self.world

    def collect(self, vrank: VirtualRank) -> None:
        """After ``vrank``'s backward: keep its gradient (the reducer's ``collect``)."""
        self.reducer.collect(vrank.index)

    def reduce(self) -> None:
        """The mean gradient over every virtual rank into each parameter's ``.grad`` (a collective)."""
        self.reducer.reduce()

    def restore(self, timeout: float = 600.0) -> int:
        """Restore every virtual rank this process carries (one plan round with the job's other virtual ranks:
        they are asked at once); the step they resume from (0 on a fresh job).

        Raises:
            RestoreFailed, NotRecoverable: as for :meth:`Snapshotter.restore`.
            RecoveryFailed: the virtual ranks restored different steps.
        """
        snaps = list(self._snaps.values())
        with concurrent.futures.ThreadPoolExecutor(len(snaps), thread_name_prefix="snapshotd-vrank") as pool:
            steps = list(pool.map(lambda s: s.restore(timeout=timeout), snaps))
        if len(set(steps)) != 1:
            raise RecoveryFailed(f"the virtual ranks {list(self._snaps)} restored different steps {steps}")
        return steps[0]

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective failing for a peer's loss into :class:`PeerLost` (as :meth:`Snapshotter.guard`)."""
        group = self.group
        try:
            with group.step():
                yield
        except Exception as exc:
            if not is_peer_failure(exc) and not group.left_behind:
                raise
            group.leave()
            home = self._snaps.get(group.rank) or next(iter(self._snaps.values()))
            home._session.channel.send(
                PeerLostReport(job=group.job, rank=home.rank)
            )  # the coordinator probes
            raise PeerLost(
                f"job {group.job!r} rank {group.rank}: a peer of epoch {group.epoch} was lost: "
                f"{str(exc).splitlines()[0][:300]}"
            ) from exc

    def capture(self, step: int) -> None:
        """Snapshot every virtual rank carried at ``step``; while shrunk, also let a waiting replacement in (a
        collective: call it inside :meth:`guard`, on every process, after every step)."""
        for snap in self._snaps.values():
            snap.capture(step)
        if self.shrunk and self._newcomer_waits():
            self._grow(step)

    def recover(self, timeout: float = 600.0) -> int:
        """After :class:`PeerLost`: form the group of whoever survives, carry the lost virtual ranks, and restore
        every virtual rank at the job's step G; that step. :attr:`recovered` tells how long each phase took.

        Raises:
            RecoveryFailed: no group formed, or it formed without this process (it arrived late: restart it).
            NotRecoverable: some virtual rank's state is nowhere.
        """
        t0 = time.monotonic()
        for attempt in range(1, self.group.attempts + 1):
            self.group.rejoin()
            t1 = time.monotonic()
            for snap in self._snaps.values():  # the copy in flight reads the tensors the rollback writes
                snap._session.stager.fence(timeout=self._timeout, host=True)
            try:
                self._relayout()
                t2 = time.monotonic()
                step = self.restore(timeout)
                break
            except Exception as exc:  # a member of the new group died too: form the next one
                if not is_peer_failure(exc) or attempt == self.group.attempts:
                    raise
                log.warning("[job %s] a peer was lost again while recovering: %s", self.group.job, exc)
        self.recovered = {
            "step": step,
            "epoch": self.group.epoch,
            "processes": self.layout.processes,
            "carried": list(self.layout.mine),
            "group_s": t1 - t0,
            "restore_s": time.monotonic() - t2,
            "seconds": time.monotonic() - t0,
        }
        log.info(
            "[job %s rank %d] carrying virtual ranks %s of %d at step %d (epoch %d, %.2f s)",
            self.group.job,
            self.group.rank,
            list(self.layout.mine),
            self.world,
            step,
            self.group.epoch,
            self.recovered["seconds"],
        )
        return step

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every carried virtual rank's last snapshot is durable (:meth:`Snapshotter.wait`); whether
        all are."""
        return all([snap.wait(timeout) for snap in self._snaps.values()])

    def close(self) -> None:
        """Close every virtual rank's Snapshotter."""
        for snap in self._snaps.values():
            snap.close()
        self._snaps.clear()

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        for snap in self._snaps.values():  # a crash keeps the arenas (the local fast path)
            snap.close(unregister=False)

    # ------------------------------------------------------------------------------------------ internals

    def _newcomer_waits(self) -> bool:
        """Whether a process waits in a newer epoch (group rank 0 reads the store; every member learns it)."""
        seen = torch.zeros(1, dtype=torch.int32, device=self.reducer.device)
        if self.group.group_rank == 0:
            seen[0] = int(self.group.newest_epoch > self.group.epoch)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        return bool(seen[0])

    def _grow(self, step: int) -> None:
        """Make ``step`` durable for every virtual rank carried, then form the larger group and move virtual ranks
        to the newcomers; the survivors roll back to ``step`` (their own state) as the newcomers restore it."""
        t0 = time.monotonic()
        flushed = all([snap.flush(step, timeout=self._timeout) for snap in self._snaps.values()])
        agreed = torch.tensor([int(flushed)], dtype=torch.int32, device=self.reducer.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if not agreed[0]:  # every member skips this boundary alike; the newcomer waits for the next
            log.warning(
                "[job %s] step %d is not durable on every member: the newcomer joins later",
                self.group.job,
                step,
            )
            return
        t1 = time.monotonic()
        # the virtual ranks that move are let go before the group forms: a newcomer asking for one while this
        # node still reports it running would wait for this node to be declared dead
        self.group.grow(on_members=self._release_moved)
        self._relayout()
        t2 = time.monotonic()
        restored = self.restore()
        if restored != step:
            raise RecoveryFailed(
                f"the job grew at step {step} but its virtual ranks restored step {restored}"
            )
        self.grown = {
            "step": step,
            "epoch": self.group.epoch,
            "processes": self.layout.processes,
            "flush_s": t1 - t0,
            "group_s": t2 - t1,
            "restore_s": time.monotonic() - t2,
            "seconds": time.monotonic() - t0,
        }
        log.info(
            "[job %s rank %d] the job grew to %d processes at step %d; carrying %s (%.2f s)",
            self.group.job,
            self.group.rank,
            self.layout.processes,
            step,
            list(self.layout.mine),
            self.grown["seconds"],
        )

    def _release_moved(self, members: tuple[int, ...]) -> None:
        """Let go of the virtual ranks that the layout of ``members`` gives other processes."""
        layout = Layout.of(self.world, members, members.index(self.group.rank))
        for v in sorted(set(self._snaps) - set(layout.mine)):
            self._snaps.pop(v).close()
            del self.vranks[v]

    def _relayout(self) -> None:
        """Carry the virtual ranks the current group's layout gives this process."""
        self.layout = Layout.of(self.world, self.group.members, self.group.group_rank)
        self._carry()
        self.reducer.relayout(self.layout)

    def _carry(self) -> None:
        """Let go of the virtual ranks ``layout`` moves elsewhere (their Snapshotters unregister: their copies on
        the buddies stay), and take on the ones it brings."""
        self._release_moved(self.group.members)
        for v in self.layout.mine:
            if v in self._snaps:
                continue
            vr = VirtualRank(v, seed=self._seed, data=None if self._data is None else self._data(v))
            self.vranks[v] = vr
            self._snaps[v] = Snapshotter(
                {**self._state, VRANK_KEY: vr},
                job=self.group.job,
                rank=v,
                world_size=self.world,
                sidecar=self._sidecar,
                timeout=self._timeout,
            )
