"""``snapshotd export``: one complete step, from the sidecars' memory into a torch.distributed.checkpoint (DCP).

The exporter is a client of the job's daemons and stops nothing: it asks the coordinator which live nodes hold
the step of each rank (:class:`~snapshotd.proto.HoldersQuery`; by default the newest durable step D, or the
recoverable step G while no step is durable, as after a node's loss until re-replication), pulls the
snapshots it needs from those holders as a restoring sidecar does (:func:`~snapshotd.sidecar.transfer.pull_snapshot`:
every chunk checked against the seal its holder carries, the table and meta against their digest), decodes each
with the client's format code (:func:`~snapshotd.client.load.decode_meta`) and writes the state through DCP's own
planner and storage writer (``dcp.save(..., no_dist=True)``), so that it loads at any world size, into the same
kind of mapping the job gave its ``Snapshotter`` (the model wrapped as it was then: a DDP wrapper's keys start
with ``module.``)::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": model, "optim": optim, "sched": sched, "loop": loop}   # built as the job built them
    get_optimizer_state_dict(model, optim)   # an optimizer that has not stepped gets its moments (lr 0 step)
    dcp.load(state, checkpoint_id=DIR)       # DCP calls state_dict() / load_state_dict() on Statefuls

What the checkpoint holds, per top-level key of the ``Snapshotter``'s state: a Stateful value's ``state_dict()``,
a plain value as it is; snapshotd's own keys (DDP bucket layouts) are left out.

- A DTensor (FSDP2) is written as its global tensor, assembled from every rank's shard at the global offset the
  snapshot recorded (format 2; a format 1 snapshot lacks it and is refused), so that DCP reshards it on load.
- Any other tensor and every other value is replicated in DCP's sense: rank 0's is written.
- A tensor that ``replicated=`` had one rank keep (:mod:`snapshotd.client.replicas`) is taken from that rank.

So rank 0's snapshot is always pulled, then only the ranks still needed: the keepers of replicated tensors first,
and every rank when the state holds DTensors. Up to ``parallel`` pulls run at once, each snapshot decoded and
merged (in a worker thread) as it arrives and then dropped: the exporter holds the checkpoint, plus at most
``parallel`` snapshots. The checkpoint goes to a sibling directory first and is renamed to ``out`` when complete.

Sidecars drop a step's copies once D has moved past it. If that happens while exporting (a pull finds no holder
left) and no step was named, the export starts again at the newer D, up to :data:`ATTEMPTS` times.

Errors: everything the user can act on is an :class:`ExportError` with one line saying what is wrong (an unknown
job, no complete step, a step not held for some ranks, a snapshot from a build that did not record DTensor
layouts, a pull that failed, an output directory that is not empty).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from snapshotd.proto import (
    Error,
    ErrorCode,
    HoldersQuery,
    HoldersReply,
    StreamBegin,
    TensorEntry,
    decode,
    decode_table,
    encode,
)
from snapshotd.proto.limits import MAX_PLAN_RANKS
from snapshotd.sidecar.node import Counters
from snapshotd.sidecar.peers import PeerLinks
from snapshotd.sidecar.placement import Lander, arena_sink
from snapshotd.sidecar.pull import PullFailed, pull_snapshot
from snapshotd.sidecar.tasks import TaskTree
from snapshotd.snapshot_format import (
    DDP_KEY,
    ELIDED,
    TORCH_DTYPES,
    TensorRef,
    check_table,
    decode_meta,
    where,
)
from snapshotd.transport import Network, Role, Security, open_network

__all__ = ["ATTEMPTS", "ExportError", "Exported", "export_checkpoint"]

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Exports of a newer durable step tried when the one being exported is collected meanwhile."""

Path = tuple[Any, ...]


class ExportError(RuntimeError):
    """The export cannot be done; the message says why in one line."""


@dataclasses.dataclass(frozen=True, slots=True)
class Exported:
    """What :func:`export_checkpoint` wrote."""

    job: str
    step: int
    world_size: int
    pulled: list[int]
    """The ranks whose snapshots were pulled (rank 0 first)."""
    pulled_bytes: int
    """Tensor bytes of those snapshots."""
    out: str


