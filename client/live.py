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
``examples/torchrun_ddp/rdzv_store.py``; ``$SNAPSHOTD_STORE`` is its ``host:port``), under ``snapshotd/<job>/``.
Each group the job forms is an *epoch* ``E`` with keys of its own (``e<E>/``), so nothing a failed attempt left
behind is read by the next one:

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

:func:`rebind_ddp` does what a survivor's DDP module needs in the new group: the reducer rebuilt for the new
group, and the collectives that the replacement's ``DistributedDataParallel(...)`` constructor runs (its
parameter shape check and the broadcast of the module's state from rank 0) run here too, so that both sides
issue the same collectives. The restore that follows overwrites whatever the broadcast brought. The code a
replacement runs between :func:`init_process_group` and ``restore()`` must therefore run no collective other
than DDP's constructor (with ``init_sync=True``, the default), one DDP module per state value, in the order of
the state.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from snapshotd.proto import SeatReply, SeatRequest

from .channel import Channel
from .ddp import rebuild_reducer
from .errors import RecoveryFailed
from .identity import Identity

__all__ = [
    "HANG_CHECK_S",
    "LiveGroup",
    "STORE_ENV",
    "check_rebindable",
    "init_process_group",
    "is_peer_failure",
    "rebind_ddp",
]

log = logging.getLogger(__name__)

STORE_ENV = "SNAPSHOTD_STORE"
"""The environment variable naming the rendezvous store, ``host:port``."""

SEAT_ASK_S = 10.0
"""How long the sidecar asks the coordinator for a seat on one request of a rank (which asks again until its own
deadline)."""

HANG_CHECK_S = 1.0
"""How long a guarded step runs before the watchdog starts looking for a newer epoch, and how often it looks
then (see :meth:`LiveGroup.watch`)."""

SEAT_ASK_MIN_S = 0.5
"""The shortest seat request a rank sends: with less time left before its deadline it stops asking (a request of a
few milliseconds would time out at the sidecar before the coordinator could answer it)."""

_TRANSPORT_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone or hung: a ``torch.distributed.DistError``,
    or the ``RuntimeError`` gloo raises from its transport (a connection closed or reset, a wait timed out).

    gloo (torch 2.13) raises a plain ``RuntimeError`` for a peer's loss, whose text names its transport's source
    file (``gloo/transport/tcp/pair.cc: ... Connection reset by peer``, ``.../unbound_buffer.cc: Timed out
    waiting ...``); no exception type sets it apart from a bug in the step, so the text is what is matched."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _TRANSPORT_MARKERS)


