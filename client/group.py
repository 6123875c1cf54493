"""The job's process group in live mode, formed anew in epochs: :class:`LiveGroup`.

Membership lives in a rendezvous store off the training nodes, under ``snapshotd/<job>/``. Each group the job
forms is an *epoch* ``E`` with keys of its own (``e<E>/``), so nothing a failed attempt left behind is read by
the next one:

- ``epoch``: the newest epoch opened. A fresh process (the job's start, a replacement, a restarted rank) joins
  it; a survivor whose group failed in epoch ``E`` opens ``E + 1`` (``compare_set``: the first to ask opens
  it, the others find it open) or joins a newer one.
- ``e<E>/rank<R>`` and ``e<E>/arrived`` count the arrivals. The arrival that makes ``arrived`` the world size
  decides the epoch ``full`` (``e<E>/decided``); a rank arriving a second time (a replacement, or a restarted
  rank, finding its earlier incarnation's arrival) decides it ``abandoned`` instead, unless it is decided
  already, and opens the next. The first decision holds, and every member waits for it (``join_timeout``:
  how long survivors wait for a replacement); members of an abandoned epoch open the next.
- Then every member of a full epoch creates the gloo group on the store under ``e<E>/pg``; a member that died
  meanwhile makes the others' creation time out (``timeout``), and they open the next epoch, up to
  ``attempts`` failed creations.

An *elastic* group (``settle=``, for virtual ranks: :mod:`snapshotd.client.elastic`) may form with fewer ranks
than the world. A survivor arriving in an epoch (after a loss, or to let a newcomer in) waits for it to fill, at
most until no rank has arrived for :data:`~.epochs.QUIET_S` (and every member it expects has) or ``settle``
seconds have passed, then decides it with the ranks arrived so far (``members:<ranks>``, :mod:`.epochs`); the first
decision holds, and
a rank that arrives after it opens the next epoch, which the members join at their next step boundary. A fresh
process never decides by settling: it waits for the epoch to fill or for the members to decide.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from .epochs import decide, settle, wait_decision
from .errors import RecoveryFailed
from .peers import open_sockets, shut_connection
from .seat import SEAT_ASK_MIN_S, request_seat
from .watchdog import Watchdog

__all__ = ["LiveGroup"]

log = logging.getLogger(__name__)


class LiveGroup:
    """A job's process group in live mode: the rank's place in it, and how to form the next one.

    Use :func:`~snapshotd.client.live.init_process_group` to make one. ``epoch`` is the epoch of the current
    group; ``timings`` the seconds the last (re)join spent waiting for the membership (``membership_s``) and
    creating the group (``group_s``).
    """

    def __init__(
        self,
        store: dist.TCPStore,
        *,
        job: str,
        rank: int,
        world_size: int,
        backend: str,
        timeout: float,
        join_timeout: float,
        attempts: int,
        seat: tuple[int, str | None] | None = None,
        settle: float | None = None,
    ) -> None:
        if timeout <= 0 or join_timeout <= 0 or attempts < 1 or (settle is not None and settle <= 0):
            raise ValueError("timeout, join_timeout and settle must be > 0, attempts >= 1")
        self.address = (store.host, store.port)  # the watchdog opens a connection of its own there
        self.store = dist.PrefixStore(f"snapshotd/{job}", store)
        self.job, self.rank, self.world_size, self.backend = job, rank, world_size, backend
        self.timeout, self.join_timeout, self.attempts = timeout, join_timeout, attempts
        self.seat = seat  # (nodes, sidecar) when snapshotd seated this node (init_process_group's nodes=)
        self.settle = settle  # elastic: the longest a survivor waits for an epoch to fill before deciding it
        self.epoch = -1
        self.members: tuple[int, ...] = ()  # the job ranks in the current group, in group rank order
        self.timings: dict[str, float] = {}
        self.left_behind = False  # the watchdog left the group: the job formed a newer one while a step hung
        self._links: dict[int, str] = {}  # the current group's connections: fd -> its socket's /proc link
        # held over changes of the group (epoch, links), of the step running, and the watchdog's check and leave
        self._lock = threading.Lock()
        self._step_since: float | None = None  # when the guarded step running now began (monotonic)
        self._watchdog: Watchdog | None = None

    @property
    def group_rank(self) -> int:
        """This process's rank in the current group (its job rank unless the group is elastic and shrunk)."""
        return self.members.index(self.rank)

    @property
    def newest_epoch(self) -> int:
        """The newest epoch the job opened (a store read): newer than :attr:`epoch` when a rank waits to join."""
        return int(self.store.get("epoch"))

    def __repr__(self) -> str:
        return (
            f"LiveGroup(job={self.job!r}, rank={self.rank}, world_size={self.world_size}, epoch={self.epoch})"
        )

    def join(self) -> None:
        """Form the job's group as a fresh process (the job's start, a replacement, a restarted rank).

        ``torch._dynamo`` is imported first (DDP's constructor imports it anyway): importing it while a group
        exists keeps that group alive for good (torch 2.13), and a survivor must be able to destroy its broken
        group (see :meth:`DDPBuckets.release <snapshotd.client.ddp.DDPBuckets.release>`).
        """
        import torch._dynamo  # noqa: F401

        self._form(int(self.store.compare_set("epoch", "", "0")))

    def leave(self) -> None:
        """Shut this rank's connections of the current group (its listener stays open, as gloo needs it).

        A peer blocked in a collective waiting on this rank (not on the rank that died) would otherwise wait for
        the group's ``timeout``: gloo closes its connections neither on an error nor before the group object is
        gone (``recover()`` drops DDP's hold on it only then), and a collective in flight cannot be aborted. Shut, the peer's collective fails at once ("Connection
        closed by peer"), and it leaves too. The connections are those the process opened while the group formed
        (TCP, Linux ``/proc``; elsewhere nothing is shut). Idempotent; :meth:`rejoin` calls it first.
        """
        with self._lock:
            self._leave()

    def _leave(self) -> None:
        """:meth:`leave`, with ``_lock`` held."""
        links, self._links = self._links, {}
        for fd, link in links.items():
            shut_connection(fd, link)

    def rejoin(self) -> None:
        """Leave the current (broken) group and form the next one with the job's new membership.

        A seated node (``nodes=``) first asks for its seat again: if the coordinator gave it to another node
        meanwhile (this node was declared dead while it hung or was cut off, and a spare or replacement took its
        place), this process must not join: :class:`~snapshotd.client.RecoveryFailed` says so.
        The seat request and the membership share one deadline, ``join_timeout`` from now.

        Raises:
            RecoveryFailed: the seat was given to another node; the membership did not fill, or no group formed,
                before the deadline.
            SnapshotdError: the seat request failed (the sidecar or coordinator refused it, or did not answer).
        """
        deadline = time.monotonic() + self.join_timeout
        self.leave()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.seat is not None:
            nodes, sidecar = self.seat
            rank, _ = request_seat(self.job, nodes, sidecar, max(SEAT_ASK_MIN_S, deadline - time.monotonic()))
            if rank != self.rank:
                raise RecoveryFailed(
                    f"job {self.job!r}: this node's seat now gives rank {rank}, not this process's "
                    f"rank {self.rank}"
                )
        self._form(self._next(self.epoch), deadline, settling=True)

    def grow(self, on_members: Callable[[tuple[int, ...]], None] | None = None) -> None:
        """Leave the current (healthy) group for the job's newest epoch, which a newcomer opened, and form it with
        every current member and whoever else arrives (elastic groups; every member calls it at the same step
        boundary; :mod:`.epochs`).
        ``on_members(members)`` runs once the membership is decided, before the group forms.

        Raises:
            RecoveryFailed, SnapshotdError: as for :meth:`rejoin`.
        """
        if self.settle is None:
            raise ValueError("grow() is for elastic groups (settle=)")
        deadline = time.monotonic() + self.join_timeout
        self.leave()
        if dist.is_initialized():
            dist.destroy_process_group()
        current = self.members  # every member grows at this step boundary: the epoch waits for each of them
        self._form(
            max(self.newest_epoch, self.epoch + 1),
            deadline,
            settling=True,
            on_members=on_members,
            expect=current,
        )

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark a training step (the block :meth:`Snapshotter.guard <snapshotd.client.Snapshotter.guard>` runs) for
        the watchdog (see :meth:`watch`)."""
        with self._lock:
            self._step_since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._step_since = None

    def watch(self) -> None:
        r"""Start the watchdog thread (idempotent; a :class:`~snapshotd.client.watchdog.Watchdog`): while a step
        has run for more than :data:`~snapshotd.client.watchdog.HANG_CHECK_S`, it reads the job's newest epoch
        from the store every :data:`~snapshotd.client.watchdog.HANG_CHECK_S`, on a connection of its own (opened
        then, and again after it failed).

        A newer epoch than this rank's group means the job is forming its next group: a rank arrived whose
        earlier incarnation was a member (a replacement or spare for a node the coordinator declared dead, which
        hung or was cut off), or a survivor opened it. This rank's collective, blocked on a member that will not
        answer, would otherwise wait for the group's ``timeout``; the watchdog :meth:`leave`\ s the group
        instead, the collective fails at once (gloo: its connections are shut), and ``guard()`` raises
        ``PeerLost`` (:attr:`left_behind` is set).
        """
        if self._watchdog is not None:
            return
        self._watchdog = Watchdog(self)
        self._watchdog.start()

    def unwatch(self, timeout: float = 5.0) -> None:
        """Stop the watchdog thread (idempotent), waiting up to ``timeout`` seconds for it (a thread still
        blocked reading the store then ends, a daemon, within the store's timeout)."""
        if self._watchdog is None:
            return
        self._watchdog.stop(timeout)
        self._watchdog = None

    def running_step(self) -> tuple[float | None, int]:
        """When the guarded step running now began (monotonic; None while none runs), and the current epoch:
        what the watchdog reads."""
        return self._step_since, self.epoch

    def leave_hung(self, since: float, epoch: int, newest: int) -> None:
        """Leave the group for the watchdog, which saw the job open epoch ``newest`` while the step begun at
        ``since`` (monotonic) ran in ``epoch``: :meth:`leave` and set :attr:`left_behind`, unless that step has
        ended, the group changed meanwhile, or ``newest`` is no newer than ``epoch`` (then nothing happens)."""
        with self._lock:
            if newest <= epoch or self._step_since != since or self.epoch != epoch:
                return
            log.warning(
                "[job %s rank %d] a step of epoch %d has run %.1f s and the job opened epoch %d: a "
                "member hung and is being replaced; leaving the group",
                self.job,
                self.rank,
                epoch,
                time.monotonic() - since,
                newest,
            )
            self.left_behind = True
            self._leave()

    def _open_after(self, failed: int) -> int:
        """Open the epoch after ``failed`` (or find it, or a newer one, opened by another rank)."""
        return int(self.store.compare_set("epoch", str(failed), str(failed + 1)))

    def _decide(self, epoch: int, outcome: str) -> str:
        """Decide ``epoch`` ``full`` or ``abandoned``, unless it is decided already; the decision that holds."""
        return decide(self.store, epoch, outcome)

    def _form(
        self,
        epoch: int,
        deadline: float | None = None,
        settling: bool = False,
        on_members: Callable[[tuple[int, ...]], None] | None = None,
        expect: tuple[int, ...] = (),
    ) -> None:
        """Form the group of ``epoch`` or a later one, by ``deadline`` (monotonic; default ``join_timeout`` from
        now); ``settling``: a survivor of an elastic group, which decides an epoch that did not fill within
        ``settle`` (and waits for the ranks of ``expect`` until then); ``on_members``: called with the members of
        the epoch that forms, before it does.

        Raises:
            RecoveryFailed: as :meth:`rejoin`; a settling survivor arrived after its epoch was decided without it.
        """
        t0 = time.monotonic()
        deadline = t0 + self.join_timeout if deadline is None else deadline
        first = epoch
        problems: list[str] = []
        failures = 0
        while failures < self.attempts:
            if time.monotonic() > deadline:
                seat = " (the seat request took the time)" if self.seat is not None and epoch == first else ""
                problems.append(f"the deadline passed before this rank arrived in epoch {epoch}{seat}")
                break
            if not self._arrive(epoch):
                epoch = self._next(epoch)
                continue
            t1 = time.monotonic()
            if settling and self.settle is not None:
                settle(
                    self.store, epoch, self.world_size, min(deadline, time.monotonic() + self.settle), expect
                )
            members = wait_decision(
                self.store, epoch, self.world_size, deadline, f"job {self.job!r} rank {self.rank}"
            )
            if members and self.rank not in members and settling:
                # decided without this survivor, which arrived late: the others carry its work now, and it must
                # not form a group of its own beside theirs
                raise RecoveryFailed(
                    f"job {self.job!r} rank {self.rank}: epoch {epoch} formed without this process, which arrived "
                    "after its members decided it; restart it to join as a new process"
                )
            if (
                self.rank not in members
            ):  # abandoned (a rank came back in it), or decided before a fresh process
                epoch = self._next(epoch)
                continue
            if on_members is not None:
                on_members(members)
            t2 = time.monotonic()
            before = set(open_sockets().values())
            try:
                dist.init_process_group(
                    self.backend,
                    store=dist.PrefixStore(f"e{epoch}/pg", self.store),
                    rank=members.index(self.rank),
                    world_size=len(members),
                    timeout=datetime.timedelta(seconds=self.timeout),
                )
            except (RuntimeError, dist.DistError) as exc:  # a member died while the group formed
                failures += 1
                problems.append(f"epoch {epoch}: {str(exc).splitlines()[0][:200]}")
                log.warning("[job %s rank %d] epoch %d did not form: %s", self.job, self.rank, epoch, exc)
                _forget_failed_group()
                epoch = self._next(epoch)
                continue
            with self._lock:
                self._links = {fd: link for fd, link in open_sockets().items() if link not in before}
                self.epoch, self.members, self.left_behind = epoch, members, False
            self.timings = {
                "membership_s": t2 - t0,
                "group_s": time.monotonic() - t2,
                "arrival_wait_s": t2 - t1,
            }
            log.info(
                "[job %s rank %d] process group of epoch %d formed (%d of %d ranks)",
                self.job,
                self.rank,
                epoch,
                len(members),
                self.world_size,
            )
            return
        why = "; ".join(problems) or "every epoch tried was abandoned (a rank arrived twice)"
        raise RecoveryFailed(
            f"job {self.job!r} rank {self.rank}: no process group formed within "
            f"{self.join_timeout:.0f} s and {self.attempts} attempts: {why}"
        )

    def _next(self, failed: int) -> int:
        """:meth:`_open_after`, checked: the epoch after ``failed`` or a newer one.

        Raises:
            RecoveryFailed: the store did not move past ``failed`` (it lost the job's keys: restarted?).
        """
        epoch = self._open_after(failed)
        if epoch <= failed:
            raise RecoveryFailed(
                f"job {self.job!r} rank {self.rank}: the rendezvous store did not open the epoch "
                f"after {failed} (its newest is {epoch}); was it restarted?"
            )
        return epoch

    def _arrive(self, epoch: int) -> bool:
        """Count this rank into ``epoch``; False if the epoch cannot form with it (this rank arrived there
        before, so that earlier arrival was an incarnation now gone): the epoch is then abandoned, unless it
        was already full (its members find out when the group cannot form)."""
        if self.store.add(f"e{epoch}/rank{self.rank}", 1) > 1:
            self._decide(epoch, "abandoned")
            return False
        if self.store.add(f"e{epoch}/arrived", 1) == self.world_size:
            self._decide(epoch, "full")
        return True


def _forget_failed_group() -> None:
    """Undo what a failed ``init_process_group`` left: the default group, or torch's count of groups named.

    torch names the default group by a per-process count (``_world.group_count``, reset to 0 only by
    ``destroy_process_group``) and keys its store rendezvous by that name, so a process whose attempt failed
    before the group existed would otherwise look for its peers under another name than a fresh process does.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._world.group_count = 0
