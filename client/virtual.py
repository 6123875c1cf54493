"""Virtual ranks: a data-parallel job of ``W`` ranks as ``W`` virtual ranks, carried by any number of processes.

Each virtual rank is one share of the global batch with its own data position and random streams
(:class:`VirtualRank`). In a failure-free run every process carries one, its *home* (its rank in the job); after
a loss the survivors carry the lost ones too (:func:`spread`), so every step still consumes the same ``W``
micro-batches. With :class:`~snapshotd.client.reducers.ExactReducer` the gradient's bits do not depend on which
process carries which virtual rank, so a job that shrinks and grows stays bit-identical to its failure-free run.

The loop over the virtual ranks a process carries::

    layout = Layout.of(world=W, homes=[...], me=group_rank)   # or Layout.failure_free(W, rank)
    vranks = {v: VirtualRank(v, seed=0, data=make_loader(v)) for v in layout.mine}
    for v in layout.mine:
        with vranks[v].active():          # v's random streams are the process's for this block
            loss = step_loss(model, next(vranks[v].data))
            loss.backward()
        reducer.collect(v)                # v's gradient kept apart, the module's gradients cleared
    reducer.reduce()                      # the mean over all W, written to every parameter's .grad
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .rng import RNGState

__all__ = ["Layout", "VirtualRank", "spread"]


def spread(world: int, homes: Sequence[int]) -> list[list[int]]:
    """The virtual ranks each process carries, in the order of ``homes``.

    ``homes[i]`` is process ``i``'s own virtual rank. Every process keeps its home; each virtual rank that no
    process is home to goes, in ascending order, to the process carrying fewest so far (the first of equals). So
    with ``P`` processes the busiest carries ``ceil(world / P)``. Each list is sorted.

    Raises:
        ValueError: no process, a home outside ``range(world)``, or one home twice.
    """
    if not homes:
        raise ValueError("no process to carry the virtual ranks")
    bad = [h for h in homes if not 0 <= h < world]
    if bad:
        raise ValueError(f"homes {bad} are not virtual ranks of a job of {world}")
    if len(set(homes)) != len(homes):
        raise ValueError(f"a virtual rank is home to two processes: {list(homes)}")
    carried = [[h] for h in homes]
    orphans = sorted(set(range(world)) - set(homes))
    for v in orphans:
        least = min(range(len(carried)), key=lambda i: len(carried[i]))
        carried[least].append(v)
    return [sorted(c) for c in carried]


@dataclass(frozen=True)
class Layout:
    """Which process of the group carries which of the job's ``world`` virtual ranks.

    Attributes:
        world: the job's virtual ranks (its world size when nothing failed).
        carried: per process, in the group's rank order, the virtual ranks it carries (sorted).
        me: this process's rank in the group.
    """

    world: int
    carried: tuple[tuple[int, ...], ...]
    me: int

    def __post_init__(self) -> None:
        flat = sorted(v for c in self.carried for v in c)
        if flat != list(range(self.world)):
            raise ValueError(
                f"a layout must carry every virtual rank of {self.world} once, got {self.carried}"
            )
        if not 0 <= self.me < len(self.carried):
            raise ValueError(f"process {self.me} is not one of the layout's {len(self.carried)}")

    @classmethod
    def of(cls, world: int, homes: Sequence[int], me: int) -> Layout:
        """The layout :func:`spread` gives the processes of ``homes`` (group rank order); ``me`` this one."""
        return cls(world, tuple(tuple(c) for c in spread(world, homes)), me)

    @classmethod
    def failure_free(cls, world: int, rank: int) -> Layout:
        """One virtual rank per process: process ``rank`` carries virtual rank ``rank``."""
        return cls.of(world, range(world), rank)

    @property
    def processes(self) -> int:
        """The processes of the group."""
        return len(self.carried)

    @property
    def mine(self) -> tuple[int, ...]:
        """The virtual ranks this process carries."""
        return self.carried[self.me]

    def carrier(self, vrank: int) -> int:
        """The group rank of the process carrying ``vrank``.

        Raises:
            ValueError: not a virtual rank of this layout.
        """
        for process, vranks in enumerate(self.carried):
            if vrank in vranks:
                return process
        raise ValueError(f"{vrank} is not a virtual rank of a job of {self.world}")


def _seeded_streams(seed: int) -> dict[str, Any]:
    """The state of every generator :class:`RNGState` covers, seeded from ``seed``; the process's own
    generators are left as they were."""
    rng = RNGState()
    outer = rng.state_dict()
    try:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # every CUDA device too
        return rng.state_dict()
    finally:
        rng.load_state_dict(outer)


class VirtualRank:
    """One virtual rank's own state: its random streams and its data (a loader or sampler with a state dict).

    Stateful: put it in the Snapshotter's state, so its data position and random streams move with it when
    another process takes it over.

    Args:
        index: the virtual rank, in ``range(world)``.
        seed: the job's seed; the virtual rank's streams start from ``seed * 1_000_003 + index``.
        data: this virtual rank's data (``state_dict()``/``load_state_dict()``, such as a ``StatefulDataLoader``
            over a ``DistributedSampler(num_replicas=world, rank=index)``), or None.
    """

    def __init__(self, index: int, *, seed: int = 0, data: Any = None) -> None:
        if index < 0:
            raise ValueError(f"a virtual rank is >= 0, got {index}")
        self.index = index
        self.data = data
        self._streams = _seeded_streams(seed * 1_000_003 + index)
        self._rng = RNGState()
        self._active = False
        self._batches: Iterator[Any] | None = None

    def next_batch(self) -> Any:
        """The next item of :attr:`data`, from where its state left it; a new pass begins when one ends.

        Raises:
            ValueError: this virtual rank has no data.
        """
        if self.data is None:
            raise ValueError(f"virtual rank {self.index} has no data")
        if self._batches is None:
            self._batches = iter(self.data)
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.data)
            return next(self._batches)

    @contextlib.contextmanager
    def active(self) -> Iterator[VirtualRank]:
        """This virtual rank's random streams are the process's (Python, NumPy, torch CPU and CUDA) inside the
        block; the process's own are put back after it, and the streams' new state kept for the next block.

        Raises:
            RuntimeError: the block is entered again inside itself.
        """
        if self._active:
            raise RuntimeError(f"virtual rank {self.index} is already active")
        outer = self._rng.state_dict()
        self._rng.load_state_dict(self._streams)
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            self._streams = self._rng.state_dict()
            self._rng.load_state_dict(outer)

    def state_dict(self) -> dict[str, Any]:
        """Its index, its random streams and its data's state dict (None without data)."""
        return {
            "index": self.index,
            "rng": self._streams,
            "data": None if self.data is None else self.data.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the state of :meth:`state_dict` (possibly from another process, through a snapshot).

        Raises:
            ValueError: the state is another virtual rank's, or has data where this one has none (or the
                reverse).
        """
        if state_dict["index"] != self.index:
            raise ValueError(
                f"virtual rank {self.index} was given virtual rank {state_dict['index']}'s state"
            )
        if (state_dict["data"] is None) != (self.data is None):
            raise ValueError(
                f"virtual rank {self.index}: the state's data and this rank's disagree on having one"
            )
        self._streams = dict(state_dict["rng"])
        if self.data is not None:
            self.data.load_state_dict(state_dict["data"])
            self._batches = None  # the next batch comes from a pass resumed at the loaded position
