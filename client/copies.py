"""Copying a flattened state into a buffer: every tensor into its place, in one call per group of tensors.

The copies go through ``torch._foreach_copy_``: a single call from Python that loops over the tensors in C++ with
the GIL released, so copying a thousand tensors costs the calling thread microseconds of Python and leaves the
interpreter to other threads meanwhile (a Python loop of ``copy_`` calls held the GIL once per tensor, and on a
busy training thread waited for it each time).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from collections.abc import Sequence

import torch

from snapshotd.snapshot_format import TORCH_DTYPES, Layout, check_buffer

from .state import FlatState

__all__ = ["copy_into", "copy_tensors", "dst_views"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def copy_tensors(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, non_blocking: bool = False
) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``, in one call (see the module docstring; a single tensor, the common
    synchronous group, with ``copy_`` itself, which costs a few times less), outside autograd (a source may be a
    parameter that requires grad: then under ``no_grad``, whose entry and exit cost more than such a copy)."""
    if not dst:
        return
    grad = torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, src))
    with torch.no_grad() if grad else contextlib.nullcontext():
        if len(dst) == 1:
            dst[0].copy_(src[0], non_blocking=non_blocking)
        else:
            torch._foreach_copy_(list(dst), list(src), non_blocking=non_blocking)


class _DstViews:
    """Typed views of a destination buffer, one per entry, kept as long as that buffer object lives.

    Building views costs more than copying a small tensor, and a Snapshotter copies into the same few slots
    every step with an unchanged layout. Views are cached per ``dst`` object (by id, confirmed by a weak
    reference and the data pointer) and dropped by a finalizer when ``dst`` is collected, so they never keep
    memory alive longer than ``dst`` itself does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], int, Layout, list[torch.Tensor | None]]] = {}

    def get(self, flat: FlatState, dst: torch.Tensor) -> list[torch.Tensor | None]:
        key, ptr = id(dst), dst.data_ptr()
        with self._lock:
            hit = self._cache.get(key)
        alive = hit is not None and hit[0]() is dst
        if alive and hit[1] == ptr and (hit[2] is flat.layout or hit[2] == flat.layout):  # type: ignore
            return hit[3]  # type: ignore
        views = [
            dst[e.offset : e.offset + e.nbytes].view(TORCH_DTYPES[e.dtype]).view(e.shape)
            if e.nbytes
            else None
            for e in flat.entries
        ]
        ref = weakref.ref(dst)
        with self._lock:
            self._cache[key] = (ref, ptr, flat.layout, views)
        if not alive:
            weakref.finalize(dst, self._drop, key, ref)
        return views

    def _drop(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] is ref:
                del self._cache[key]


_dst_views = _DstViews()


def dst_views(flat: FlatState, dst: torch.Tensor) -> list[torch.Tensor | None]:
    """Typed views of ``dst``, one per entry of ``flat`` (None for an empty tensor), cached while ``dst`` lives.

    Raises:
        ValueError: ``dst`` is not a buffer :func:`copy_into` takes.
    """
    check_buffer(dst, flat.data_bytes, "dst")
    return _dst_views.get(flat, dst)


def copy_into(
    flat: FlatState, dst: torch.Tensor, *, only: Sequence[int] | None = None, non_blocking: bool = False
) -> None:
    """Copy every tensor of ``flat`` into ``dst[offset : offset + nbytes]``: any strides, no intermediate copy.

    Args:
        flat: from :func:`~.state.flatten`; its tensors are read now.
        dst: a contiguous 1-D uint8 CPU tensor (e.g. a view of a shared-memory slot) of at least
            ``flat.data_bytes`` bytes, starting at a multiple of 16 bytes of its storage. Bytes between
            entries are left as they are. Views of it are cached while this tensor object lives: pass the same
            object every step.
        only: indices into ``flat.tensors`` to copy (default: all).
        non_blocking: passed to ``copy_`` (CUDA sources into page-locked ``dst``; call on the copy stream).

    Raises:
        ValueError: if ``dst`` is not such a tensor.
    """
    views = dst_views(flat, dst)
    picked = [i for i in (range(len(views)) if only is None else only) if views[i] is not None]
    copy_tensors([views[i] for i in picked], [flat.tensors[i] for i in picked], non_blocking=non_blocking)  # type: ignore[misc]
