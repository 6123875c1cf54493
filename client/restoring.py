"""What ``Snapshotter.restore()`` does in the rank's current group: :class:`Restorer`.

A restore registers with the sidecar, asks it for the job's recoverable step and waits for the reply, which comes
once the data is in place: written straight into the live tensors (:mod:`.direct`), fetched by this process from
the holders when the sidecar asks it to (a :class:`~proto.RestoreFetch`, run by :mod:`.fetch` on a thread of its
own), or left in an arena slot to load from (:mod:`.load`). With ``replicated``, the ranks of the replica group
agree that each loaded its part before any of them goes on (:mod:`.replicas`). While it waits, the restore's
progress is drawn (:mod:`.progress`).

Following the job into a newer group (live mode) is :mod:`.recovering`'s: a restore left behind here raises
:class:`LeftBehind`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from typing import Any

import numpy as np

from snapshotd.proto import (
    Message,
    RestoreFetch,
    RestoreProgress,
    RestoreReply,
    RestoreRequest,
    TensorEntry,
    decode_table,
    encode_table,
    match_entries,
)

from .direct import direct_targets, writable_by
from .errors import NotRecoverable, RecoveryFailed, RestoreFailed, SnapshotdError
from .fetch import RestoreFetcher
from .group import LiveGroup
from .load import restore_into
from .progress import RestoreDisplay, restore_display
from .replicas import ReplicaShard, agree_restored, fail_remaining
from .session import SidecarSession
from .state import FlatState, flatten
from .view import SnapshotView, restore_targets

__all__ = ["LeftBehind", "Restorer"]

log = logging.getLogger(__name__)

_LOADING = threading.Lock()
"""One load into live objects at a time in a process: the Snapshotters of the virtual ranks one process carries
restore at once into the same model and optimizer (:mod:`.elastic`), and ``load_state_dict`` is not thread-safe."""


class LeftBehind(RecoveryFailed):
    """Live mode: the job formed a newer group while this rank waited for its restore in the current one."""


class Restorer:
    """Restores of ``view`` through ``session``.

    Args:
        session: the rank's session with its sidecar; its restore messages go to :meth:`on_message`.
        view: the state as snapshots see it.
        group: the replica group of ``replicated`` (None without).
        live: live mode's group (None outside live mode).
    """

    def __init__(
        self, session: SidecarSession, view: SnapshotView, group: Any, live: LiveGroup | None
    ) -> None:
        self._session = session
        self._view = view
        self.replica_group = group
        self.replicated = group is not None  # the group itself is None while recover() forms one
        self._live = live
        self.restored: dict[str, Any] = {}
        """What the last restore did: step, source (fresh/local/pull), bytes_pulled, seconds."""
        self._display: RestoreDisplay | None = None  # while a restore draws its progress
        self._targets: tuple[list[TensorEntry], list[int]] = ([], [])  # what the restore asked for
        self._fetching: tuple[RestoreFetcher, threading.Thread] | None = None  # a fetch the sidecar asked for
        self._fetch_lock = threading.Lock()

    def restore(self, timeout: float) -> int:
        """Restore in the current group (see :meth:`Snapshotter.restore <snapshotd.client.Snapshotter.restore>`).

        Raises:
            LeftBehind: live mode, the job formed a newer group while this rank waited.
        """
        session = self._session
        shards = [v for v in self._view.values() if isinstance(v, ReplicaShard)]
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
            log.info("[job %s rank %d] fresh job: starting at step 0", session.job, session.rank)
            return 0
        arena = session.map_arena(
            reply.arena, reply.slot_bytes, session.arena.slots if session.arena else session.slots
        )
        entries = decode_table(reply.table, reply.slot_bytes)
        # entries paired with a live tensor that had no target went to the slot
        targets = direct_targets(flat)
        placed = {
            i: flat.tensors[j]
            for i, j in match_entries(entries, flat.entries).items()
            if reply.direct and j < len(targets) // 8 and any(targets[8 * j : 8 * j + 8])
        }
        try:
            with _LOADING:
                restore_into(self._view, entries, reply.meta, session.slot_tensors[reply.slot], placed=placed)
        except SnapshotdError:
            fail_remaining(shards)
            raise
        except ValueError as exc:  # the snapshot's own table or meta is malformed
            fail_remaining(shards)
            raise RestoreFailed(
                f"job {session.job!r} rank {session.rank}: step {reply.step} could not be loaded: {exc}"
            ) from exc
        except Exception:
            fail_remaining(shards)
            raise
        session.resume_at(reply.step)
        log.info(
            "[job %s rank %d] restored step %d (%s%s) in %.2f s",
            session.job,
            session.rank,
            reply.step,
            reply.source,
            f", {reply.bytes_pulled / 1e6:.1f} MB pulled" if reply.bytes_pulled else "",
            reply.seconds,
        )
        del arena
        return reply.step

    def replicate_over(self, group: Any) -> None:
        """Make ``group`` the replica group of every ``replicated=`` value (None: no group, between two)."""
        self.replica_group = group
        for value in self._view.values():
            if isinstance(value, ReplicaShard):
                value.group = group

    def _ask_restore(self, timeout: float) -> tuple[FlatState, RestoreReply]:
        """Register, ask the sidecar for the recoverable step and wait for its reply (the data is in place, or
        in the arena slot, when this returns); the live state's restore targets flattened for it."""
        session = self._session
        job, rank = session.job, session.rank
        flat = flatten(restore_targets(self._view))
        session.register(flat.data_bytes, session.timeout)
        seen = session.forget_slots()
        targets = direct_targets(flat)
        with self._fetch_lock:  # a RestoreFetch for this restore may start a fetch from now until it ends
            self._targets = (flat.entries, np.frombuffer(targets, dtype="<u8").tolist())
        display = self._display = restore_display(job, rank)  # None: nothing to draw here
        live = self._live
        epoch = live.epoch if live is not None else -1

        def on_wait() -> None:
            if display is not None:
                display.draw()
            if live is not None and live.left_behind:
                raise LeftBehind(
                    f"job {job!r} rank {rank}: the job opened a newer group while this rank waited for "
                    f"its restore in epoch {epoch}: a member of the group is gone"
                )

        reply: Message | None = None
        try:
            with (
                writable_by(session.sidecar_pid if targets else 0),
                live.step() if live is not None else contextlib.nullcontext(),
            ):
                reply = session.channel.request(
                    RestoreRequest(
                        job=job,
                        rank=rank,
                        world_size=session.world_size,
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
        except LeftBehind:  # the sidecar abandons the restore asked in the old group now, before this rank
            self._stop_fetch(ended=True)  # before the sidecar frees the slot it writes into
            try:  # joins the next: an answer to it, were the round to freeze on its ask, would reach no one
                session.register(flat.data_bytes, session.timeout)
            except SnapshotdError as exc:
                log.warning(
                    "[job %s rank %d] could not register again after leaving the group: %s", job, rank, exc
                )
            raise
        except NotRecoverable as exc:
            raise NotRecoverable(
                f"job {job!r}: no step is recoverable from memory ({exc}). Load your last disk checkpoint and "
                "go on under a new job name: this job's snapshots belong to a run that cannot be resumed."
            ) from exc
        finally:
            self._stop_fetch(
                ended=True
            )  # the reply came after the fetch's answer; on any other end it stops here
            self._display = None
            if display is not None:
                display.finish(reply if isinstance(reply, RestoreReply) else None)
        assert isinstance(reply, RestoreReply)
        session.await_update(seen)  # so that the first capture() finds its free slots
        return flat, reply

    def _agree(self, *, ok: bool, timeout: float) -> None:
        """With ``replicated``: :func:`~.replicas.agree_restored`; a rank's own restore may take its request's
        timeout, plus the wait for its slots, after the others'."""
        if self.replica_group is not None:
            wait = datetime.timedelta(seconds=timeout + self._session.timeout + 10)
            agree_restored(self.replica_group, ok=ok, job=self._session.job, wait=wait)

    # --------------------------------------------------------------------------------- channel thread

    def on_message(self, msg: RestoreProgress | RestoreFetch) -> None:
        """Channel thread: a restore's progress to draw, or a fetch the sidecar asks of this process."""
        if isinstance(msg, RestoreProgress):
            display = self._display
            if display is not None:
                display.update(msg)
        else:
            self._start_fetch(msg)

    def _start_fetch(self, msg: RestoreFetch) -> None:
        """Fetch what the sidecar asks (:mod:`.fetch`) on a thread of its own while the restore waits for its
        reply, and answer the sidecar, unless :meth:`_stop_fetch` stopped it first. Asked when no restore waits (it
        ended meanwhile), nothing is fetched: the addresses it named may hold other data now."""
        session = self._session
        self._stop_fetch()  # one asked earlier (the sidecar moved on since): never two writing at once
        display = self._display
        with self._fetch_lock:
            live, targets = self._targets
        if not live:
            log.info(
                "[job %s rank %d] the sidecar asked to fetch step %d after the restore ended: ignored",
                session.job,
                session.rank,
                msg.step,
            )
            return
        fetcher = RestoreFetcher(
            msg,
            live,
            targets,
            timeout=session.timeout,
            on_progress=display.advance if display is not None else None,
        )

        def run() -> None:
            answer = fetcher.run()
            if not fetcher.cancelled:
                session.channel.send(answer)

        thread = threading.Thread(target=run, name="snapshotd-restore-fetch", daemon=True)
        with self._fetch_lock:
            if self._targets[0] is not live:  # that restore ended while this was set up
                return
            self._fetching = (fetcher, thread)
            thread.start()

    def _stop_fetch(self, *, ended: bool = False) -> None:
        """Stop the fetch in progress, if any, and wait for it: no byte of it lands after this returns. ``ended``:
        the restore ended, so no fetch starts after this either."""
        with self._fetch_lock:
            running, self._fetching = self._fetching, None
            if ended:
                self._targets = ([], [])
        if running is not None:
            fetcher, thread = running
            fetcher.cancel()
            thread.join(self._session.timeout)
            if thread.is_alive():
                log.warning(
                    "[job %s rank %d] the restore's fetch did not stop within %.0f s",
                    self._session.job,
                    self._session.rank,
                    self._session.timeout,
                )

    def close(self) -> None:
        """Stop a fetch in progress for good, and let go of the state."""
        self._stop_fetch(ended=True)
        self._view = SnapshotView({}, {}, {})
