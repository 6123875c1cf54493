"""Flattening the same state capture after capture: :class:`StateWalker`.

A full walk (:func:`~.state.flatten`) costs a few microseconds per tensor in Python, which at a thousand tensors
passes a millisecond on the training thread. The walker reuses what the last capture found where a value's
structure did not change, with the same result byte for byte (see :class:`StateWalker`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import torch

from snapshotd.snapshot_format import PLAIN, SCALAR_TYPES, STATEFUL, Path, is_stateful

from .module_tree import ModuleTree
from .optimizer_tree import OptimizerTree
from .rng import RNGState
from .state import FlatState, TableCache, Walk, array_header, check_key, finish, map_header, top_part

__all__ = ["StateWalker"]

_SHAPE, _DTYPE, _GRAD, _LAYOUT, _META = (
    operator.attrgetter(a) for a in ("shape", "dtype", "requires_grad", "layout", "is_meta")
)
_ALIAS = operator.attrgetter("data")
"""A tensor's plain alias (its storage and view, no autograd): all a copy needs of ``detach()``, made faster."""
_OPTIMIZER_KEYS = ("state", "param_groups")
_OPTIMIZER_HEAD = b"\x82" + msgpack.packb("state")
_GROUPS_KEY = msgpack.packb("param_groups")


FULL_CHECK_EVERY = 64
"""Captures between two full reads of an optimizer's moments (see :class:`StateWalker`)."""
_IMMUTABLE = SCALAR_TYPES | {int}
_MAX_KEYS = 64
"""The most key packings one :class:`_Entries` keeps."""


class _Entries:
    """A dict packed entry by entry, as msgpack packs it whole (a map's header, then each key and value packed in
    order): an entry whose value is the very object of the last packing, and one that cannot have changed since
    (``reusable``), is taken as it was packed then. Its keys must be str (the caller checks)."""

    __slots__ = ("_keys", "_last")

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, bytes]] = {}
        self._keys: dict[str, bytes] = {}
        """Each key's packing."""

    def pack(
        self, d: dict[str, Any], walk: Walk, keys: Path, reusable: Callable[[str, Any], bool], *, owned: bool
    ) -> bytes:
        """The packing of ``d`` (``keys``: its path), its tensors added to ``walk`` (as ``walk.owned`` too with
        ``owned``: fresh copies nothing else holds). A value holding tensors is never reused."""
        last, memo = self._last, {}
        out = [map_header(len(d))]
        for k, v in d.items():
            hit = last.get(k)
            if hit is not None and hit[0] is v:
                pair = hit[1]
            else:
                count = len(walk.tensors)
                head = self._keys.get(k)
                if head is None:
                    head = msgpack.packb(k)
                    if len(self._keys) < _MAX_KEYS:
                        self._keys[k] = head
                pair = head + msgpack.packb(walk.value(v, (*keys, k)))
                if len(walk.tensors) != count:
                    if owned:
                        walk.owned.extend(range(count, len(walk.tensors)))
                    out.append(pair)
                    continue
                if not reusable(k, v):
                    out.append(pair)
                    continue
            memo[k] = (v, pair)
            out.append(pair)
        self._last = memo
        return b"".join(out)


def _immutable(v: Any) -> bool:
    """Whether ``v`` is a scalar or a tuple of scalars (a value that cannot change while it is the same object)."""
    t = type(v)
    return t in _IMMUTABLE or (t is tuple and set(map(type, v)) <= _IMMUTABLE)


def _pack_groups(memo: _Memo, groups: Any, walk: Walk, key: str, from_tree: bool) -> bytes:
    """The packing of an optimizer's ``param_groups``, as the full walk packs them: group by group, entry by
    entry, where each is a dict with str keys, reusing a scalar or tuple of scalars that is the very object packed
    last time and, read from the optimizer tree (``from_tree``), its own index list under ``"params"``."""
    if type(groups) is not list or not all(type(g) is dict and set(map(type, g)) <= {str} for g in groups):
        memo.groups = []
        return msgpack.packb(walk.value(groups, (key, "param_groups")))  # type: ignore[no-any-return]
    if len(memo.groups) != len(groups):
        memo.groups = [_Entries() for _ in groups]

    def reusable(k: str, v: Any) -> bool:
        return _immutable(v) or (from_tree and k == "params")

    return array_header(len(groups)) + b"".join(
        entries.pack(g, walk, (key, "param_groups", n), reusable, owned=False)
        for n, (entries, g) in enumerate(zip(memo.groups, groups, strict=True))
    )


