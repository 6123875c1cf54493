"""Snapshot state that every rank of a data-parallel group holds alike once, not once per rank.

In data-parallel training every rank of a replica group holds bitwise the same parameters, optimizer state and
scheduler state. ``Snapshotter(state, replicated=("model", "optim"))`` wraps each of those values in a
:class:`ReplicaShard`: in its snapshots, each tensor of the value's state dict is kept by exactly one rank of
the group (whole tensors, spread so that every rank keeps about the same number of bytes), and the others keep
a small marker in its place. A rank then copies and streams about ``1/group size`` of the replicated state.
A module's buffers are the exception, kept by every rank: DDP broadcasts them from rank 0 at each forward, and
each rank then updates them from its own batch (BatchNorm's running statistics), so they are not alike.

On restore every rank of the group loads its own snapshot of the same step (the coordinator's plan round makes
sure of that), and then each rank in turn broadcasts the tensors it kept to the others over the group (one
``torch.distributed.broadcast`` per rank and value), so that every rank loads the whole state dict. Before
the first broadcast of a value the ranks agree that each found its part as expected, so that a rank that did
not raises and the others say so instead of waiting. The group must use the gloo backend, which carries CPU
tensors: with NCCL training, create one with ``torch.distributed.new_group(backend="gloo")``.

Which rank keeps which tensor is a pure function of the state dict's structure (the byte sizes of its tensors
in walk order) and the group size, computed alike by every rank at capture and again at restore; the markers
name the keeper so that a snapshot taken with another assignment is refused, not mixed up. DTensors are left
alone: their local shards differ between ranks already.
"""

from __future__ import annotations

import collections
import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from snapshotd.snapshot_format import ELIDED, dtensor_type

from .errors import ConfigMismatch, ReplicaGroupError
from .state import check_tensor

__all__ = ["ELIDED", "ReplicaShard", "agree", "agree_restored", "assign_keepers", "fail_remaining"]

log = logging.getLogger(__name__)

_ALIGN = 64


def assign_keepers(sizes: list[int], ranks: int, load: list[int] | None = None) -> list[int]:
    """A keeper rank for each of ``sizes`` (bytes), balancing the bytes each rank keeps.

    Largest first, each to the rank keeping the fewest bytes so far (the lowest such rank on a tie), counting
    from ``load`` (bytes each rank keeps already; updated in place) when given; the same inputs give the same
    answer on every rank.
    """
    load = load if load is not None else [0] * ranks
    keeper = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        keeper[i] = rank
        load[rank] += sizes[i]
    return keeper


