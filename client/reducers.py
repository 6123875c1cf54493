"""The gradient reductions over virtual ranks: exact mode (:class:`ExactReducer`) and equivalent mode
(:class:`EquivalentReducer`).

:class:`ExactReducer` keeps each virtual rank's gradient apart (:meth:`~ExactReducer.collect`, after its
backward) and reduces them in the shape of a reduce-scatter followed by an all-gather, in one canonical order:

1. Each parameter dtype's gradients are one flat vector, cut into one shard per process (padded to equal size).
2. An all-to-all sends every virtual rank's slice of shard ``p`` to process ``p``; a process carrying ``k``
   virtual ranks sends ``k`` slices. With one virtual rank per process this moves what a ring reduce-scatter
   moves.
3. Each process sums its shard over the virtual ranks in the order ``0, 1, ..., W-1``, one elementwise addition
   at a time, and divides by ``W``: every element's value is ``((g0 + g1) + ...) + g[W-1]) / W`` whatever the
   shard's bounds, so it depends neither on the number of processes nor on the mapping.
4. An all-gather gives every process the whole mean, written into each parameter's ``.grad``.

The failure-free run must use the same reduction: DDP's all-reduce sums in another order. Bit-identity also needs
the forward and backward of a virtual rank to be deterministic where they run (the same kernels, thread count and
hardware; ``torch.use_deterministic_algorithms`` on a GPU).

:class:`EquivalentReducer` sums the virtual ranks a process carries locally and all-reduces the sum with the
backend's own all-reduce (ring or tree, what DDP uses): the same samples and the same global batch, and a mean that
equals the failure-free run's up to the order of the floating-point additions, which changes with the number of
processes. It moves what an all-reduce moves and costs no more than one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .virtual import Layout

__all__ = ["EquivalentReducer", "ExactReducer"]

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which older versions lack
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Bucket:
    """The parameters of one dtype and device, as one flat vector of ``numel`` elements."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.device = params[0].device

    def flatten_grads(self, out: torch.Tensor) -> None:
        """Copy the parameters' gradients into ``out[:numel]`` (zeros for a parameter with none)."""
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                out[offset : offset + n].zero_()
            else:
                out[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n

    def assign_grads(self, flat: torch.Tensor) -> None:
        """Make every parameter's ``.grad`` its slice of ``flat`` (views, no copy)."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n


class _Reducer:
    """What both reductions share: the parameters in buckets, the layout, and the per-step bookkeeping."""

    def __init__(self, params: Iterable[torch.nn.Parameter], layout: Layout, group: Any = None) -> None:
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
        if not by_kind:
            raise ValueError(f"{type(self).__name__} was given no parameter that requires a gradient")
        self._buckets = [_Bucket(ps) for ps in by_kind.values()]
        self.relayout(layout, group)

    @property
    def device(self) -> torch.device:
        """The device of the parameters (the first bucket's): where collectives beside the reduction run."""
        return self._buckets[0].device

    def relayout(self, layout: Layout, group: Any = None) -> None:
        """Carry on with ``layout`` over ``group`` (default: the default group); gradients collected and not
        reduced yet are dropped.

        Raises:
            ValueError: the layout's processes are not the group's.
        """
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        if layout.processes != size:
            raise ValueError(f"the layout has {layout.processes} processes, the group {size}")
        self.layout, self._group = layout, group
        self._collected: list[int] = []
        self._allocate()

    def collect(self, vrank: int) -> None:
        """Keep the gradients of ``vrank``'s backward, and clear the parameters' ``.grad``.

        Raises:
            ValueError: this process does not carry ``vrank``, or collected it already this step.
        """
        if vrank not in self.layout.mine:
            raise ValueError(f"this process carries virtual ranks {list(self.layout.mine)}, not {vrank}")
        if vrank in self._collected:
            raise ValueError(f"virtual rank {vrank}'s gradient was collected twice in one step")
        self._keep(vrank, first=not self._collected)
        for bucket in self._buckets:
            for p in bucket.params:
                p.grad = None
        self._collected.append(vrank)

    def reduce(self) -> None:
        """Write the mean of every virtual rank's gradient into each parameter's ``.grad`` (a collective).

        Raises:
            ValueError: a virtual rank this process carries was not collected this step.
        """
        missing = sorted(set(self.layout.mine) - set(self._collected))
        if missing:
            raise ValueError(f"virtual ranks {missing} were not collected before reduce()")
        self._collected = []
        for i, bucket in enumerate(self._buckets):
            bucket.assign_grads(self._reduce_bucket(i))

    def _allocate(self) -> None:
        raise NotImplementedError

    def _keep(self, vrank: int, first: bool) -> None:
        raise NotImplementedError

    def _reduce_bucket(self, i: int) -> torch.Tensor:
        raise NotImplementedError


class ExactReducer(_Reducer):
    """The mean gradient over a job's ``W`` virtual ranks, bit-identical for every :class:`~.virtual.Layout`.

    Args:
        params: the model's parameters (those without ``requires_grad`` are left out), alike on every process.
        layout: which process carries which virtual rank; :meth:`relayout` changes it (after a shrink or grow).
        group: the process group of the layout's processes (default: the default group).

    Every process of the group calls :meth:`reduce` once per step, after :meth:`collect` for each of its virtual
    ranks.
    """

    def _allocate(self) -> None:
        size = self.layout.processes
        self._shard = [-(-b.numel // size) for b in self._buckets]  # elements per shard, per bucket
        self._kept = {
            v: [
                torch.zeros(s * size, dtype=b.dtype, device=b.device)
                for b, s in zip(self._buckets, self._shard, strict=True)
            ]
            for v in self.layout.mine
        }

    def _keep(self, vrank: int, first: bool) -> None:
        for bucket, kept in zip(self._buckets, self._kept[vrank], strict=True):
            bucket.flatten_grads(kept)

    def _reduce_bucket(self, i: int) -> torch.Tensor:
        layout, shard = self.layout, self._shard[i]
        procs, mine = layout.processes, layout.mine
        # [k, P, L] -> [P, k, L]: for each destination process, this process's virtual ranks' slices of its shard
        kept = torch.stack([self._kept[v][i] for v in mine]).view(len(mine), procs, shard)
        if procs == 1:
            rows = {v: kept[j, 0] for j, v in enumerate(mine)}
        else:
            send = kept.transpose(0, 1).contiguous().view(-1)
            counts = [len(c) * shard for c in layout.carried]
            recv = torch.empty(sum(counts), dtype=send.dtype, device=send.device)
            dist.all_to_all_single(recv, send, counts, [len(mine) * shard] * procs, group=self._group)
            rows, offset = {}, 0
            for vranks in layout.carried:
                for v in vranks:
                    rows[v] = recv[offset : offset + shard]
                    offset += shard
        total = rows[0].clone()
        for v in range(1, layout.world):
            total.add_(rows[v])
        total.div_(layout.world)
        if procs == 1:
            return total[: self._buckets[i].numel]
        out = torch.empty(shard * procs, dtype=total.dtype, device=total.device)
        _all_gather(out, total, group=self._group)
        return out[: self._buckets[i].numel]


class EquivalentReducer(_Reducer):
    """The mean gradient over a job's ``W`` virtual ranks by the backend's all-reduce: equal to the failure-free
    run's up to the order of the floating-point sum (which the number of processes changes).

    Args and use: as :class:`ExactReducer`.
    """

    def _allocate(self) -> None:
        self._sum = [torch.zeros(b.numel, dtype=b.dtype, device=b.device) for b in self._buckets]
        self._scratch = [torch.zeros_like(t) for t in self._sum]

    def _keep(self, vrank: int, first: bool) -> None:
        for bucket, total, scratch in zip(self._buckets, self._sum, self._scratch, strict=True):
            if first:
                bucket.flatten_grads(total)
            else:
                bucket.flatten_grads(scratch)
                total.add_(scratch)

    def _reduce_bucket(self, i: int) -> torch.Tensor:
        total = self._sum[i]
        if self.layout.processes > 1:
            dist.all_reduce(total, group=self._group)
        total.div_(self.layout.world)
        self._sum[i] = torch.empty_like(total)  # the parameters' .grad are views of the reduced one now
        return total
