"""A module's state dict without calling ``state_dict()``: :class:`ModuleTree`.

``nn.Module.state_dict()`` recurses in Python through every submodule (a few microseconds each, more with the
caches cold after a training step). For a tree whose every module keeps torch's own ``state_dict``,
``_save_to_state_dict`` and ``get_extra_state`` and has no state-dict hooks, the result is a function of each
module's ``_parameters``, ``_buffers``, ``_non_persistent_buffers_set`` and ``_modules`` alone, so it can be read
from those dicts with C-level loops once their shape is known to be unchanged.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleTree"]

_CONTAINERS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)
"""What ``state_dict()`` reads of each module besides its methods."""
_PARAMS, _BUFFERS, _CHILDREN, _NON_PERSISTENT, _, _ = map(operator.attrgetter, _CONTAINERS)
_FIELDS = operator.itemgetter(*_CONTAINERS)
"""All of them, from a module's ``__dict__`` in one call."""
_OVERRIDABLE = ("state_dict", "_save_to_state_dict", "get_extra_state")
"""What ``state_dict()`` calls on each module of the tree, through the instance."""
_chain = itertools.chain.from_iterable


def _plain(module: nn.Module) -> bool:
    """Whether ``module``'s own part of a state dict is torch's default: no override (in its class or on the
    instance), no hook."""
    cls = type(module)
    return (
        cls.state_dict is nn.Module.state_dict
        and cls._save_to_state_dict is nn.Module._save_to_state_dict
        and getattr(cls, "get_extra_state", nn.Module.get_extra_state) is nn.Module.get_extra_state
        and not any(name in vars(module) for name in _OVERRIDABLE)
        and not module._state_dict_hooks
        and not module._state_dict_pre_hooks
    )


class ModuleTree:
    """What ``module.state_dict()`` holds, read from the module tree's dicts.

    Made with :meth:`of` from a ``state_dict()`` just taken; :meth:`tensors` then returns that state dict's
    values in its order (the parameters and buffers themselves, where ``state_dict()`` detaches them) as long
    as the tree keeps the same modules under the same names, the same types, the same parameter and buffer names
    in each module, the same non-persistent buffer sets, no state-dict hooks and the same number of instance
    attributes on each module (an override of ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state`` set
    on an instance adds one); None once any of that changed (the caller then calls ``state_dict()`` itself). A
    value that changes in place (``param.data = ...``) is read as it is now.
    """

    __slots__ = (
        "_attributes",
        "_child_counts",
        "_child_names",
        "_children",
        "_counts",
        "_keep",
        "_names",
        "_non_persistent",
        "_nones",
        "_order",
        "_types",
        "module",
    )

    def __init__(self, order: list[nn.Module], keep: list[int]) -> None:
        self.module = order[0]
        """The root."""
        self._order = order
        self._types = list(map(type, order))
        self._attributes = list(map(len, map(vars, order)))
        self._child_counts = list(map(len, map(_CHILDREN, order)))
        self._child_names = list(_chain(map(_CHILDREN, order)))
        self._children = list(_chain(map(dict.values, map(_CHILDREN, order))))
        dicts = list(self._dicts())
        self._counts = list(map(len, dicts))
        self._names = list(_chain(dicts))
        self._nones = _none_mask(list(_chain(map(dict.values, dicts))))
        self._non_persistent = [set(s) for s in map(_NON_PERSISTENT, order)]
        self._keep = None if len(keep) == len(self._names) else keep

    @classmethod
    def of(cls, module: nn.Module, keys: tuple[Any, ...]) -> ModuleTree | None:
        """The tree of ``module``, whose ``state_dict()`` just had ``keys``; None when its state dict is not
        torch's default (an override or a hook anywhere in the tree)."""
        order: list[nn.Module] = []
        found: list[str] = []
        keep: list[int] = []
        position = 0

        def visit(m: nn.Module, prefix: str) -> bool:
            nonlocal position
            if not _plain(m):
                return False
            order.append(m)
            for name, p in m._parameters.items():
                if p is not None:
                    found.append(prefix + name)
                    keep.append(position)
                position += 1
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent_buffers_set:
                    found.append(prefix + name)
                    keep.append(position)
                position += 1
            return all(visit(c, f"{prefix}{n}.") for n, c in m._modules.items() if c is not None)

        if not visit(module, "") or tuple(found) != keys:
            return None
        return cls(order, keep)

    def _dicts(self) -> Iterator[dict[str, Any]]:
        """Each module's parameters then buffers, in the order ``state_dict()`` visits them."""
        return _chain(zip(map(_PARAMS, self._order), map(_BUFFERS, self._order), strict=True))

    def tensors(self) -> list[torch.Tensor] | None:
        """The state dict's values now (see the class docstring), or None when the tree changed."""
        order = self._order
        attributes = list(map(vars, order))
        if list(map(len, attributes)) != self._attributes or list(map(type, order)) != self._types:
            return None
        try:  # each module's containers, read from its __dict__ in one call each (one missing: changed)
            params, buffers, children, non_persistent, post_hooks, pre_hooks = zip(
                *map(_FIELDS, attributes), strict=True
            )
        except KeyError:
            return None
        if (
            any(pre_hooks)
            or any(post_hooks)
            or list(non_persistent) != self._non_persistent
            or list(map(len, children)) != self._child_counts
            or list(_chain(children)) != self._child_names
        ):
            return None
        modules = list(_chain(map(dict.values, children)))
        if len(modules) != len(self._children) or not all(map(operator.is_, modules, self._children)):
            return None
        dicts = list(_chain(zip(params, buffers, strict=True)))
        if list(map(len, dicts)) != self._counts or list(_chain(dicts)) != self._names:
            return None
        values = list(_chain(map(dict.values, dicts)))
        if _none_mask(values) != self._nones:
            return None
        if self._keep is not None:
            values = list(map(values.__getitem__, self._keep))
        return values


def _none_mask(values: list[Any]) -> list[bool]:
    return list(map(operator.is_, values, itertools.repeat(None)))