class ReplicaShard:
    """A Stateful stand-in for ``inner`` in snapshots: its state dict, each tensor kept by one rank of ``group``.

    The keepers are assigned over the tensors of the shards ``before`` this one too (the earlier replicated
    values of the same state, whose state dicts are read afresh each time), so that the largest tensors of a
    model and of its optimizer's moments do not all land on the same ranks.

    Args:
        inner: the Stateful value (a module, an optimizer, a scheduler) every rank of ``group`` holds alike.
        group: a gloo process group of the ranks holding ``inner`` alike.
        name: the state key, for messages.
        before: the shards of the same state that come before this one (restored before it, too).

    Raises:
        ValueError: ``inner`` is not Stateful or ``group`` is not a gloo group.
    """

    def __init__(self, inner: Any, group: Any, name: str, before: Sequence[ReplicaShard] = ()) -> None:
        if not (
            callable(getattr(inner, "state_dict", None)) and callable(getattr(inner, "load_state_dict", None))
        ):
            raise ValueError(
                f"replicated state {name!r} must be Stateful (have state_dict and load_state_dict)"
            )
        backend = str(dist.get_backend(group))
        if "gloo" not in backend:
            raise ValueError(
                f"replica group of {name!r} uses {backend}; it must be a gloo group, which carries CPU "
                "tensors: torch.distributed.new_group(ranks, backend='gloo')"
            )
        self.inner = inner
        self.group = group
        self.name = name
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process is not a member of the replica group of {name!r}")
        self.size = dist.get_world_size(group)
        self.own = (
            frozenset(n for n, _ in inner.named_buffers(remove_duplicate=False))
            if isinstance(inner, torch.nn.Module)
            else frozenset()
        )
        """State dict keys every rank keeps: a module's buffers (see the module docstring). Only a module's own:
        a Stateful that wraps a module has its buffers shared out like any tensor."""
        self.agreed = False
        """Whether this restore passed this shard's agreement (see :func:`fail_remaining`)."""
        self.before = tuple(before)
        self._sizes: tuple[int, ...] | None = None
        self._memo: tuple[Any, list[int]] | None = None

    def sizes(self) -> tuple[int, ...]:
        """The byte sizes of the tensors of the state dict this shard last saw (read it now if it saw none)."""
        if self._sizes is None:
            self._sizes = tuple(_nbytes(x) for x in _leaves(self.inner.state_dict(), self.own))
        return self._sizes

    def _keepers(self, leaves: list[Any]) -> list[int]:
        """Keepers of ``leaves``, counting from the bytes the shards before this one give each rank (each of
        those assigned its own tensors the same way, from the ones before it). Remembered while the sizes stay."""
        self._sizes = tuple(_nbytes(x) for x in leaves)
        key = (tuple(shard.sizes() for shard in self.before), self._sizes)
        if self._memo is None or self._memo[0] != key:
            load = [0] * self.size
            for sizes in key[0]:
                assign_keepers(list(sizes), self.size, load)
            self._memo = (key, assign_keepers(list(self._sizes), self.size, load))
        return self._memo[1]

    def state_dict(self) -> Any:
        """``inner.state_dict()`` with every tensor another rank keeps replaced by a marker (containers are new;
        the tensors this rank keeps are the live ones)."""
        sd = self.inner.state_dict()
        keeper = self._keepers(_leaves(sd, self.own))
        order = iter(keeper)

        def elide(t: torch.Tensor, keys: tuple[Any, ...]) -> Any:
            dtype = check_tensor(t, (self.name, *keys))  # on every rank, not only on its keeper
            k = next(order)
            return t if k == self.rank else {ELIDED: [k, dtype, list(t.shape)]}

        return _rebuild(sd, elide, self.own)

    def load_state_dict(self, sd: Any) -> None:
        """Fill every marker of ``sd`` with the tensor its keeper restored (collective over the group: every
        rank calls this for the same step), then ``inner.load_state_dict`` the whole.

        Raises:
            ConfigMismatch: the markers do not match this group's assignment (a snapshot taken with another group
                size or structure).
            ValueError: a marker is malformed.
            ReplicaGroupError: another rank of the group could not load its part.
        """
        leaves = _leaves(sd, self.own)
        problem = ""
        try:
            marks = [_marker(leaf) for leaf in leaves]
            keeper = self._keepers(leaves)
        except ValueError as exc:
            problem, marks, keeper = str(exc), [], []
        mismatch = not problem
        for i, (mark, k) in enumerate(zip(marks, keeper, strict=True) if not problem else ()):
            if (mark is None) != (k == self.rank) or (mark is not None and mark[0] != k):
                unsharded = all(m is None for m in marks)
                problem = (
                    f"state[{self.name!r}]: tensor {i} of its state dict was snapshotted "
                    + (
                        "without replicated="
                        if unsharded
                        else f"by another assignment of ranks (this group has {self.size})"
                    )
                    + ": restore with the replicated= keys and group size it was "
                    "taken with"
                )
                break
        self.agreed = True
        failed = agree(self.group, ok=not problem)
        if problem:
            raise (ConfigMismatch if mismatch else ValueError)(problem)
        if failed:
            raise ReplicaGroupError(
                f"state[{self.name!r}]: rank(s) {failed} of the replica group could not load "
                "their part of it (see their errors)"
            )
        filled: list[Any] = list(leaves)
        for k in range(self.size):
            mine = [i for i in range(len(leaves)) if keeper[i] == k]
            offsets, total = _layout([_nbytes(leaves[i]) for i in mine])
            buf = torch.empty(total, dtype=torch.uint8)
            if k == self.rank:
                for i, off in zip(mine, offsets, strict=True):
                    n = _nbytes(leaves[i])
                    if n:
                        buf[off : off + n] = leaves[i].detach().reshape(-1).cpu().view(torch.uint8)
            if total:
                dist.broadcast(buf, src=dist.get_global_rank(self.group, k), group=self.group)
            if k != self.rank:
                for i, off in zip(mine, offsets, strict=True):
                    _, dtype, shape = _marker(leaves[i])  # type: ignore[misc]
                    n = _nbytes(leaves[i])
                    filled[i] = (
                        buf[off : off + n].view(dtype).reshape(shape).clone()
                        if n
                        else torch.empty(shape, dtype=dtype)
                    )
        it = iter(filled)
        self.inner.load_state_dict(_rebuild(sd, lambda _x, _keys: next(it), self.own))

    fills_markers = True
    """Tells :func:`~snapshotd.client.load.restore_into` that markers in this value's snapshot are expected."""