@dataclasses.dataclass(slots=True)
class _Snapshot:
    rank: int
    entries: list[TensorEntry]
    meta: bytes | memoryview
    data: torch.Tensor


class _Sharded:
    """A DTensor's global tensor being filled from the ranks' shards."""

    __slots__ = ("boxes", "covered", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.boxes: set[tuple[int, ...]] = set()
        self.covered = 0

    def add(self, shard: torch.Tensor, offset: tuple[int, ...]) -> None:
        if offset in self.boxes or not shard.numel():
            return  # a replica of a shard already in (a Replicate dimension of the mesh), or an empty one
        self.boxes.add(offset)
        self.covered += shard.numel()
        self.tensor[tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))].copy_(shard)

    @property
    def complete(self) -> bool:
        return self.covered >= self.tensor.numel()


class _Elided:
    """A tensor of a ``replicated=`` value that another rank kept: filled from the first snapshot holding it."""

    __slots__ = ("keeper", "tensor")

    def __init__(self, keeper: int, tensor: torch.Tensor) -> None:
        self.keeper = keeper
        self.tensor = tensor


class _Assembly:
    """The checkpoint's state dict, built from rank 0's snapshot and completed from the others'.

    ``pending`` maps the path of every tensor rank 0's snapshot cannot give whole (a DTensor not yet covered by
    the shards merged so far, a tensor another rank kept) to what fills it. :meth:`add` may run in several
    threads at once.
    """

    def __init__(self, job: str, step: int) -> None:
        self.what = f"job {job!r} step {step}"
        self.state: dict[str, Any] = {}
        self.pending: dict[Path, _Sharded | _Elided] = {}
        self.lock = threading.Lock()

    def keepers(self) -> list[int]:
        return sorted({p.keeper for p in self.pending.values() if isinstance(p, _Elided)})

    def sharded(self) -> bool:
        return any(isinstance(p, _Sharded) for p in self.pending.values())

    def first(self, snap: _Snapshot) -> None:
        """Build the state dict from rank 0's snapshot."""
        version, top = self._decode(snap)
        for key, (_, tree) in top.items():
            if key == DDP_KEY:
                continue
            self.state[key] = self._build(tree, (key,), snap, version)
        self.pending = {k: v for k, v in self.pending.items() if not (isinstance(v, _Sharded) and v.complete)}

    def add(self, snap: _Snapshot) -> None:
        """Fill what is pending from another rank's snapshot."""
        version, top = self._decode(snap)
        with self.lock:
            for keys, leaf in _leaves({k: t for k, (_, t) in top.items() if k != DDP_KEY}, ()):
                slot = self.pending.get(keys)
                if slot is None:
                    continue
                if isinstance(slot, _Sharded):
                    if isinstance(leaf, TensorRef) and leaf.dtensor:
                        shape, offset = self._place(leaf, keys, snap, version)
                        if shape != tuple(slot.tensor.shape):
                            raise ExportError(
                                f"{self.what}: {where(keys)} is a DTensor of global shape {list(shape)} "
                                f"on rank {snap.rank}, {list(slot.tensor.shape)} on rank 0"
                            )
                        slot.add(self._tensor(leaf, keys, snap), offset)
                        if slot.complete:
                            del self.pending[keys]
                elif isinstance(leaf, TensorRef) and not leaf.dtensor:
                    src = self._tensor(leaf, keys, snap)
                    if src.dtype == slot.tensor.dtype and src.shape == slot.tensor.shape:
                        slot.tensor.copy_(src)
                        del self.pending[keys]

    def check_complete(self) -> None:
        """Raise ExportError naming a tensor that no pulled snapshot gave whole."""
        if not self.pending:
            return
        keys, slot = next(iter(self.pending.items()))
        if isinstance(slot, _Sharded):
            raise ExportError(
                f"{self.what}: the ranks' shards of the DTensor {where(keys)} cover "
                f"{slot.covered} of its {slot.tensor.numel()} elements"
            )
        raise ExportError(
            f"{self.what}: no rank's snapshot holds {where(keys)}, which rank {slot.keeper} of the "
            "replica group kept (a replica_group other than the whole world?)"
        )

    def _decode(self, snap: _Snapshot) -> tuple[int, dict[str, list[Any]]]:
        try:
            check_table(snap.entries, snap.data)
            return decode_meta(snap.meta, len(snap.entries))
        except ValueError as exc:
            raise ExportError(
                f"{self.what}: the snapshot of rank {snap.rank} does not decode: {exc}"
            ) from exc

    def _tensor(self, ref: TensorRef, keys: Path, snap: _Snapshot) -> torch.Tensor:
        """The bytes of ``ref`` as a tensor of its own (the snapshot's buffer is dropped after merging)."""
        e = snap.entries[ref.index]
        if e.path != "/".join(map(str, keys)):
            raise ExportError(
                f"{self.what}: the snapshot of rank {snap.rank} names {e.path!r} at {where(keys)}: "
                "its table and meta do not match"
            )
        dtype = TORCH_DTYPES[e.dtype]
        if not e.nbytes:
            return torch.empty(e.shape, dtype=dtype)
        return snap.data[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape).clone()

    def _place(
        self, ref: TensorRef, keys: Path, snap: _Snapshot, version: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if version < 2:
            raise ExportError(
                f"{self.what}: the snapshot of rank {snap.rank} is of format {version}, which does not "
                f"record where a DTensor's shard lies in the global tensor ({where(keys)}); snapshots "
                "taken by this build of the client can be exported"
            )
        if ref.place is None:
            raise ExportError(
                f"{self.what}: {where(keys)} on rank {snap.rank} is a DTensor shard with no place in "
                "the global tensor (a Partial placement, or a layout snapshotd cannot place)"
            )
        shape, offset = ref.place
        local = snap.entries[ref.index].shape
        if len(local) != len(shape) or any(o + n > g for o, n, g in zip(offset, local, shape, strict=True)):
            raise ExportError(
                f"{self.what}: {where(keys)} on rank {snap.rank}: a shard {list(local)} at offset "
                f"{list(offset)} does not fit the global shape {list(shape)}"
            )
        return shape, offset

    def _build(self, node: Any, keys: Path, snap: _Snapshot, version: int) -> Any:
        t = type(node)
        if t is TensorRef:
            if not node.dtensor:
                return self._tensor(node, keys, snap)
            shape, offset = self._place(node, keys, snap, version)
            dtype = TORCH_DTYPES[snap.entries[node.index].dtype]
            sharded = _Sharded(torch.zeros(shape, dtype=dtype))
            sharded.add(self._tensor(node, keys, snap), offset)
            self.pending[keys] = sharded
            return sharded.tensor
        if t is dict and ELIDED in node:
            keeper, dtype_name, dims = _marker(node, keys, self.what)
            elided = _Elided(keeper, torch.empty(dims, dtype=TORCH_DTYPES[dtype_name]))
            self.pending[keys] = elided
            return elided.tensor
        if t is dict or t is collections.OrderedDict:
            return t((k, self._build(v, (*keys, k), snap, version)) for k, v in node.items())
        if t is list:
            return [self._build(v, (*keys, i), snap, version) for i, v in enumerate(node)]
        if t is tuple:
            return tuple(self._build(v, (*keys, i), snap, version) for i, v in enumerate(node))
        return node


def _leaves(node: Any, keys: Path) -> Iterator[tuple[Path, Any]]:
    """The tensor placeholders and replica markers of a decoded tree, with their paths (as ``_Assembly._build``
    names them)."""
    t = type(node)
    if t is TensorRef or (t is dict and ELIDED in node):
        yield keys, node
    elif t is dict or t is collections.OrderedDict:
        for k, v in node.items():
            yield from _leaves(v, (*keys, k))
    elif t is list or t is tuple:
        for i, v in enumerate(node):
            yield from _leaves(v, (*keys, i))


def _marker(node: dict[Any, Any], keys: Path, what: str) -> tuple[int, str, list[int]]:
    try:
        keeper, dtype_name, shape = node[ELIDED]
        if (
            type(keeper) is not int
            or dtype_name not in TORCH_DTYPES
            or not all(type(n) is int for n in shape)
        ):
            raise TypeError
        return keeper, dtype_name, shape
    except (TypeError, ValueError):
        raise ExportError(f"{what}: malformed replica marker at {where(keys)}") from None


class _Exporter:
    """One export's connections: to the coordinator and, as they are needed, to the holders' data planes."""

    def __init__(
        self, network: Network, links: PeerLinks, coordinator: str, job: str, timeout: float, parallel: int
    ) -> None:
        self.network = network
        self.links = links
        self.coordinator = coordinator
        self.control = network.connect(coordinator, Role.COORDINATOR)
        self.job = job
        self.timeout = timeout
        self.parallel = parallel
        self.pulled_bytes = 0

    async def ask(self, step: int, first: int = 0) -> HoldersReply:
        while self.control.recv_nowait() is not None:  # a reply to an earlier request that timed out
            pass
        query = HoldersQuery(job=self.job, step=step, first=first, count=MAX_PLAN_RANKS)
        try:
            async with asyncio.timeout(self.timeout):
                await self.control.send(encode(query))
                reply = decode(await self.control.recv(copy=True))
        except TimeoutError:
            why = f" ({self.control.failure})" if self.control.failure else ""
            raise ExportError(
                f"no answer from the coordinator at {self.coordinator} within {self.timeout:g} s{why}"
            ) from None
        if isinstance(reply, Error):
            raise ExportError(
                reply.message
                if reply.code == ErrorCode.NOT_FOUND
                else f"the coordinator refused: {reply.code}: {reply.message}"
            )
        if not isinstance(reply, HoldersReply):
            raise ExportError(
                f"the coordinator answered {reply.TYPE!r} to a holders query (an older coordinator?)"
            )
        return reply

    async def holders(self, step: int) -> tuple[int, int, list[tuple[str, ...]]]:
        """The step to export (``step``; for -1, D, or G while there is none), the world size and each rank's
        holders.

        Raises:
            ExportError: the job is unknown, has no complete step, or some rank's step is held by no live node.
        """
        reply = await self.ask(step)
        if reply.step < 0 or reply.world_size == 0:
            raise ExportError(f"job {self.job!r} has no complete step yet: no step is held for every rank")
        sources = list(reply.sources)
        while len(sources) < reply.world_size:
            more = await self.ask(reply.step, first=len(sources))
            if not more.sources or more.step != reply.step:
                raise ExportError(f"job {self.job!r} changed while its holders were listed; try again")
            sources += more.sources
        missing = [r for r, s in enumerate(sources) if not s]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            )
            raise ExportError(
                f"step {reply.step} of job {self.job!r} is not held for rank(s) {shown} (newest "
                f"durable step: {_step(reply.durable)}, recoverable: {_step(reply.recoverable)})"
            )
        return reply.step, reply.world_size, sources

    async def pull(self, rank: int, step: int, sources: tuple[str, ...]) -> _Snapshot:
        """Rank ``rank``'s snapshot of ``step`` from its holders, every chunk checked against their seal.

        Raises:
            PullFailed: no holder could deliver it (CorruptEverywhere: some chunk was bad from every holder).
        """
        buf: list[torch.Tensor] = []

        def allocate(manifest: StreamBegin) -> Lander:
            data = torch.empty(manifest.data_bytes, dtype=torch.uint8)
            buf.append(data)
            return arena_sink(memoryview(data.numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer

        links = [self.links.get(addr) for addr in sources]
        manifest, _, _ = await pull_snapshot(links, job=self.job, rank=rank, step=step, allocate=allocate)
        try:
            entries = decode_table(manifest.table, manifest.data_bytes)
        except ValueError as exc:
            raise ExportError(
                f"job {self.job!r} step {step}: the tensor table of rank {rank} is bad: {exc}"
            ) from exc
        self.pulled_bytes += manifest.data_bytes
        return _Snapshot(rank, entries, bytes(manifest.meta), buf[0])

    async def collect(
        self, step: int, world_size: int, sources: list[tuple[str, ...]]
    ) -> tuple[dict[str, Any], list[int]]:
        """The checkpoint's state dict for ``step`` and the ranks pulled for it."""
        assembly = _Assembly(self.job, step)
        first = await self.pull(0, step, sources[0])
        await asyncio.to_thread(assembly.first, first)
        del first
        pulled = [0]
        if assembly.pending:
            keepers = [r for r in assembly.keepers() if 0 < r < world_size]
            others = [r for r in range(1, world_size) if r not in keepers]
            todo = collections.deque(keepers + others)
            gate = asyncio.Semaphore(self.parallel)

            async def one(rank: int) -> None:
                async with gate:
                    if not assembly.pending:
                        return
                    snap = await self.pull(rank, step, sources[rank])
                    pulled.append(rank)
                    await asyncio.to_thread(assembly.add, snap)

            try:
                async with asyncio.TaskGroup() as tg:
                    while todo:
                        tg.create_task(one(todo.popleft()))
            except BaseExceptionGroup as eg:
                raise _first(eg) from None
        assembly.check_complete()
        return assembly.state, pulled


async def _export(
    coordinator: str, job: str, step: int | None, secret: str | None, timeout: float, parallel: int
) -> tuple[dict[str, Any], Exported]:
    network = open_network(coordinator, Security(secret))
    tasks = TaskTree(Counters())
    links = PeerLinks(network, timeout=timeout, source=None, tasks=tasks)
    exporter: _Exporter | None = None
    try:
        async with asyncio.TaskGroup() as group:  # the peer links' readers run in it
            tasks.attach(group)
            try:
                exporter = _Exporter(network, links, coordinator, job, timeout, parallel)
                return await _attempts(exporter, step)
            finally:
                tasks.cancel_all()
    except BaseExceptionGroup as eg:
        raise _first(eg) from None
    finally:
        links.close()
        if exporter is not None:
            exporter.control.close()
        network.close()


async def _attempts(exporter: _Exporter, step: int | None) -> tuple[dict[str, Any], Exported]:
    """Export ``step``, or D and the newer D when the one being exported is collected meanwhile."""
    for attempt in range(ATTEMPTS):
        exporter.pulled_bytes = 0  # of this attempt's step only
        at, world_size, sources = await exporter.holders(-1 if step is None else step)
        try:
            state, pulled = await exporter.collect(at, world_size, sources)
        except PullFailed as failure:
            if step is None and attempt + 1 < ATTEMPTS:
                newer = (await exporter.ask(-1)).step
                if newer > at:
                    log.info(
                        "step %d of job %s was collected while exporting it (%s); exporting step %d",
                        at,
                        exporter.job,
                        failure,
                        newer,
                    )
                    continue
            raise ExportError(f"job {exporter.job!r} step {at}: {failure}") from None
        return state, Exported(exporter.job, at, world_size, sorted(pulled), exporter.pulled_bytes, "")
    raise AssertionError("unreachable")


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
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"{out} exists and is not an empty directory")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ExportError(f"{parent} is not a directory")
    state, done = asyncio.run(_export(coordinator, job, step, secret, timeout, parallel))
    import torch.distributed.checkpoint as dcp

    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    try:
        with warnings.catch_warnings():  # that no process group is needed is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(partial),
                planner=dcp.DefaultSavePlanner(),
                no_dist=True,
            )
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
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


def _first(eg: BaseExceptionGroup) -> BaseException:
    """The exception of a task group's failure to raise: an ExportError, else a failed pull, else the first."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(eg)
    return next((e for kind in (ExportError, PullFailed) for e in leaves if isinstance(e, kind)), leaves[0])


def _step(step: int) -> str:
    return "none" if step < 0 else str(step)