class LiveGroup:
    """A job's process group in live mode: the rank's place in it, and how to form the next one.

    Use :func:`init_process_group` to make one. ``epoch`` is the epoch of the current group; ``timings`` the
    seconds the last (re)join spent waiting for the membership (``membership_s``) and creating the group
    (``group_s``).
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
    ) -> None:
        if timeout <= 0 or join_timeout <= 0 or attempts < 1:
            raise ValueError("timeout and join_timeout must be > 0, attempts >= 1")
        self._address = (store.host, store.port)  # the watchdog opens a connection of its own there
        self.store = dist.PrefixStore(f"snapshotd/{job}", store)
        self.job, self.rank, self.world_size, self.backend = job, rank, world_size, backend
        self.timeout, self.join_timeout, self.attempts = timeout, join_timeout, attempts
        self.seat = seat  # (nodes, sidecar) when snapshotd seated this node (init_process_group's nodes=)
        self.epoch = -1
        self.timings: dict[str, float] = {}
        self.left_behind = False  # the watchdog left the group: the job formed a newer one while a step hung
        self._links: dict[int, str] = {}  # the current group's connections: fd -> its socket's /proc link
        # held over changes of the group (epoch, links), of the step running, and the watchdog's check and leave
        self._lock = threading.Lock()
        self._step_since: float | None = None  # when the guarded step running now began (monotonic)
        self._watching: threading.Event | None = None  # set to stop the watchdog
        self._watchdog: threading.Thread | None = None

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
            _shut(fd, link)

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
            rank, _ = _seat(self.job, nodes, sidecar, max(SEAT_ASK_MIN_S, deadline - time.monotonic()))
            if rank != self.rank:
                raise RecoveryFailed(
                    f"job {self.job!r}: this node's seat now gives rank {rank}, not this process's "
                    f"rank {self.rank}"
                )
        self._form(self._next(self.epoch), deadline)

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
        r"""Start the watchdog thread (idempotent): while a step has run for more than :data:`HANG_CHECK_S`, it
        reads the job's newest epoch from the store every :data:`HANG_CHECK_S`, on a connection of its own (opened
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
        self._watching = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch,
            args=(self._watching,),
            daemon=True,
            name=f"snapshotd-live-watchdog-{self.rank}",
        )
        self._watchdog.start()

    def unwatch(self, timeout: float = 5.0) -> None:
        """Stop the watchdog thread (idempotent), waiting up to ``timeout`` seconds for it (a thread still
        blocked reading the store then ends, a daemon, within the store's timeout)."""
        if self._watchdog is None or self._watching is None:
            return
        self._watching.set()
        self._watchdog.join(timeout)
        self._watchdog = self._watching = None

    def _watch(self, stop: threading.Event) -> None:
        store: dist.Store | None = None
        while not stop.wait(HANG_CHECK_S):
            since, epoch = self._step_since, self.epoch
            if since is None or epoch < 0 or time.monotonic() - since < HANG_CHECK_S:
                continue
            try:
                if store is None:
                    host, port = self._address
                    store = dist.PrefixStore(
                        f"snapshotd/{self.job}",
                        dist.TCPStore(
                            host,
                            port,
                            is_master=False,
                            wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=max(HANG_CHECK_S, 5.0)),
                        ),
                    )
                newest = int(store.get("epoch"))
            except Exception as exc:  # the store is away: the group's timeout still ends a hung collective
                log.debug("[job %s rank %d] watchdog: cannot read the store: %s", self.job, self.rank, exc)
                store = None
                continue
            with self._lock:
                if newest <= epoch or self._step_since != since or self.epoch != epoch or stop.is_set():
                    continue
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
        return self.store.compare_set(f"e{epoch}/decided", "", outcome).decode()

    def _form(self, epoch: int, deadline: float | None = None) -> None:
        """Form the group of ``epoch`` or a later one, by ``deadline`` (monotonic; default ``join_timeout`` from
        now)."""
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
            try:
                self.store.wait([f"e{epoch}/decided"], datetime.timedelta(seconds=max(0.001, deadline - t1)))
            except dist.DistError:
                raise RecoveryFailed(
                    f"job {self.job!r} rank {self.rank}: only {int(self.store.add(f'e{epoch}/arrived', 0))} of "
                    f"{self.world_size} ranks joined epoch {epoch} within {self.join_timeout:.0f} s (is the "
                    "replacement node started?)"
                ) from None
            if self.store.get(f"e{epoch}/decided") != b"full":  # a rank came back in it: its old self is gone
                epoch = self._next(epoch)
                continue
            t2 = time.monotonic()
            before = set(_sockets().values())
            try:
                dist.init_process_group(
                    self.backend,
                    store=dist.PrefixStore(f"e{epoch}/pg", self.store),
                    rank=self.rank,
                    world_size=self.world_size,
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
                self._links = {fd: link for fd, link in _sockets().items() if link not in before}
                self.epoch, self.left_behind = epoch, False
            self.timings = {
                "membership_s": t2 - t0,
                "group_s": time.monotonic() - t2,
                "arrival_wait_s": t2 - t1,
            }
            log.info(
                "[job %s rank %d] process group of epoch %d formed (%d ranks)",
                self.job,
                self.rank,
                epoch,
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


def _sockets() -> dict[int, str]:
    """This process's sockets: fd -> its ``/proc/self/fd`` link (``socket:[inode]``); empty without ``/proc``."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                out[int(fd)] = link
    return out


def _shut(fd: int, link: str) -> None:
    """``shutdown()`` the TCP connection at ``fd`` if it is still the socket ``link`` names and not a listener."""
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        try:
            if f"socket:[{os.fstat(dup).st_ino}]" != link:
                return  # closed, and the number reused
            sock = socket.socket(fileno=dup)
            dup = -1  # the socket owns it now
        finally:
            if dup >= 0:
                os.close(dup)
        with sock:
            inet = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            if inet and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)


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

    Raises:
        ValueError: no store, or a malformed one; missing job, rank or world size; ``nodes`` with ``rank`` or
            ``world_size``, or without ``$LOCAL_RANK`` and ``$LOCAL_WORLD_SIZE``.
        RecoveryFailed: no seat came free within ``join_timeout``, or this node's seat was given to another node
            (it was declared dead: hung, or cut off); the membership did not fill within
            ``join_timeout``, or no group formed.
        SnapshotdError: the seat request failed (the sidecar or coordinator refused it, or did not answer).
    """
    if timeout <= 0 or join_timeout <= 0 or attempts < 1:  # before connecting; LiveGroup checks them too
        raise ValueError("timeout and join_timeout must be > 0, attempts >= 1")
    seat = None
    if nodes is not None:
        if rank is not None or world_size is not None:
            raise ValueError("give nodes= (snapshotd places the ranks) or rank= and world_size=, not both")
        rank, world_size = _seat(job, nodes, sidecar, join_timeout)
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
    )
    group.join()
    return group


def _seat(job: str | None, nodes: int, sidecar: str | None, timeout: float) -> tuple[int, int]:
    """This process's rank and the world size, from the seat the coordinator gives this node (see
    :func:`init_process_group`).

    Raises:
        ValueError: ``nodes`` < 1, ``$LOCAL_RANK`` or ``$LOCAL_WORLD_SIZE`` missing or inconsistent.
        RecoveryFailed: every seat stayed held by a live node for ``timeout`` seconds; the seat this node had was
            given to another node (``taken``: this node was declared dead meanwhile).
        SnapshotdError: the sidecar or coordinator refused the request or did not answer.
    """
    local_rank, per_node = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local_rank.isdigit() or not per_node.isdigit() or not 0 <= int(local_rank) < int(per_node):
        raise ValueError(
            "nodes= needs $LOCAL_RANK and $LOCAL_WORLD_SIZE (torchrun sets them), got "
            f"{local_rank!r} and {per_node!r}"
        )
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    world_size = nodes * int(per_node)
    me = Identity.resolve(
        job, 0, world_size, sidecar
    )  # the job's name and the sidecar; the rank comes from the seat
    deadline = time.monotonic() + timeout
    channel = Channel(me.sidecar, lambda msg: None)
    try:
        while True:  # short requests: a sidecar whose rank died stops asking within SEAT_ASK_S
            left = max(SEAT_ASK_MIN_S, min(SEAT_ASK_S, deadline - time.monotonic()))
            ask = SeatRequest(job=me.job, world_size=world_size, per_node=int(per_node), timeout_s=left)
            reply = channel.request(ask, SeatReply.TYPE, left + 10.0)
            assert isinstance(reply, SeatReply)
            if reply.status != "wait" or deadline - time.monotonic() < SEAT_ASK_MIN_S:
                break
    finally:
        channel.close()
    if reply.status == "taken":
        raise RecoveryFailed(f"job {me.job!r}: {reply.reason}")
    if reply.status != "given":
        raise RecoveryFailed(f"job {me.job!r}: no seat for this node within {timeout:.0f} s: {reply.reason}")
    rank = reply.first + int(local_rank)
    log.info(
        "[job %s] this node has seat %d: ranks %d-%d; this process is rank %d",
        me.job,
        reply.first // int(per_node),
        reply.first,
        reply.first + int(per_node) - 1,
        rank,
    )
    return rank, world_size


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
