"""An optimizer's state dict without calling ``state_dict()``: :class:`OptimizerTree`.

``torch.optim.Optimizer.state_dict()`` maps every parameter to its index, in Python, and copies every param group
(tens of microseconds, a few hundred with the caches cold after a training step). For an optimizer that keeps
torch's own ``state_dict`` and has no state-dict hooks, the result is a function of ``param_groups`` and ``state``
alone: while the groups hold the same parameter objects in the same order (as many in each) and ``state`` has
the same keys in the same order, every index is the one found last time, and only the groups' other values and
the per-parameter state dicts need reading.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

__all__ = ["OptimizerTree"]

_PARAMS = operator.itemgetter("params")


def _plain(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.state_dict()`` is torch's default: no override (in its class or on the instance), no
    hook."""
    return (
        type(optimizer).state_dict is torch.optim.Optimizer.state_dict
        and "state_dict" not in vars(optimizer)
        and not optimizer._optimizer_state_dict_pre_hooks
        and not optimizer._optimizer_state_dict_post_hooks
    )


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class OptimizerTree:
    """What ``optimizer.state_dict()`` returns, read from its ``param_groups`` and ``state``.

    Made with :meth:`of` from a ``state_dict()`` just taken; :meth:`state_dict` then returns what ``state_dict()``
    would (equal keys and values, the same tensor and per-parameter objects) as long as the optimizer keeps
    torch's ``state_dict``, has no state-dict hooks, its groups hold the same parameter objects in the same order
    (as many in each group) and its ``state`` has the same key objects in the same order; None once any of that
    changed (the caller then calls ``state_dict()`` itself). The lists of indices under ``"params"`` are shared
    from one call to the next: the caller only reads them.
    """

    __slots__ = ("_indices", "_keys", "_lengths", "_params", "_state_indices", "optimizer")

    def __init__(
        self, optimizer: torch.optim.Optimizer, indices: list[list[int]], state_indices: list[Any]
    ) -> None:
        self.optimizer = optimizer
        self._params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        self._lengths = list(map(len, map(_PARAMS, optimizer.param_groups)))
        self._keys = list(optimizer.state)
        self._indices = indices
        self._state_indices = state_indices

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> OptimizerTree | None:
        """The tree of ``optimizer``, whose ``state_dict()`` just returned ``sd``; None when that is not torch's
        default (an override or a hook)."""
        if not _plain(optimizer):
            return None
        return cls(optimizer, [list(g["params"]) for g in sd["param_groups"]], list(sd["state"]))

    def state_dict(self) -> dict[str, Any] | None:
        """The state dict now (see the class docstring), or None when the optimizer changed."""
        opt = self.optimizer
        groups = opt.param_groups
        if (
            not _plain(opt)
            or list(map(len, map(_PARAMS, groups))) != self._lengths
            or not _same(list(itertools.chain.from_iterable(map(_PARAMS, groups))), self._params)
            or not _same(list(opt.state), self._keys)
        ):
            return None
        packed = []
        for group, indices in zip(groups, self._indices, strict=True):
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = indices
            packed.append(g)
        return {
            "state": dict(zip(self._state_indices, opt.state.values(), strict=True)),
            "param_groups": packed,
        }
