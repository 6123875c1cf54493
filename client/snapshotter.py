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

import collections
import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from snapshotd.proto import (
    Announce,
    Message,
    PeerLostReport,
    RankRegistered,
    RegisterRank,
    RestoreFetch,
    RestoreProgress,
    RestoreReply,
    RestoreRequest,
    SlotUpdate,
    TensorEntry,
    UnregisterRank,
    decode_table,
    encode_table,
    match_entries,
)
from snapshotd.proto import limits as L
from snapshotd.shm import Arena, attach_arena, pid_alive, process_started

from .channel import Channel
from .direct import direct_targets, writable_by
from .errors import NotRecoverable, PeerLost, RecoveryFailed, RestoreFailed, SnapshotdError
from .fetch import RestoreFetcher
from .group import LiveGroup
from .identity import Identity
from .load import restore_into
from .peers import is_peer_failure
from .progress import RestoreDisplay, restore_display
from .rebind import check_rebindable, rebind_ddp
from .replicas import ReplicaShard, agree_restored, fail_remaining
from .schedule import AlignedStride, AutoInterval, left_out
from .staging import Stager
from .state import FlatState, flatten
from .stats import ProblemLog, SnapshotStats
from .view import SnapshotView, restore_targets, snapshot_view
from .walker import StateWalker

__all__ = ["Snapshotter"]

log = logging.getLogger(__name__)

SIDECAR_CHECK_S = 1.0
"""With ``when_busy="block"``, how often a capture waiting for a free slot checks that the sidecar still runs."""


