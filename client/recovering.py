"""Live mode's side of a Snapshotter (:mod:`.live`): :class:`LiveRecovery`.

It turns a collective failing for a peer's loss into :class:`~.errors.PeerLost`, brings the job back in this
process after one (a new group, the DDP modules moved onto it, the state rolled back in place by the
:class:`~.restoring.Restorer`), and follows the job into a newer group when a restore was left behind in the old
one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist

from snapshotd.proto import PeerLostReport

from .ddp import DDPBuckets
from .errors import PeerLost
from .group import LiveGroup
from .identity import Identity
from .peers import is_peer_failure
from .rebind import check_rebindable, rebind_ddp
from .restoring import LeftBehind, Restorer
from .session import SidecarSession

__all__ = ["LiveRecovery", "check_ddp", "check_live"]

log = logging.getLogger(__name__)


def check_live(live: LiveGroup, me: Identity, replica_group: Any) -> None:
    """Refuse a live group that is not this rank's, or a ``replica_group`` beside it.

    Raises:
        ValueError: as stated.
    """
    if (live.job, live.rank, live.world_size) != (me.job, me.rank, me.world_size):
        raise ValueError(
            f"live={live!r} is not this Snapshotter's job {me.job!r}, rank {me.rank} of {me.world_size}"
        )
    if replica_group is not None:
        raise ValueError(
            "live mode forms the job's group anew after a loss: replica_group must be the "
            "default group (leave it out)"
        )


def check_ddp(ddp: DDPBuckets | None) -> None:
    """Refuse a DDP module of the state that live mode cannot move onto a new group (:func:`.check_rebindable`).

    Raises:
        ValueError: as stated.
    """
    if ddp is None:
        return
    for where, module in ddp.modules.items():
        check_rebindable(module, f"state[{where!r}]")


class LiveRecovery:
    """Live mode for one Snapshotter; watches ``live`` (:meth:`LiveGroup.watch <.live.LiveGroup.watch>`) until
    :meth:`close`.

    Args:
        live: the job's live group.
        session: the rank's session with its sidecar.
        restorer: restores in the current group.
        state: the user's state; ``ddp`` the layouts of its DDP modules (None without).
    """

    def __init__(
        self,
        live: LiveGroup,
        session: SidecarSession,
        restorer: Restorer,
        state: Mapping[str, Any],
        ddp: DDPBuckets | None,
    ) -> None:
        self._live = live
        self._session = session
        self._restorer = restorer
        self._state = state
        self._ddp = ddp
        self.recovered: dict[str, Any] = {}
        live.watch()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """:meth:`Snapshotter.guard <snapshotd.client.Snapshotter.guard>`."""
        live, session = self._live, self._session
        try:
            with live.step():
                yield
        except Exception as exc:
            if not is_peer_failure(exc) and not live.left_behind:
                raise
            live.leave()  # the peers blocked on this rank fail now, not after the group's timeout
            # the coordinator probes the job's nodes
            session.channel.send(PeerLostReport(job=session.job, rank=session.rank))
            raise PeerLost(
                f"job {session.job!r} rank {session.rank}: a peer of epoch {live.epoch} was lost: "
                f"{str(exc).splitlines()[0][:300]}"
            ) from exc

    def restore(self, timeout: float) -> int:
        """The restore in the current group; one left behind there joins the job's newer group as :meth:`recover`
        does and restores there."""
        try:
            return self._restorer.restore(timeout)
        except LeftBehind:
            log.warning(
                "[job %s rank %d] the job formed a newer group while this rank waited for its restore in "
                "epoch %d: joining it",
                self._session.job,
                self._session.rank,
                self._live.epoch,
            )
            return self.recover(timeout)

    def recover(self, timeout: float) -> int:
        """:meth:`Snapshotter.recover <snapshotd.client.Snapshotter.recover>`; :attr:`recovered` tells how."""
        live, session, restorer = self._live, self._session, self._restorer
        t0 = time.monotonic()
        # the copy in flight reads the tensors the rollback writes
        session.stager.fence(timeout=session.timeout, host=True)
        replicated = restorer.replicated
        for attempt in range(1, live.attempts + 1):
            # the broken group is destroyed once nothing holds it (its gloo loop spins while it lives)
            if self._ddp is not None:
                self._ddp.release()
            if replicated:
                restorer.replicate_over(None)
            live.rejoin()
            t1 = time.monotonic()
            try:
                if replicated:
                    restorer.replicate_over(dist.group.WORLD)
                if self._ddp is not None:
                    self._ddp.rediscover()
                    rebind_ddp(self._ddp.modules, list(self._state))
                t2 = time.monotonic()
                step = restorer.restore(timeout)
                break
            except Exception as exc:  # a member of the new group died too: form the next one
                if not (is_peer_failure(exc) or isinstance(exc, LeftBehind)) or attempt == live.attempts:
                    raise
                log.warning(
                    "[job %s rank %d] a peer was lost again while recovering (epoch %d): %s",
                    session.job,
                    session.rank,
                    live.epoch,
                    str(exc).splitlines()[0][:200],
                )
        self.recovered = {
            "step": step,
            "epoch": live.epoch,
            **live.timings,
            "ddp_s": t2 - t1,
            "restore_s": time.monotonic() - t2,
            "seconds": time.monotonic() - t0,
        }
        log.info(
            "[job %s rank %d] recovered in place at step %d (epoch %d) in %.2f s",
            session.job,
            session.rank,
            step,
            live.epoch,
            self.recovered["seconds"],
        )
        return step

    def close(self) -> None:
        """Stop watching the live group, and let go of the state."""
        self._live.unwatch()
        self._state, self._ddp = {}, None