def fail_remaining(shards: Sequence[ReplicaShard]) -> None:
    """After this rank's restore failed: take part, as failed, in the agreement of every shard it did not reach,
    in order, so that the other ranks raise there instead of waiting for it (errors doing so are logged)."""
    for shard in shards:
        if not shard.agreed:
            try:
                agree(shard.group, ok=False)
            except Exception as exc:  # the group itself broke: the caller's error is the one that matters
                log.warning(
                    "could not tell the replica group of %r that this rank failed: %s", shard.name, exc
                )
                return


def agree_restored(group: Any, *, ok: bool, job: str, wait: datetime.timedelta) -> None:
    """Tell the replica group whether this rank's own part of a restore came, before any rank waits in a broadcast
    for a part that will never come (collective over ``group``). The group's first rank waits for the others up
    to ``wait`` (a rank pulling its part may take longer than the process group's own timeout); the others wait
    for it up to the process group's timeout.

    Raises:
        ReplicaGroupError: this rank got its part but another rank of the group did not (that rank raises its own
            error).
        RuntimeError: a rank did not arrive in time (torch names it).
    """
    dist.monitored_barrier(group, timeout=wait, wait_all_ranks=True)
    failed = agree(group, ok=ok)
    if ok and failed:
        raise ReplicaGroupError(
            f"job {job!r}: rank(s) {failed} of the replica group could not restore their part "
            "of the replicated state (see their errors), so no rank can load it whole"
        )


def agree(group: Any, *, ok: bool) -> list[int]:
    """Tell every rank of ``group`` whether this one is ``ok``; the global ranks that are not (collective)."""
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, torch.tensor([0 if ok else 1], dtype=torch.int32), group=group)
    return [dist.get_global_rank(group, i) for i, f in enumerate(flags) if f.item()]


def _marker(x: Any) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
    """``(keeper, dtype, shape)`` of a marker; None for a tensor.

    Raises:
        ValueError: a malformed marker.
    """
    if isinstance(x, torch.Tensor):
        return None
    try:
        keeper, dtype_name, shape = x[ELIDED]
        dtype = getattr(torch, dtype_name)
        if (
            not isinstance(dtype, torch.dtype)
            or type(keeper) is not int
            or not all(type(n) is int for n in shape)
        ):
            raise TypeError
        return keeper, dtype, tuple(shape)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"malformed replica marker {x!r}") from None


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    _, dtype, shape = _marker(x)  # type: ignore[misc]
    numel = 1
    for n in shape:
        numel *= n
    return numel * torch.empty((), dtype=dtype).element_size()


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, total


def _leaves(obj: Any, own: frozenset[str]) -> list[Any]:
    """The shardable tensors and markers of ``obj``, in :func:`_rebuild`'s order."""
    out: list[Any] = []

    def keep(x: Any, _keys: tuple[Any, ...]) -> Any:
        out.append(x)
        return x

    _rebuild(obj, keep, own)
    return out


def _rebuild(obj: Any, leaf: Callable[[Any, tuple[Any, ...]], Any], own: frozenset[str]) -> Any:
    """A copy of the containers of ``obj`` with ``leaf(value, keys)`` applied to every shardable tensor and every
    marker, in walk order (dicts in insertion order). Other values are kept as they are: DTensors, and the
    top-level entries named in ``own`` (every rank keeps those)."""
    dtensor = dtensor_type()

    def walk(x: Any, keys: tuple[Any, ...]) -> Any:
        if isinstance(x, torch.Tensor):
            return x if dtensor is not None and isinstance(x, dtensor) else leaf(x, keys)
        t = type(x)
        if t is dict and ELIDED in x:
            return leaf(x, keys)
        if t is dict or t is collections.OrderedDict:
            out = t((k, x[k] if not keys and k in own else walk(v, (*keys, k))) for k, v in x.items())
            meta = getattr(x, "_metadata", None)
            if meta is not None:
                out._metadata = meta  # type: ignore[attr-defined]  # nn.Module's per-submodule versions
            return out
        if t is list:
            return [walk(v, (*keys, i)) for i, v in enumerate(x)]
        if t is tuple:
            return tuple(walk(v, (*keys, i)) for i, v in enumerate(x))
        return x

    return walk(obj, ())
