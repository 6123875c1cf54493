"""DDP's gradient bucket layout, carried in every snapshot so that a restarted process reduces exactly as before.

``DistributedDataParallel`` all-reduces gradients in flat buckets. In a new process its first iteration puts the
parameters in DDP's initial layout; after that iteration the reducer rebuilds the buckets once, in the order the
gradients became ready, and keeps that layout. Where a parameter sits in a bucket decides the order in which the
backend sums its elements across ranks (gloo's ring reduces each chunk of a bucket starting from another rank),
and float addition is not associative. So a process restarted from step ``s`` would run step ``s + 1`` in the
initial layout while the uninterrupted run used the rebuilt one, and from there the trajectories differ in the
last bits (with three or more ranks).

:class:`DDPBuckets` is the Stateful that the :class:`~snapshotd.client.Snapshotter` adds to every snapshot of a
state holding modules. Its state dict names, for each DDP module found in the state, the bucket layout its next
iteration will use: ``None`` for DDP's initial layout, else a list of buckets, each a list of indices into the
reducer's parameters (DDP's own order: ``DistributedDataParallel._build_params_for_reducer``). On restore it
gives each live DDP module that layout, rebuilding the reducer as DDP itself does (``_ddp_init_helper``, the
code path of DDP's constructor and of its ``__setstate__``) with the snapshot's bucket assignment. The
rebuilt reducer has not "rebuilt its buckets" in DDP's sense, so after its first iteration it rebuilds them
once more, from the same gradient-ready order, into the same layout.

A DDP module is found as a value of the state, as a submodule of one, or as the wrapper whose ``.module`` a value
of the state is (searched among live objects when the Snapshotter is built, and at each ``restore()`` of a
snapshot that names a DDP module: a model wrapped again since is found).
If a snapshot names a DDP module that the live state does not have (the model is wrapped only after
``restore()``), the restore fails with :class:`~snapshotd.client.ConfigMismatch` saying so, rather than
drifting silently.

This relies on DDP internals of torch 2.x (``reducer._rebuild_buckets``, ``reducer._get_zeros_like_grad_buckets``,
``_ddp_init_helper``, ``_comm_hooks``); what cannot be carried over to a new reducer (a built-in C++ comm hook,
``delay_all_reduce_named_params``) is refused with :class:`~snapshotd.client.ConfigMismatch` naming it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from snapshotd.snapshot_format import DDP_KEY

from .errors import ConfigMismatch

__all__ = ["DDP_KEY", "DDPBuckets", "find_ddp_modules", "rebuild_reducer"]

log = logging.getLogger(__name__)

Layout = list[list[int]]


def _ddp_class() -> type | None:
    if not dist.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def find_ddp_modules(state: Mapping[str, Any]) -> dict[str, Any]:
    """The DDP modules of ``state`` by where they are: ``"key"`` or ``"key.submodule.path"``.

    A value that is a DDP module or holds DDP submodules contributes those; a module value with none inside
    contributes the live DDP module wrapping it, if there is one (found among all live objects, so call this
    rarely: it costs a walk over the garbage collector's objects).
    """
    ddp_cls = _ddp_class()
    if ddp_cls is None:
        return {}
    found: dict[str, Any] = {}
    unwrapped: dict[str, torch.nn.Module] = {}
    for key, value in state.items():
        if not isinstance(value, torch.nn.Module):
            continue
        inside = {
            f"{key}.{name}" if name else key: sub
            for name, sub in value.named_modules()
            if isinstance(sub, ddp_cls)
        }
        if inside:
            found.update(inside)
        else:
            unwrapped[key] = value
    if unwrapped:
        found.update(_wrappers_of(unwrapped, ddp_cls))
    return found


def _wrappers_of(unwrapped: Mapping[str, torch.nn.Module], ddp_cls: type) -> dict[str, Any]:
    """The live DDP modules wrapping the modules of ``unwrapped`` (where in the state -> module), by where.

    DDP keeps the module it wraps as its submodule ``"module"``, in a dict. A walk in C over the collector's
    objects for the wrapped modules' referrers tells whether any dict holds one so; only then are all live objects
    looked through for the wrappers. ``type()`` and a set of the DDP classes, not ``isinstance()``: some module
    proxies warn on ``__class__``, and DDP is an ABC (Joinable), whose subclass check is slow.
    """
    where = {id(module): key for key, module in unwrapped.items()}
    if not any(
        isinstance(obj, dict) and id(obj.get("module")) in where
        for obj in gc.get_referrers(*unwrapped.values())
    ):
        return {}
    ddp_types = _subclasses(ddp_cls)
    found: dict[str, Any] = {}
    for obj in gc.get_objects():
        if type(obj) in ddp_types and id(obj.module) in where:
            found.setdefault(where[id(obj.module)], obj)
    return found


def _subclasses(cls: type) -> set[type]:
    """``cls`` and every class derived from it (defined so far)."""
    found: set[type] = {cls}
    todo: list[type] = [cls]
    while todo:
        sub: type
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _reducer_params(ddp: Any) -> list[torch.Tensor]:
    params, _ = ddp._build_params_for_reducer()
    return params


def _read_layout(ddp: Any) -> Layout:
    """The reducer's current buckets as indices into its parameters.

    Reads them from :meth:`Reducer._get_zeros_like_grad_buckets`, which allocates (and at once frees) one
    zeroed buffer per bucket, as much memory as the gradients: call it once per rebuild, not per step.
    """
    index = {id(p): i for i, p in enumerate(_reducer_params(ddp))}
    return [
        [index[id(p)] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()
    ]


@contextlib.contextmanager
def _bucket_assignment(params: list[torch.Tensor], layout: Layout) -> Iterator[None]:
    """While open, DDP's bucket assignment of exactly ``params`` (the list object) is ``layout``.

    ``_ddp_init_helper`` computes the initial assignment with ``torch.distributed._compute_bucket_assignment_by_size``
    and gives it to the reducer reversed; this hands it ``layout`` reversed instead. Calls for any other list
    of parameters go to torch's function.
    """
    original = dist._compute_bucket_assignment_by_size
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in layout]

    def assign(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if tensors is not params:
            return original(tensors, *args, **kwargs)
        return [list(b) for b in reversed(layout)], list(reversed(sizes))

    dist._compute_bucket_assignment_by_size = assign
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original


def _check_rebuildable(ddp: Any, where: str) -> None:
    if ddp.logger is None:  # released (DDPBuckets.release); its reducer was built, so checked, before
        return
    hook_name = ddp._get_ddp_logging_data().get("comm_hook")
    if hook_name and not ddp._comm_hooks:
        raise ConfigMismatch(
            f"{where}: DDP has the built-in comm hook {hook_name}, which snapshotd cannot carry over to "
            "the reducer it rebuilds to restore the gradient bucket layout; use register_comm_hook"
        )
    if getattr(ddp, "_delay_all_reduce_all_params", False) or getattr(ddp, "_delay_all_reduce_params", None):
        raise ConfigMismatch(
            f"{where}: DDP with delay_all_reduce_named_params cannot have its bucket layout restored"
        )


def rebuild_reducer(ddp: Any, layout: Layout | None, where: str) -> None:
    """Give ``ddp`` a new reducer whose buckets are ``layout`` (DDP's initial layout for None), as DDP's
    constructor builds one; comm hooks, static graph and mixed precision are carried over. ``ddp`` may have no
    reducer (see :meth:`DDPBuckets.release`)."""
    _check_rebuildable(ddp, where)
    params, sparse = ddp._build_params_for_reducer()
    if layout is not None:
        flat = sorted(i for bucket in layout for i in bucket)
        if flat != list(range(len(params))):
            raise ConfigMismatch(
                f"{where}: the snapshot's DDP bucket layout covers parameters {flat[:8]}... but the "
                f"live reducer has {len(params)} parameters: not the same model"
            )
    names = ddp._build_debug_param_to_name_mapping(params)
    if ddp.reducer is not None:
        ddp.reducer._remove_autograd_hooks()
    with _bucket_assignment(params, layout) if layout is not None else contextlib.nullcontext():
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    if ddp.mixed_precision is not None:
        ddp.reducer._set_mixed_precision_param_dtype(ddp.mixed_precision.param_dtype)
    for hook, hook_state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, hook_state, hook)
    ddp._has_rebuilt_buckets = False


class DDPBuckets:
    """A Stateful over the DDP modules of a state: their gradient bucket layouts (see the module docstring).

    Args:
        state: the user's state mapping (the one given to the Snapshotter).
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._state = state
        self._modules = find_ddp_modules(state)
        self._known: dict[str, tuple[Any, bool, Layout | None]] = {}
        """where -> (reducer, whether DDP had rebuilt it, its layout) as last read or set."""

    @property
    def modules(self) -> dict[str, Any]:
        """The DDP modules found (where in the state -> module), as of the last :meth:`rediscover`."""
        return self._modules

    def release(self) -> None:
        """Let go of the process group: forget the reducers read, and drop each DDP module's reducer (its autograd
        hooks removed) and logger, which hold the group alive, until :func:`rebuild_reducer` builds new ones.

        A gloo group's connections close only when the group is destroyed, and its event loop spins on a
        connection shut while bytes it has not asked for wait on it (a hang-up cannot be masked out of
        ``epoll``): kept alive, a broken group costs a live-mode survivor a core for as long as it waits for the
        new membership.
        """
        self._known.clear()
        for ddp in self._modules.values():
            if ddp.reducer is not None:
                ddp.reducer._remove_autograd_hooks()
            ddp.reducer = ddp.logger = ddp.process_group = None

    def rediscover(self) -> None:
        """Look for the state's DDP modules again (a model may have been wrapped since)."""
        self._modules = find_ddp_modules(self._state)

    def _layout(self, where: str, ddp: Any) -> Layout | None:
        """The layout ``ddp``'s next iteration uses; a rebuild that the next forward would do is done now."""
        if not ddp._has_rebuilt_buckets and ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True
        reducer, rebuilt = ddp.reducer, ddp._has_rebuilt_buckets
        known = self._known.get(where)
        if known is not None and known[0] is reducer and known[1] == rebuilt:
            return known[2]
        if rebuilt:
            layout: Layout | None = _read_layout(ddp)
            if known is not None and known[0] is reducer and known[2] is not None and known[2] != layout:
                log.warning(
                    "%s: DDP rebuilt its gradient buckets into another layout than the snapshot's: the "
                    "gradient-ready order changed, so this run may differ from the original in the last "
                    "bits",
                    where,
                )
        else:
            layout = known[2] if known is not None and known[0] is reducer else None
        self._known[where] = (reducer, rebuilt, layout)
        return layout

    def state_dict(self) -> dict[str, Layout | None]:
        return {where: self._layout(where, ddp) for where, ddp in self._modules.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Give each live DDP module the layout the snapshot names for it.

        The live DDP modules are looked for again when the snapshot names any (a model wrapped in DDP after the
        state was handed over, or wrapped anew since, is found; see :func:`find_ddp_modules` for what that costs);
        a restore of a snapshot without DDP looks for none.

        Raises:
            ConfigMismatch: the snapshot names a DDP module the live state lacks, a layout that does not fit the
                live model, or a DDP setup whose reducer cannot be rebuilt.
            ValueError: a malformed layout.
        """
        if state_dict:
            self.rediscover()
        for where, layout in state_dict.items():
            ddp = self._modules.get(where)
            if ddp is None:
                raise ConfigMismatch(
                    f"state[{where!r}]: the snapshot was taken of a model wrapped in DistributedDataParallel, and "
                    "the live state has no DDP module there. Wrap the model in DDP before restore(): the snapshot "
                    "carries DDP's gradient bucket layout, without which the restored run would sum gradients in "
                    "another order and differ in the last bits"
                )
            if not (
                layout is None
                or (
                    isinstance(layout, list)
                    and all(isinstance(b, list) and all(type(i) is int for i in b) for b in layout)
                )
            ):
                raise ValueError(f"state[{where!r}]: malformed DDP bucket layout in the snapshot")
            if self._layout(where, ddp) != layout:
                rebuild_reducer(ddp, layout, f"state[{where!r}]")
                self._known[where] = (ddp.reducer, False, layout)
                log.info(
                    "%s: DDP gradient buckets set to the snapshot's layout (%s buckets)",
                    where,
                    "initial" if layout is None else len(layout),
                )
        for where in self._modules.keys() - state_dict.keys():
            log.warning(
                "state[%r]: a DDP module the snapshot did not know (it was wrapped after the snapshotted run "
                "started); its gradient buckets stay as they are",
                where,
            )
