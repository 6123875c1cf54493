"""``Snapshotter``: the two lines a training loop adds.

::

    snap = Snapshotter({"model": model, "optim": opt, "sched": sched, "rng": RNGState()}, job="run-42")
    start = snap.restore()                 # steps already completed; state loaded in place
    for step in range(start, total_steps):
        train_one_step()
        snap.capture(step + 1)             # returns at once

What ``capture(step)`` costs the training thread: flattening the state (walking state dicts, packing non-tensor
data) and copying small or mutable tensors (module buffers, anything not a parameter or optimizer state)
synchronously; parameters and optimizer moments are copied into shared memory by the background thread (CPU) or
on a side CUDA stream (GPU) while the next forward and backward run. A step pre-hook on every optimizer found in
the state makes the next ``optimizer.step()`` wait for that copy, so a snapshot is never torn. Nothing here does
network I/O on the training thread, and no sidecar trouble raises inside ``capture()``: it is logged and counted
in :attr:`Snapshotter.stats`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .capture import Capture
from .group import LiveGroup
from .identity import Identity
from .recovering import LiveRecovery, check_ddp, check_live
from .restoring import Restorer
from .session import SidecarSession
from .stats import SnapshotStats
from .view import snapshot_view

__all__ = ["Snapshotter"]


class Snapshotter:
    """Snapshot a rank's training state after every step to buddy nodes' memory, and restore it after a failure.

    Args:
        state: name -> Stateful object (``state_dict``/``load_state_dict``: modules, optimizers, schedulers,
            StatefulDataLoader, GradScaler, :class:`RNGState`) or tensors and containers of tensors and plain data.
        job: the job name; default ``$SNAPSHOTD_JOB``, else ``$TORCHELASTIC_RUN_ID``.
        rank, world_size: default torch.distributed's when initialised, else ``$RANK`` / ``$WORLD_SIZE``.
        sidecar: the sidecar's ipc path; default ``$SNAPSHOTD_SIDECAR``, else the per-user default path.
        every: snapshot every ``every``-th step, or ``"auto"``: as often as 1% of training time allows, measured
            as the job runs (see :mod:`snapshotd.client.schedule`; on a GPU node, where snapshots cost the step
            next to nothing, that is every step).
        when_busy: ``"skip"`` (default) skips a step's snapshot when no slot is free, and then, so that all
            ranks skip alike, snapshots only the steps of a coarser power-of-two grid until its slots are free
            again (:class:`~snapshotd.client.schedule.AlignedStride`); ``"block"`` waits.
        timeout: seconds for any wait on the sidecar (registration, a blocked capture, a slot); ``restore()`` has
            its own.
        slots: shared-memory slots. Three: one streaming, and the copies recovery may need: the newest complete
            one, and those on the buddies not older than the job's durable step D (another node's failure may
            make the job resume from one). A rank runs at most ``slots - 1`` snapshots ahead of D.
        replicated: keys of ``state`` whose Stateful values every rank of ``replica_group`` holds bitwise alike
            (data parallelism: the model, optimizer and scheduler; never the RNG or the data loader). Each of
            their tensors is snapshotted by one rank of the group only, and ``restore()`` shares them out over
            the group (see :mod:`snapshotd.client.replicas`). Every rank of the group must pass the same keys.
        replica_group: a gloo process group of the ranks holding ``replicated`` alike; default the whole world
            (which must then use gloo).
        live: live mode (:mod:`snapshotd.client.live`): the :class:`~snapshotd.client.live.LiveGroup` that
            :func:`~snapshotd.client.live.init_process_group` returned. A peer's loss then surfaces from
            :meth:`guard` as :class:`~snapshotd.client.PeerLost`, and :meth:`recover` brings the job back
            without restarting this process. ``replica_group`` is then the default group (the one live mode
            forms anew).

    Raises:
        ValueError: missing job/rank/world size, or a bad argument.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        *,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        sidecar: str | None = None,
        every: int | str = 1,
        when_busy: str = "skip",
        timeout: float = 30.0,
        slots: int = 3,
        replicated: Sequence[str] = (),
        replica_group: Any = None,
        live: LiveGroup | None = None,
    ) -> None:
        me = Identity.resolve(job, rank, world_size, sidecar)
        if live is not None:
            check_live(live, me, replica_group)
        if every != "auto" and not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every must be an int >= 1 or 'auto', got {every!r}")
        if when_busy not in ("skip", "block"):
            raise ValueError(f"when_busy must be 'skip' or 'block', got {when_busy!r}")
        if not 1 <= slots <= 16:
            raise ValueError(f"slots must be 1-16, got {slots}")
        view, group, ddp = snapshot_view(state, replicated, replica_group)
        if live is not None:
            check_ddp(ddp)
        self.job, self.rank, self.world_size, self.sidecar = me.job, me.rank, me.world_size, me.sidecar
        self.state = state
        self._every, self._when_busy, self._timeout, self._slots = every, when_busy, timeout, slots
        self.stats = SnapshotStats()
        self._closed = False
        self._session = SidecarSession(
            me, state, self.stats, slots=slots, timeout=timeout, when_busy=when_busy
        )
        self._capture = Capture(self._session, view, every, when_busy)
        self._restorer = Restorer(self._session, view, group, live)
        self._session.on_restore = self._restorer.on_message
        self._recovery = (
            LiveRecovery(live, self._session, self._restorer, state, ddp) if live is not None else None
        )

    @property
    def every(self) -> int | str:
        """The snapshot interval this Snapshotter was made with, in steps or ``"auto"`` (read-only: its parts
        hold it)."""
        return self._every

    @property
    def when_busy(self) -> str:
        """``"skip"`` or ``"block"``, as made (read-only)."""
        return self._when_busy

    @property
    def timeout(self) -> float:
        """The seconds a wait on the sidecar lasts at most, as made (read-only)."""
        return self._timeout

    @property
    def slots(self) -> int:
        """The snapshots a rank holds in its arena at once, as made (read-only)."""
        return self._slots

    @property
    def restored(self) -> dict[str, Any]:
        """What the last :meth:`restore` did: step, source (fresh/local/pull), bytes_pulled, seconds."""
        return self._restorer.restored

    @property
    def recovered(self) -> dict[str, Any]:
        """Live mode: what the last :meth:`recover` did: ``step``, ``epoch`` and the seconds of its phases
        (``membership_s``: waiting for the job's new membership, ``group_s``: creating the group, ``ddp_s``:
        moving the DDP modules onto it, ``restore_s``: the rollback)."""
        return self._recovery.recovered if self._recovery is not None else {}

    def restore(self, timeout: float = 300.0) -> int:
        """Load the job's recoverable step into the state, in place, and return it (0 on a fresh job).

        Blocks until every rank of the job has asked (so all restore the same step), at most ``timeout`` seconds.
        In live mode, a rank waiting here while the job forms a newer group (a member of this one died before it
        asked, and its restarted process opened the next epoch) joins that group as :meth:`recover` does and
        restores there.

        With ``replicated``, a collective over the replica group (every rank of it calls ``restore()``): a rank
        that fails says so to the others, which then raise too instead of waiting for it.

        Raises:
            NotRecoverable: snapshots exist but no step is complete for every rank (restore from disk instead).
            SidecarUnavailable: the sidecar or coordinator did not answer in time.
            RestoreFailed: the recoverable step could not be brought here or loaded (every rank asks again).
            ConfigMismatch: the snapshot does not match this state (different keys, shapes or dtypes).
            ReplicaGroupError: with ``replicated``, another rank of the replica group failed.
            SidecarRefused: the sidecar refused the request (its ``code`` says why).
            Whatever :meth:`recover` raises, in live mode, where it follows the job to a newer group.
        """
        if self._recovery is None:
            return self._restorer.restore(timeout)
        return self._recovery.restore(timeout)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Live mode: run a training step; a collective failing because a peer died or hung leaves it as
        :class:`~snapshotd.client.PeerLost` (any other exception leaves as it is).

        A peer's death surfaces at once when its connections close (its process or node is gone); a hung peer's
        once the job opens its next epoch for the peer's replacement (the live group's watchdog, see
        :meth:`LiveGroup.watch <snapshotd.client.live.LiveGroup.watch>`), else after the live group's ``timeout``.
        The rank then tells its sidecar, which tells the coordinator: it probes the job's nodes, and declares a
        node whose sidecar is gone dead at once instead of after the death timeout (see
        :mod:`snapshotd.coordinator.probes`), so that a replacement or spare gets its seat sooner.
        """
        with self._live_mode("guard()").guard():
            yield

    def recover(self, timeout: float = 300.0) -> int:
        """Live mode: bring the job back after :class:`~snapshotd.client.PeerLost`, in this process; the step
        every rank resumes from.

        Leaves the broken process group, waits for the job's new membership (the survivors and the replacement
        ranks; at most the live group's ``join_timeout``), forms the new default group, moves every DDP module
        of the state onto it, and restores in place as :meth:`restore` does (this rank's own copy, from its
        node's shared memory: no tensor is reallocated). Every survivor calls it; a replacement rank calls
        :meth:`restore` as any restarted rank does. :attr:`recovered` tells the phases' seconds.

        A peer lost again while the new group moves DDP or restores (the replacement dying) starts over with the
        next group, up to the live group's ``attempts``. A rank that dies after its group formed but before it
        asked for its restore leaves the others waiting for their restores until its restarted process opens the
        job's next epoch (it arrives a second time): the live group's watchdog sees that epoch, and every rank
        waiting (survivors here, replacements in :meth:`restore`) forms the next group with it.

        Raises:
            RecoveryFailed: the new group did not form (the replacement never came; members kept dying), or this
                node's seat was given to another node (it was declared dead: it hung, or was cut off).
            SnapshotdError: a seated node's seat request failed (the sidecar or coordinator refused it, or did not
                answer).
            Whatever :meth:`restore` raises.
        """
        return self._live_mode("recover()").recover(timeout)

    def _live_mode(self, call: str) -> LiveRecovery:
        """The live-mode part, for ``call``; RuntimeError outside live mode."""
        if self._recovery is None:
            raise RuntimeError(
                f"{call} is for live mode: Snapshotter(..., live=snapshotd.client.live.init_process_group())"
            )
        return self._recovery

    def capture(self, step: int) -> bool:
        """Start a snapshot of the state as it is after ``step`` completed optimizer steps.

        Returns at once (the tensor copy runs in the background). True if a snapshot of this step was started;
        False if skipped (not an ``every``-th step, no free slot, or a sidecar problem, all counted in ``stats``).
        Never raises for sidecar or network trouble.

        Raises:
            TypeError: a state value cannot be snapshotted (named by key path), at the first capture.
            ValueError: ``step`` did not grow.
        """
        if self._closed:
            raise RuntimeError("capture() after close()")
        return self._capture.capture(step)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last started snapshot is durable on every buddy, or failed. True if durable."""
        return self._session.wait(timeout)

    def flush(self, step: int, timeout: float = 60.0) -> bool:
        """Make ``step``, the step last captured, durable on every buddy: snapshot it now if :meth:`capture` passed
        over it (waiting for a free slot), then wait for it. Whether it is durable within ``timeout`` seconds.

        Raises:
            ValueError: ``step`` is not the step last captured.
        """
        return self._capture.flush(step, timeout)

    def close(self, *, unregister: bool = True) -> None:
        """Finish the copy in flight, tell the sidecar this rank is done (freeing its arena), stop the thread.

        Afterwards the Snapshotter holds no reference to the state, so its objects are freed when the training
        code drops them (a data loader's iterator and its worker processes among them), not whenever the garbage
        collector gets to this object.
        """
        if self._closed:
            return
        self._closed = True
        if self._recovery is not None:
            self._recovery.close()
        self._restorer.close()
        self._session.close(unregister=unregister)
        self._capture.close()
        self.state = {}

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # A crash keeps the rank's arena (the local fast path); a clean exit frees it.
        self.close(unregister=exc_type is None)