def _steps_under_no_grad(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> bool:
    """Whether ``optimizer``'s step updates its state under ``no_grad``: a step of torch's own optimizers (they
    enter ``no_grad`` unless differentiable), not differentiable (``groups``: its param groups as read)."""
    return (
        getattr(type(optimizer).step, "__module__", "").startswith("torch.optim.")
        and not optimizer.defaults.get("differentiable")
        and not any(g.get("differentiable") for g in groups)
    )


def _rng_entry(name: str, v: Any) -> bool:
    return type(v) is tuple  # RNGState's tuples are immutable (its NumPy key array read-only)


@dataclasses.dataclass(slots=True)
class _Memo:
    """What the last walk of one top-level Stateful found, for a state dict of one of two shapes: ``tensors`` (a
    mapping of tensors, as a module's) or ``optimizer`` (``{"state": {index: {name: tensor}}, "param_groups":
    [...]}``, as a ``torch.optim.Optimizer``'s once every parameter has its state)."""

    kind: str
    sd_type: type[Any]
    keys: tuple[Any, ...]
    """The state dict's keys (``optimizer``: those of its ``state``)."""
    inner: list[tuple[Any, ...]]
    """``optimizer``: the keys of each parameter's state."""
    start: int
    """The table index of its first tensor."""
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    specs: list[tuple[Path, str, tuple[int, ...]]]
    packed: bytes
    """msgpack of its tree (``optimizer``: of its ``state``)."""
    last: list[torch.Tensor]
    """The tensors it last matched, as found in the state dict."""
    grad: bool
    """Some of the tensors last read for requires_grad required it (read by :meth:`StateWalker._remember` and
    :meth:`StateWalker._reuse`; the module-tree path aliases every tensor and reads none)."""
    tree: ModuleTree | None = None
    """``tensors`` of a module whose state dict can be read from its tree (see :class:`~.module_tree.ModuleTree`)."""
    tree_changed: bool = False
    """The tree no longer matched at this capture."""
    optimizer: OptimizerTree | None = None
    """``optimizer`` of a ``torch.optim.Optimizer`` whose state dict can be read from it (see
    :class:`~.optimizer_tree.OptimizerTree`)."""
    groups: list[_Entries] = dataclasses.field(default_factory=list)
    """``optimizer``: how each of its param groups was last packed."""

    def same(self, tensors: list[Any]) -> bool:
        """Whether ``tensors`` are the very objects last matched, in order."""
        return len(tensors) == len(self.last) and all(map(operator.is_, tensors, self.last))

    def matches(self, tensors: list[Any]) -> bool:
        """Whether ``tensors`` are plain strided tensors or parameters of the dtypes and shapes seen, off the meta
        device (C-level loops only; where they live is the stager's business). Their dtypes and shapes are read
        every time: ``module.to()`` and ``param.data = ...`` change a parameter's in place."""
        if len(tensors) != len(self.dtypes):
            return False
        if not self.same(tensors) and not _plain_tensors(tensors):
            return False
        if list(map(_DTYPE, tensors)) != self.dtypes or list(map(_SHAPE, tensors)) != self.shapes:
            return False
        self.last = tensors
        return True


_PLAIN_TYPES = {torch.Tensor, torch.nn.Parameter}


def _plain_tensors(values: list[Any]) -> bool:
    """Whether every one of ``values`` is a plain strided tensor or parameter (no subclass, no DTensor) off the meta
    device (C-level loops only)."""
    return not values or (
        set(map(type, values)) <= _PLAIN_TYPES
        and set(map(_LAYOUT, values)) == {torch.strided}
        and not any(map(_META, values))
    )


class StateWalker:
    """Flattens the same state capture after capture, like :func:`flatten`, with the same result byte for byte.

    A full walk costs a few microseconds per tensor in Python, which at a thousand tensors passes a millisecond
    on the training thread. Between two steps the big values keep their structure: a module's state dict names
    the same tensors, an optimizer's per-parameter state holds the same moments. For each top-level Stateful
    whose state dict has one of those shapes, the walker keeps the packed bytes of its tensor part and its table
    rows, and the next capture checks the new state dict against them with C-level loops over its tensors (type,
    dtype, shape) instead of walking it. Every other value, and one whose check fails, is walked in full.

    One thing is taken on trust between two full checks (every :data:`FULL_CHECK_EVERY` captures): one of
    torch's own optimizers (its ``step`` defined in ``torch.optim``) read from its tree (see
    :class:`~.optimizer_tree.OptimizerTree`) and not differentiable updates its moments in place under
    ``no_grad``, so while they are the very objects of the last capture, their dtypes, shapes and requires_grad
    are those read then. Code outside the optimizer that replaces a moment's
    ``.data``, calls ``set_()``, ``resize_()`` or ``requires_grad_()`` on it, or updates it in place with an
    operand that requires grad, is seen at the next full check or once a moment object is replaced.
    """

    def __init__(self) -> None:
        self._memos: dict[str, _Memo] = {}
        self._rng: dict[str, _Entries] = {}
        self._table: TableCache | None = None
        self._captures = 0

    def flatten(self, state: Mapping[str, Any]) -> FlatState:
        """:func:`~.state.flatten` of ``state`` (same arguments, result and errors)."""
        walk = Walk()
        parts = []
        self._captures += 1
        for key, value in state.items():
            check_key(key)
            if not isinstance(value, torch.Tensor) and is_stateful(value):
                parts.append(top_part(key, STATEFUL, self._stateful(key, value, walk)))
            else:
                self._memos.pop(key, None)
                self._rng.pop(key, None)
                parts.append(top_part(key, PLAIN, msgpack.packb(walk.value(value, (key,)))))
        for gone in [k for k in (*self._memos, *self._rng) if k not in state]:  # nothing kept alive for them
            self._memos.pop(gone, None)
            self._rng.pop(gone, None)
        flat, self._table = finish(walk, parts, self._table)
        return flat

    def _stateful(self, key: str, value: Any, walk: Walk) -> bytes:
        """The packed state dict of ``value``: read from its module tree, reused from its memo, or walked."""
        if type(value) is RNGState:
            self._memos.pop(key, None)
            return self._generators(key, value.state_dict(), walk)
        self._rng.pop(key, None)
        packed = self._reuse_tree(key, value, walk)
        if packed is not None:
            return packed
        sd = self._read_optimizer(key, value)
        fresh = sd is None
        if fresh:
            sd = value.state_dict()
        packed = self._reuse(key, sd, walk, from_tree=not fresh)
        if packed is None:
            return self._walk(key, sd, walk, value)
        memo = self._memos[key]
        if memo.tree_changed:  # the same state dict from a changed tree: read the tree anew
            memo.tree, memo.tree_changed = ModuleTree.of(value, memo.keys), False
        if fresh and memo.kind == "optimizer" and isinstance(value, torch.optim.Optimizer):
            memo.optimizer = OptimizerTree.of(value, sd)
        return packed

    def _generators(self, key: str, sd: dict[str, Any], walk: Walk) -> bytes:
        """The packed state dict ``sd`` of an :class:`RNGState`, entry by entry: a generator's tuple that is the
        very object of the last capture (the generator has not moved) as it was packed then. Its tensors are fresh
        copies: owned."""
        entries = self._rng.get(key)
        if entries is None:
            entries = self._rng[key] = _Entries()
        return entries.pack(sd, walk, (key,), _rng_entry, owned=True)

    def _read_optimizer(self, key: str, value: Any) -> Any:
        """The state dict of optimizer ``value`` read from the memo of ``key``'s optimizer tree, without calling
        ``state_dict()``; None when there is no such tree or it no longer matches (it is then let go of)."""
        memo = self._memos.get(key)
        if memo is None or memo.optimizer is None:
            return None
        sd = memo.optimizer.state_dict() if memo.optimizer.optimizer is value else None
        if sd is None:
            memo.optimizer = None
        return sd

    def _reuse_tree(self, key: str, value: Any, walk: Walk) -> bytes | None:
        """The packed tree of module ``value``'s state dict from the memo of ``key``, read from the module tree
        without calling ``state_dict()``; None when there is no such memo or the tree no longer matches it."""
        memo = self._memos.get(key)
        if memo is None or memo.tree is None or memo.start != len(walk.tensors):
            return None
        tensors = memo.tree.tensors() if memo.tree.module is value else None
        if tensors is None:  # let go of the tree (a module replaced is not kept alive by it)
            memo.tree, memo.tree_changed = None, True
            return None
        if not memo.matches(tensors):
            return None
        # aliases without autograd, as state_dict() detaches them (see FlatState.tensors); nothing writes to them
        walk.tensors.extend(map(_ALIAS, tensors))
        walk.specs.extend(memo.specs)
        return memo.packed

    def _reuse(self, key: str, sd: Any, walk: Walk, *, from_tree: bool) -> bytes | None:
        """The packed tree of ``sd`` from the memo of ``key``, its tensors added to ``walk``; None when ``sd`` no
        longer matches it. ``from_tree``: ``sd`` was read from the memo's optimizer tree."""
        memo = self._memos.get(key)
        if memo is None or memo.start != len(walk.tensors) or type(sd) is not memo.sd_type:
            return None
        if memo.kind == "tensors":
            if len(sd) != len(memo.keys) or tuple(sd) != memo.keys:
                return None
            tensors = list(sd.values())
        else:
            if tuple(sd) != _OPTIMIZER_KEYS:
                return None
            st = sd["state"]
            if type(st) is not dict or tuple(st) != memo.keys:
                return None
            inner = list(st.values())
            if inner and set(map(type, inner)) != {dict}:
                return None
            if list(map(tuple, inner)) != memo.inner:
                return None
            tensors = list(itertools.chain.from_iterable(map(dict.values, inner)))
        trusted = (
            memo.optimizer is not None
            and from_tree
            and self._captures % FULL_CHECK_EVERY
            and _steps_under_no_grad(memo.optimizer.optimizer, sd["param_groups"])
        )
        if not (trusted and memo.same(tensors)):
            if not memo.matches(tensors):
                return None
            memo.grad = any(map(_GRAD, tensors))
        # else the very moments of a torch optimizer's last capture, which its step updates in place under no_grad:
        # taken with the dtypes, shapes and requires_grad read then (see the class docstring)
        if memo.grad:  # a Stateful's own parameters (see FlatState.tensors)
            tensors = [t.detach() if t.requires_grad else t for t in tensors]
        walk.tensors.extend(tensors)
        walk.specs.extend(memo.specs)
        if memo.kind == "tensors":
            return memo.packed
        groups = _pack_groups(memo, sd["param_groups"], walk, key, from_tree)
        return _OPTIMIZER_HEAD + memo.packed + _GROUPS_KEY + groups

    def _walk(self, key: str, sd: Any, walk: Walk, value: Any) -> bytes:
        """Walk ``sd`` (the state dict of ``value``) in full, remembering it when it has one of the memo's
        shapes; its packed tree."""
        self._memos.pop(key, None)
        start = len(walk.tensors)
        if type(sd) is dict and tuple(sd) == _OPTIMIZER_KEYS and type(sd["state"]) is dict:
            st = sd["state"]
            inner = list(st.values())
            state_tree = walk.value(st, (key, "state"))
            packed = msgpack.packb(state_tree)
            found = (
                list(itertools.chain.from_iterable(map(dict.values, inner)))
                if all(type(d) is dict for d in inner)
                else None
            )
            if found is not None and _plain_tensors(found):
                self._remember(
                    "optimizer", key, sd, list(st), [tuple(d) for d in inner], found, start, walk, packed
                )
                if isinstance(value, torch.optim.Optimizer):
                    self._memos[key].optimizer = OptimizerTree.of(value, sd)
            groups = walk.value(sd["param_groups"], (key, "param_groups"))
            return _OPTIMIZER_HEAD + packed + _GROUPS_KEY + msgpack.packb(groups)
        packed = msgpack.packb(walk.value(sd, (key,)))
        found = list(sd.values()) if type(sd) in (dict, collections.OrderedDict) else None
        if found is not None and _plain_tensors(found):
            self._remember("tensors", key, sd, list(sd), [], found, start, walk, packed)
            if isinstance(value, torch.nn.Module):
                self._memos[key].tree = ModuleTree.of(value, tuple(sd))
        return packed

    def _remember(
        self,
        kind: str,
        key: str,
        sd: Any,
        keys: list[Any],
        inner: list[tuple[Any, ...]],
        found: list[torch.Tensor],
        start: int,
        walk: Walk,
        packed: bytes,
    ) -> None:
        """Remember the walk of ``sd`` just done: ``found``, its tensors as found in it, were added to ``walk``
        from ``start`` on."""
        tensors = walk.tensors[start:]
        self._memos[key] = _Memo(
            kind,
            type(sd),
            tuple(keys),
            inner,
            start,
            list(map(_DTYPE, tensors)),
            list(map(_SHAPE, tensors)),
            walk.specs[start:],
            packed,
            found,
            any(map(_GRAD, found)),
        )