class _LeftBehind(RecoveryFailed):
    """Live mode: the job formed a newer group while this rank waited for its restore in the current one."""


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

    recovered: dict[str, Any]
    """Live mode: what the last :meth:`recover` did: ``step``, ``epoch`` and the seconds of its phases
    (``membership_s``: waiting for the job's new membership, ``group_s``: creating the group, ``ddp_s``: moving
    the DDP modules onto it, ``restore_s``: the rollback)."""

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
            if (live.job, live.rank, live.world_size) != (me.job, me.rank, me.world_size):
                raise ValueError(
                    f"live={live!r} is not this Snapshotter's job {me.job!r}, rank {me.rank} of "
                    f"{me.world_size}"
                )
            if replica_group is not None:
                raise ValueError(
                    "live mode forms the job's group anew after a loss: replica_group must be the "
                    "default group (leave it out)"
                )
        self.job, self.rank, self.world_size, self.sidecar = me.job, me.rank, me.world_size, me.sidecar
        if every != "auto" and not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every must be an int >= 1 or 'auto', got {every!r}")
        if when_busy not in ("skip", "block"):
            raise ValueError(f"when_busy must be 'skip' or 'block', got {when_busy!r}")
        if not 1 <= slots <= 16:
            raise ValueError(f"slots must be 1-16, got {slots}")
        self.state = state
        self._snapshotted, self._replica_group, self._ddp = snapshot_view(state, replicated, replica_group)
        self._replicated = (
            self._replica_group is not None
        )  # the group itself is None while recover() forms one
        self.every = every
        self._auto = AutoInterval() if every == "auto" else None
        self._aligned = AlignedStride(every) if isinstance(every, int) and when_busy == "skip" else None
        self.when_busy = when_busy
        self.timeout = timeout
        self.slots = slots
        self.stats = SnapshotStats(stride=every if isinstance(every, int) and when_busy == "skip" else 0)
        self._lock = threading.Condition()
        self._free: set[int] = set()
        self._updates = 0  # SlotUpdates received
        self._last_update = time.monotonic()
        self._sidecar_ok = True
        self._pending_registration: RankRegistered | None = None
        self._sidecar_pid = 0
        self._sidecar_started: int | None = None  # when the sidecar started, if this process can see it
        self._last_failed_step = -1
        self._registration_sent = -1e9
        self._inflight: dict[int, int] = {}  # slot -> step staged or announced, until a newer update frees it
        self._arena: Arena | None = None
        self._slot_tensors: list[torch.Tensor] = []
        self._registered_bytes = -1
        self._table_layout: Any = None
        self._table_id = 0
        self._table_sent = False
        self._last_step = -1  # newest step started (or restored)
        self._last_captured = -1  # newest step capture() was called with
        self._taken_at: dict[int, float] = {}  # step -> when capture() started it, until it is durable
        self._recovery_point = (
            -1,
            time.monotonic(),
        )  # newest durable (or restored) step, and when it was taken
        self._last_capture_end: float | None = None  # time.monotonic()
        self._step_seconds = 0.0
        # the steps since the last announce, for the sidecar's pacer: durations, and when the last one ended
        self._steps: collections.deque[float] = collections.deque(maxlen=L.MAX_ANNOUNCED_STEPS)
        self._steps_end = 0.0
        self._problems = ProblemLog()
        self._closed = False
        self._live = live
        if live is not None and self._ddp is not None:
            for where, ddp in self._ddp.modules.items():
                check_rebindable(ddp, f"state[{where!r}]")
        self.recovered = {}
        self._recovering = False  # inside recover(): a restore left behind raises to its loop
        self.restored: dict[str, Any] = {}
        """What the last restore() did: step, source (fresh/local/pull), bytes_pulled, seconds."""
        self._restore_display: RestoreDisplay | None = None  # while restore() draws its progress
        self._restore_targets: tuple[list[TensorEntry], list[int]] = ([], [])  # what the restore asked for
        self._fetching: tuple[RestoreFetcher, threading.Thread] | None = None  # a fetch the sidecar asked for
        self._fetch_lock = threading.Lock()
        self._channel = Channel(self.sidecar, self._on_message)
        self._stager = Stager(state, self.stats)
        self._walker = StateWalker()
        if live is not None:
            live.watch()  # stopped by close()

    # ------------------------------------------------------------------------------------------ public

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
        try:
            return self._restore_in_group(timeout)
        except _LeftBehind:
            live = self._live
            if live is None or self._recovering:
                raise
            log.warning(
                "[job %s rank %d] the job formed a newer group while this rank waited for its restore in "
                "epoch %d: joining it",
                self.job,
                self.rank,
                live.epoch,
            )
            return self.recover(timeout)

    def _restore_in_group(self, timeout: float) -> int:
        """:meth:`restore` in the current group; raises RecoveryFailed (live mode) when the job formed a newer one
        while this rank waited."""
        shards = [v for v in self._snapshotted.values() if isinstance(v, ReplicaShard)]
        for shard in shards:
            shard.agreed = False
        try:
            flat, reply = self._ask_restore(timeout)
        except Exception:
            try:
                self._agree(ok=False, timeout=timeout)
            except Exception as exc:  # this rank's own error is the one to raise
                log.warning("could not tell the replica group that this rank's restore failed: %s", exc)
            raise
        self._agree(ok=True, timeout=timeout)
        self.restored = {
            "step": reply.step,
            "source": reply.source,
            "bytes_pulled": reply.bytes_pulled,
            "seconds": reply.seconds,
            "direct": reply.direct,
            "fetched": reply.fetched,
        }
        if reply.source == "fresh":
            log.info("[job %s rank %d] fresh job: starting at step 0", self.job, self.rank)
            return 0
        arena = self._map_arena(
            reply.arena, reply.slot_bytes, self._arena.slots if self._arena else self.slots
        )
        entries = decode_table(reply.table, reply.slot_bytes)
        targets = direct_targets(
            flat
        )  # entries paired with a live tensor that had no target went to the slot
        placed = {
            i: flat.tensors[j]
            for i, j in match_entries(entries, flat.entries).items()
            if reply.direct and j < len(targets) // 8 and any(targets[8 * j : 8 * j + 8])
        }
        try:
            restore_into(
                self._snapshotted, entries, reply.meta, self._slot_tensors[reply.slot], placed=placed
            )
        except SnapshotdError:
            fail_remaining(shards)
            raise
        except ValueError as exc:  # the snapshot's own table or meta is malformed
            fail_remaining(shards)
            raise RestoreFailed(
                f"job {self.job!r} rank {self.rank}: step {reply.step} could not be loaded: {exc}"
            ) from exc
        except Exception:
            fail_remaining(shards)
            raise
        self._last_step = self._last_captured = reply.step
        self._recovery_point = (reply.step, time.monotonic())
        self.stats.last_durable_step = reply.step  # it came from memory that survived the failure
        self._table_sent = False
        log.info(
            "[job %s rank %d] restored step %d (%s%s) in %.2f s",
            self.job,
            self.rank,
            reply.step,
            reply.source,
            f", {reply.bytes_pulled / 1e6:.1f} MB pulled" if reply.bytes_pulled else "",
            reply.seconds,
        )
        del arena
        return reply.step

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Live mode: run a training step; a collective failing because a peer died or hung leaves it as
        :class:`~snapshotd.client.PeerLost` (any other exception leaves as it is).

        A peer's death surfaces at once when its connections close (its process or node is gone); a hung peer's
        once the job opens its next epoch for the peer's replacement (the live group's watchdog, see
        :meth:`LiveGroup.watch <snapshotd.client.live.LiveGroup.watch>`), else after the live group's ``timeout``. The rank then tells its sidecar, which tells the coordinator: it probes
        the job's nodes, and declares a node whose sidecar is gone dead at once instead of after the death timeout
        (see :mod:`snapshotd.coordinator.probes`), so that a replacement or spare gets its seat sooner.
        """
        if self._live is None:
            raise RuntimeError(
                "guard() is for live mode: Snapshotter(..., live=snapshotd.client.live.init_process_group())"
            )
        try:
            with self._live.step():
                yield
        except Exception as exc:
            if not is_peer_failure(exc) and not self._live.left_behind:
                raise
            self._live.leave()  # the peers blocked on this rank fail now, not after the group's timeout
            self._channel.send(
                PeerLostReport(job=self.job, rank=self.rank)
            )  # the coordinator probes the job's nodes
            raise PeerLost(
                f"job {self.job!r} rank {self.rank}: a peer of epoch {self._live.epoch} was lost: "
                f"{str(exc).splitlines()[0][:300]}"
            ) from exc

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
        if self._live is None:
            raise RuntimeError(
                "recover() is for live mode: Snapshotter(..., live=snapshotd.client.live.init_process_group())"
            )
        self._recovering = True
        try:
            return self._recover(timeout)
        finally:
            self._recovering = False

    def _recover(self, timeout: float) -> int:
        assert self._live is not None
        t0 = time.monotonic()
        self._stager.fence(
            timeout=self.timeout, host=True
        )  # the copy in flight reads the tensors the rollback writes
        replicated = self._replicated
        for attempt in range(1, self._live.attempts + 1):
            # the broken group is destroyed once nothing holds it (its gloo loop spins while it lives)
            if self._ddp is not None:
                self._ddp.release()
            if replicated:
                self._replicate_over(None)
            self._live.rejoin()
            t1 = time.monotonic()
            try:
                if replicated:
                    self._replicate_over(dist.group.WORLD)
                if self._ddp is not None:
                    self._ddp.rediscover()
                    rebind_ddp(self._ddp.modules, list(self.state))
                t2 = time.monotonic()
                step = self.restore(timeout)
                break
            except Exception as exc:  # a member of the new group died too: form the next one
                if (
                    not (is_peer_failure(exc) or isinstance(exc, _LeftBehind))
                    or attempt == self._live.attempts
                ):
                    raise
                log.warning(
                    "[job %s rank %d] a peer was lost again while recovering (epoch %d): %s",
                    self.job,
                    self.rank,
                    self._live.epoch,
                    str(exc).splitlines()[0][:200],
                )
        self.recovered = {
            "step": step,
            "epoch": self._live.epoch,
            **self._live.timings,
            "ddp_s": t2 - t1,
            "restore_s": time.monotonic() - t2,
            "seconds": time.monotonic() - t0,
        }
        log.info(
            "[job %s rank %d] recovered in place at step %d (epoch %d) in %.2f s",
            self.job,
            self.rank,
            step,
            self._live.epoch,
            self.recovered["seconds"],
        )
        return step

    def _replicate_over(self, group: Any) -> None:
        """Make ``group`` the replica group of every ``replicated=`` value (None: no group, between two)."""
        self._replica_group = group
        for value in self._snapshotted.values():
            if isinstance(value, ReplicaShard):
                value.group = group

    def _ask_restore(self, timeout: float) -> tuple[FlatState, RestoreReply]:
        """Register, ask the sidecar for the recoverable step and wait for its reply (the data is in place, or
        in the arena slot, when this returns); the live state's restore targets flattened for it."""
        flat = flatten(restore_targets(self._snapshotted))
        self._register(flat.data_bytes, self.timeout)
        with self._lock:  # the restore rearranges the slots; the sidecar sends them afresh after its reply
            self._free.clear()
            self._inflight.clear()
            seen = self._updates
        targets = direct_targets(flat)
        with self._fetch_lock:  # a RestoreFetch for this restore may start a fetch from now until it ends
            self._restore_targets = (flat.entries, np.frombuffer(targets, dtype="<u8").tolist())
        display = self._restore_display = restore_display(self.job, self.rank)  # None: nothing to draw here
        live = self._live
        epoch = live.epoch if live is not None else -1

        def on_wait() -> None:
            if display is not None:
                display.draw()
            if live is not None and live.left_behind:
                raise _LeftBehind(
                    f"job {self.job!r} rank {self.rank}: the job opened a newer group while this rank waited for "
                    f"its restore in epoch {epoch}: a member of the group is gone"
                )

        reply: Message | None = None
        try:
            with (
                writable_by(self._sidecar_pid if targets else 0),
                live.step() if live is not None else contextlib.nullcontext(),
            ):
                reply = self._channel.request(
                    RestoreRequest(
                        job=self.job,
                        rank=self.rank,
                        world_size=self.world_size,
                        timeout_s=timeout,
                        progress=display is not None,
                        fetch=True,
                        table=encode_table(flat.entries) if targets else b"",
                        targets=targets,
                    ),
                    "restore_reply",
                    timeout + 5,
                    on_wait=on_wait if display is not None or live is not None else None,
                )
        except _LeftBehind:  # the sidecar abandons the restore asked in the old group now, before this rank
            self._stop_fetch(ended=True)  # before the sidecar frees the slot it writes into
            try:  # joins the next: an answer to it, were the round to freeze on its ask, would reach no one
                self._register(flat.data_bytes, self.timeout)
            except SnapshotdError as exc:
                log.warning(
                    "[job %s rank %d] could not register again after leaving the group: %s",
                    self.job,
                    self.rank,
                    exc,
                )
            raise
        except NotRecoverable as exc:
            raise NotRecoverable(
                f"job {self.job!r}: no step is recoverable from memory ({exc}). Load your last disk checkpoint and "
                "go on under a new job name: this job's snapshots belong to a run that cannot be resumed."
            ) from exc
        finally:
            self._stop_fetch(
                ended=True
            )  # the reply came after the fetch's answer; on any other end it stops here
            self._restore_display = None
            if display is not None:
                display.finish(reply if isinstance(reply, RestoreReply) else None)
        assert isinstance(reply, RestoreReply)
        with self._lock:  # so that the first capture() finds its free slots
            self._lock.wait_for(lambda: self._updates > seen, timeout=min(self.timeout, 5.0))
        return flat, reply

    def _agree(self, *, ok: bool, timeout: float) -> None:
        """With ``replicated``: :func:`~.replicas.agree_restored`; a rank's own restore may take its request's
        timeout, plus the wait for its slots, after the others'."""
        if self._replica_group is not None:
            wait = datetime.timedelta(seconds=timeout + self.timeout + 10)
            agree_restored(self._replica_group, ok=ok, job=self.job, wait=wait)

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
        if step <= self._last_captured:
            raise ValueError(f"capture({step}) after capture({self._last_captured}): steps only grow")
        self._last_captured = step
        self.stats.last_step = step
        t0 = time.monotonic()
        step_seconds = None if self._last_capture_end is None else t0 - self._last_capture_end
        if step_seconds is not None:
            self._step_seconds = step_seconds
            self._steps.append(step_seconds)
            self._steps_end = t0
        started = False
        try:
            if self._auto is not None:
                due = self._auto.due(step)
            else:
                due = step % self.every == 0 and not left_out(step, self.every)  # type: ignore[operator,arg-type]
            if not due:
                return False
            flat = self._walker.flatten(
                self._snapshotted
            )  # TypeError for unsnapshottable values propagates: a user error
            # at every step due, not only at the aligned ones: a registration retried in the background (the
            # sidecar restarted) goes on while the stride is long
            registered = self._ensure_registered(flat.data_bytes)
            if self._aligned is not None:
                with self._lock:  # unregistered, the rank has no slots to wait for: its stride does not grow
                    slot_free = bool(self._free) or self._arena is None or not registered
                aligned = self._aligned.due(step)
                self._aligned.record(step, slot_free=slot_free)
                self.stats.stride = self._aligned.stride
                if not aligned:  # passed over so that this rank skips the steps the others skip
                    self.stats.skipped += 1
                    return False
            if not registered:
                self.stats.skipped += 1
                return False
            started = self._start(step, flat)
            return started
        finally:
            end = time.monotonic()
            self.stats.capture_seconds += end - t0
            with self._lock:
                self._update_rpo()
            self._last_capture_end = end
            if self._auto is not None:
                in_flight = self._last_step > max(self.stats.last_durable_step, self._last_failed_step)
                self._auto.record(step_seconds, started=started, in_flight=in_flight)
                self.stats.auto_interval = self._auto.interval

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last started snapshot is durable on every buddy, or failed. True if durable."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        target = self._last_step
        with self._lock:
            while self.stats.last_durable_step < target and self._last_failed_step < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return self.stats.last_durable_step >= target

    def close(self, *, unregister: bool = True) -> None:
        """Finish the copy in flight, tell the sidecar this rank is done (freeing its arena), stop the thread.

        Afterwards the Snapshotter holds no reference to the state, so its objects are freed when the training
        code drops them (a data loader's iterator and its worker processes among them), not whenever the garbage
        collector gets to this object.
        """
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.unwatch()
        self._stop_fetch(ended=True)
        self._stager.fence(timeout=self.timeout, host=True)  # before the arena is unregistered and unmapped
        self._stager.remove_hooks()
        if unregister:
            self._channel.send(UnregisterRank(job=self.job, rank=self.rank))
        self._channel.close()
        if self._arena is not None:
            self._slot_tensors = []
            self._arena.close()
        self.state = {}
        self._snapshotted = SnapshotView({}, {}, {})
        self._ddp = None
        self._stager = Stager({}, self.stats)

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # A crash keeps the rank's arena (the local fast path); a clean exit frees it.
        self.close(unregister=exc_type is None)

    # ---------------------------------------------------------------------------------------- internals

    def _registration(self, data_bytes: int) -> RegisterRank:
        return RegisterRank(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            data_bytes=data_bytes,
            slots=self.slots,
        )

    def _register(self, data_bytes: int, timeout: float) -> None:
        """Register (or re-register with a bigger size) and map the arena, waiting at most ``timeout``."""
        with self._lock:
            self._free.clear()
            self._inflight.clear()
        replied: list[int] = []  # the count of slot updates when the reply came

        def on_reply(_: Message) -> None:  # on the channel thread, before it reads the next message
            with self._lock:  # updates sent before the reply may name slots that announces since then took
                self._free.clear()
                replied.append(self._updates)

        reply = self._channel.request(
            self._registration(data_bytes), "rank_registered", timeout, on_reply=on_reply
        )
        assert isinstance(reply, RankRegistered)
        self._adopt(reply)
        with self._lock:  # the sidecar sends the free slots right after its reply
            self._lock.wait_for(
                lambda: bool(replied) and self._updates > replied[0], timeout=min(timeout, 5.0)
            )

    def _adopt(self, reply: RankRegistered) -> None:
        self._map_arena(reply.arena, reply.slot_bytes, reply.slots)
        self._sidecar_pid = reply.pid
        self._sidecar_started = process_started(reply.pid)
        self._registered_bytes = reply.slot_bytes
        self._table_sent = False
        self._sidecar_ok = True

    def _ensure_registered(self, data_bytes: int) -> bool:
        """Make sure the arena fits ``data_bytes``. Never waits long: a local sidecar answers in milliseconds; one
        that does not is retried in the background (at most once a second) while captures are skipped."""
        pending, self._pending_registration = self._pending_registration, None
        if pending is not None:
            self._adopt(pending)
        if data_bytes <= self._registered_bytes and self._arena is not None:
            return True
        if self._sidecar_ok:
            try:
                self._register(data_bytes, min(self.timeout, 2.0))
                return True
            except (SnapshotdError, OSError, ValueError) as exc:
                self._sidecar_ok = False
                self._problem(f"cannot register with the sidecar: {exc}")
                return False
        now = time.monotonic()
        if now - self._registration_sent > 1.0:
            self._registration_sent = now
            self._channel.send(self._registration(data_bytes))
        return False

    def _map_arena(self, path: str, slot_bytes: int, slots: int) -> Arena:
        if self._arena is not None and self._arena.path == path:
            return self._arena
        self._stager.fence(timeout=self.timeout, host=True)  # the old arena is unmapped below
        old = self._arena
        self._arena = attach_arena(path, slot_bytes, slots)
        self._slot_tensors = [
            torch.frombuffer(self._arena.slot(i), dtype=torch.uint8)
            if slot_bytes
            else torch.empty(0, dtype=torch.uint8)
            for i in range(slots)
        ]
        self._stager.pin(self._arena)
        if old is not None:
            self._stager.unpin(old)
            old.close()
        return self._arena

    def _start(self, step: int, flat: FlatState) -> bool:
        """Stage and announce a snapshot of ``step`` into a free slot (the rank is registered for ``flat``'s size);
        whether one was free."""
        slot = self._take_slot(step)
        if slot is None:
            self.stats.skipped += 1
            gone = self._sidecar_gone()
            if gone or time.monotonic() - self._last_update > self.timeout:
                # every slot busy, and the sidecar's process gone or no word from it for long: it restarted and
                # forgot us, and with it the steps it had seen. Every announce goes out before the registration
                # does; the update after its reply says which slots are free.
                self._problem(
                    f"the sidecar (pid {self._sidecar_pid}) is gone; registering again"
                    if gone
                    else f"no slot update from the sidecar for {self.timeout:.0f} s; registering again"
                )
                self._stager.fence(timeout=self.timeout)
                with self._lock:
                    self._inflight.clear()
                    self._free.clear()
                self._registered_bytes = -1
                self._sidecar_ok = False
                self._last_update = time.monotonic()
            return False
        table = b""
        if not self._table_sent or flat.layout != self._table_layout:
            self._table_id += 1
            table = encode_table(flat.entries)
            self._table_layout = flat.layout
            self._table_sent = True
        announce = Announce(
            job=self.job,
            rank=self.rank,
            step=step,
            slot=slot,
            table_id=self._table_id,
            step_seconds=self._step_seconds,
            skipped=self.stats.skipped,
            steps=tuple(self._steps),
            steps_end=self._steps_end,
            table=table,
            meta=flat.meta,
        )
        self._steps.clear()
        self._last_step = step
        with self._lock:
            self._taken_at[step] = time.monotonic()
            if (
                len(self._taken_at) > 64
            ):  # bounded when no step becomes durable (no buddy, every stream failing)
                del self._taken_at[min(self._taken_at)]
        self._stager.stage(
            flat, self._slot_tensors[slot], self._channel, announce, lambda: self._release(slot)
        )
        self.stats.started += 1
        self.stats.bytes += flat.data_bytes
        return True

    def _take_slot(self, step: int) -> int | None:
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while not self._free:
                if self.when_busy == "skip":
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self._problem(f"no free slot within {self.timeout:.0f} s (is the sidecar streaming?)")
                    return None
                if self._sidecar_gone():
                    return None
                self._lock.wait(min(left, SIDECAR_CHECK_S))
            slot = min(self._free)
            self._free.discard(slot)
            self._inflight[slot] = step
            return slot

    def _sidecar_gone(self) -> bool:
        """Whether the sidecar this rank registered with has exited (known only when its pid is visible here; a
        process started since under the same pid is not it)."""
        started = self._sidecar_started
        pid = self._sidecar_pid
        return started is not None and (not pid_alive(pid) or process_started(pid) != started)

    def _release(self, slot: int) -> None:
        """A staged slot that was never announced (its copy was abandoned) is ours to reuse."""
        with self._lock:
            self._inflight.pop(slot, None)
            self._free.add(slot)
            self._lock.notify_all()

    def _on_message(self, msg: Message) -> None:
        """Channel thread: slot updates and errors about announces."""
        if isinstance(msg, RankRegistered):  # a registration retried in the background was answered
            with (
                self._lock
            ):  # free slots come from the sidecar's update after its reply, not from earlier ones
                self._free.clear()
            self._pending_registration = msg
        elif isinstance(msg, SlotUpdate):
            self._last_update = time.monotonic()
            with self._lock:
                self._updates += 1
                for slot in msg.free_slots:
                    staged = self._inflight.get(slot)
                    if staged is not None and staged > msg.seen_step:
                        continue  # this update predates our announce of that slot
                    self._inflight.pop(slot, None)
                    self._free.add(slot)
                if msg.durable_step > self.stats.last_durable_step:
                    self.stats.durable += 1
                    self.stats.last_durable_step = msg.durable_step
                    taken = self._taken_at.get(msg.durable_step, self._recovery_point[1])
                    self._recovery_point = (msg.durable_step, taken)
                    self._taken_at = {k: t for k, t in self._taken_at.items() if k > msg.durable_step}
                    self._update_rpo()
                if msg.failed_step >= 0:
                    self._taken_at.pop(msg.failed_step, None)  # it will never be durable
                    self.stats.failed += 1
                    self._last_failed_step = max(self._last_failed_step, msg.failed_step)
                    self._problem(msg.note or f"step {msg.failed_step} did not reach every buddy")
                self._lock.notify_all()
        elif isinstance(msg, RestoreProgress):
            display = self._restore_display
            if display is not None:
                display.update(msg)
        elif isinstance(msg, RestoreFetch):
            self._start_fetch(msg)
        elif msg.TYPE == "error":
            text = f"{getattr(msg, 'code', '')}: {getattr(msg, 'message', '')}"
            with self._lock:
                self.stats.failed += 1
                # the sidecar forgot us (it restarted) or lost our table: register and resend on the next capture
                self._registered_bytes = -1
                self._table_sent = False
                self._inflight.clear()
                self._free.clear()
                self._lock.notify_all()
            self._problem(text)

    def _start_fetch(self, msg: RestoreFetch) -> None:
        """Channel thread: fetch what the sidecar asks (:mod:`.fetch`) on a thread of its own while restore()
        waits for its reply, and answer the sidecar, unless :meth:`_stop_fetch` stopped it first. Asked when no
        restore() waits (it ended meanwhile), nothing is fetched: the addresses it named may hold other data now."""
        self._stop_fetch()  # one asked earlier (the sidecar moved on since): never two writing at once
        display = self._restore_display
        with self._fetch_lock:
            live, targets = self._restore_targets
        if not live:
            log.info(
                "[job %s rank %d] the sidecar asked to fetch step %d after the restore ended: ignored",
                self.job,
                self.rank,
                msg.step,
            )
            return
        fetcher = RestoreFetcher(
            msg,
            live,
            targets,
            timeout=self.timeout,
            on_progress=display.advance if display is not None else None,
        )

        def run() -> None:
            answer = fetcher.run()
            if not fetcher.cancelled:
                self._channel.send(answer)

        thread = threading.Thread(target=run, name="snapshotd-restore-fetch", daemon=True)
        with self._fetch_lock:
            if self._restore_targets[0] is not live:  # that restore ended while this was set up
                return
            self._fetching = (fetcher, thread)
            thread.start()

    def _stop_fetch(self, *, ended: bool = False) -> None:
        """Stop the fetch in progress, if any, and wait for it: no byte of it lands after this returns. ``ended``:
        the restore ended, so no fetch starts after this either."""
        with self._fetch_lock:
            running, self._fetching = self._fetching, None
            if ended:
                self._restore_targets = ([], [])
        if running is not None:
            fetcher, thread = running
            fetcher.cancel()
            thread.join(self.timeout)
            if thread.is_alive():
                log.warning(
                    "[job %s rank %d] the restore's fetch did not stop within %.0f s",
                    self.job,
                    self.rank,
                    self.timeout,
                )

    def _update_rpo(self) -> None:
        """``stats.rpo_*`` from the newest step captured and the recovery point (call with the lock held)."""
        step, taken = self._recovery_point
        if self.stats.last_step >= 0:
            self.stats.rpo_steps = max(0, self.stats.last_step - step)
            last = self._taken_at.get(self.stats.last_step, time.monotonic())
            self.stats.rpo_seconds = max(0.0, last - taken) if self.stats.rpo_steps else 0.0

    def _problem(self, text: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = text
        if self._problems.first(text):
            log.warning("[job %s rank %d] snapshot problem: %s", self.job, self.rank, text)
