"""Staging: getting a rank's tensors into a shared-memory slot without stalling the training step.

The fence contract: tensors that only ``optimizer.step()`` changes (parameters and optimizer state of the
optimizers found in the state) are copied asynchronously, overlapping the next forward and backward; a step
pre-hook on each such optimizer waits for that copy before the optimizer may change them. Every other tensor
(module buffers such as running statistics, plain tensors the user passed) may change at any time, so it is
copied synchronously inside ``capture()``; but one that nothing else holds (a fresh copy, as the generator states
of :class:`~.rng.RNGState`: ``FlatState.owned``) cannot change and is copied in the background too. With no
optimizer in the state there is no fence, so everything else is copied synchronously.

- CPU tensors: the copy runs on the client's one background thread (:class:`~.channel.Channel`).
- CUDA tensors: ``non_blocking`` copies on a side stream into the arena, which is page-locked with
  ``cudaHostRegister``; the side stream first waits for the training stream. CUDA tensors that may change at any
  time are copied first, and the training stream waits for that copy at once; the fence makes it wait for the
  rest. Both are GPU-side waits: the CPU does not block in ``capture()``. The announce to the sidecar is sent once
  the whole copy has completed.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from snapshotd.proto import Announce
from snapshotd.proto.limits import MAX_SLOTS
from snapshotd.shm import Arena

from .channel import Channel
from .copies import copy_tensors, dst_views
from .state import FlatState

__all__ = ["Stager"]

log = logging.getLogger(__name__)


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "to_local", None)
    if callable(local):  # DTensor: its local shard
        t = local()
    return t.untyped_storage().data_ptr()


_IS_CUDA = operator.attrgetter("is_cuda")
DEVICE_CHECK_EVERY = 64
"""Captures between two full reads of where each tensor lives (see :meth:`Stager._plan`)."""


def _picker(indices: list[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """A function taking the items at ``indices`` of a sequence, in one C-level call."""
    if not indices:
        return lambda items: []
    get = operator.itemgetter(*indices)
    if len(indices) == 1:
        return lambda items: [get(items)]
    return lambda items: list(get(items))


class _Groups:
    """How one layout's tensors are copied: the index groups (see the module docstring), and each group's
    destination views per buffer."""

    def __init__(self, flat: FlatState, cuda: list[bool], safe: list[bool]) -> None:
        self.layout = flat.layout
        self.owned = flat.owned
        self.cuda = cuda
        idx = [i for i, e in enumerate(flat.entries) if e.nbytes]  # an empty tensor has nothing to copy
        self.sync = [i for i in idx if not safe[i] and not cuda[i]]
        self.cpu_async = [i for i in idx if safe[i] and not cuda[i]]
        self.cuda_mutable = [i for i in idx if not safe[i] and cuda[i]]
        self.cuda_safe = [i for i in idx if safe[i] and cuda[i]]
        self.pick = {
            name: _picker(getattr(self, name)) for name in ("sync", "cpu_async", "cuda_mutable", "cuda_safe")
        }
        self._views: dict[int, tuple[torch.Tensor, dict[str, list[torch.Tensor]]]] = {}

    def views(self, flat: FlatState, dst: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Each group's destination views in ``dst``."""
        hit = self._views.get(id(dst))
        if hit is not None and hit[0] is dst:
            return hit[1]
        views = dst_views(flat, dst)
        grouped = {name: pick(views) for name, pick in self.pick.items()}
        if len(self._views) >= MAX_SLOTS:  # the buffers of an arena since replaced: never used again
            self._views.clear()
        self._views[id(dst)] = (dst, grouped)
        return grouped

    def sources(
        self, flat: FlatState, name: str, views: dict[str, list[torch.Tensor]]
    ) -> tuple[list[Any], list[Any]]:
        """(destinations, sources) of group ``name``."""
        return views[name], self.pick[name](flat.tensors)


class _Copy:
    """One staging copy in flight: done when the CPU part finished and the CUDA event (if any) completed; the
    CUDA part's time runs from ``cuda_started`` to ``cuda_event`` on the side stream. The CUDA part of the
    parameters and optimizer state is queued by the channel thread: ``cpu_done`` is set once it is queued."""

    def __init__(self, cuda_event: Any, cuda_started: Any) -> None:
        self.cpu_done = threading.Event()
        self.cuda_event = cuda_event
        self.cuda_started = cuda_started
        self.abandoned = False


class Stager:
    """Copies flattened state into slots and fences the optimizers of ``state`` against the copy in flight."""

    def __init__(self, state: Mapping[str, Any], stats: Any) -> None:
        self.state = state
        self.stats = stats
        self.optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        self._hooks = [opt.register_step_pre_hook(self._pre_hook) for opt in self.optimizers]
        self._inflight: _Copy | None = None
        self._safe_layout: Any = None
        self._safe: list[bool] = []
        self._owned: tuple[int, ...] = ()
        self._groups: _Groups | None = None
        self._captures = 0
        self._side_stream: Any = None
        self._last: _Copy | None = None  # the last copy, until the host has waited for its CUDA part
        self._pinned: list[int] = []

    def pin(self, arena: Arena) -> None:
        """Page-lock the arena for CUDA copies (no-op without CUDA, or when it is page-locked already)."""
        if not torch.cuda.is_available() or arena.slot_bytes == 0:
            return
        ptr = torch.frombuffer(arena.slot(0), dtype=torch.uint8).data_ptr()
        if ptr in self._pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(ptr, arena.slot_bytes * arena.slots, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of the arena failed (%s): CUDA copies will be slower", err)
            return
        self._pinned.append(ptr)

    def unpin(self, arena: Arena) -> None:
        """Undo :meth:`pin` before ``arena`` is unmapped (the host must have waited for every copy into it:
        :meth:`fence` with ``host``): the driver would otherwise keep a registration of memory that a later
        mapping may reuse."""
        if arena.slot_bytes == 0 or not self._pinned:
            return
        ptr = torch.frombuffer(arena.slot(0), dtype=torch.uint8).data_ptr()
        if ptr in self._pinned:
            self._pinned.remove(ptr)
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def _async_mask(self, flat: FlatState) -> list[bool]:
        """Which tensors only optimizer.step() changes, or nothing can (``flat.owned``); cached per layout."""
        if (
            flat.layout is self._safe_layout or flat.layout == self._safe_layout
        ) and flat.owned == self._owned:
            return self._safe
        safe: set[int] = set()
        if self.optimizers:
            for value in self.state.values():
                if isinstance(value, torch.nn.Module):
                    safe.update(_storage_ptr(p) for p in value.parameters())
            for opt in self.optimizers:
                for group in opt.param_groups:
                    safe.update(_storage_ptr(p) for p in group["params"])
                for per_param in opt.state.values():
                    safe.update(_storage_ptr(t) for t in per_param.values() if isinstance(t, torch.Tensor))
        self._safe = [bool(safe) and _storage_ptr(t) in safe for t in flat.tensors]
        for i in flat.owned:
            self._safe[i] = True
        self._safe_layout, self._owned = flat.layout, flat.owned
        return self._safe

    def _plan(self, flat: FlatState) -> _Groups:
        """The copy groups of ``flat``'s layout and devices (cached while both stay).

        Where each tensor lives is read in full when the layout changes and every :data:`DEVICE_CHECK_EVERY`
        captures, and otherwise for the first and last tensor only: a tensor copied in the wrong group is still
        copied correctly (a CUDA tensor in a CPU group with a blocking copy, a CPU one in a CUDA group with a
        plain one), only more slowly, until the next full read.
        """
        groups = self._groups
        self._captures += 1
        tensors = flat.tensors
        if (
            groups is not None
            and groups.layout is flat.layout
            and groups.owned == flat.owned
            and self._captures % DEVICE_CHECK_EVERY
            and (
                not tensors or (tensors[0].is_cuda, tensors[-1].is_cuda) == (groups.cuda[0], groups.cuda[-1])
            )
        ):
            return groups
        cuda = list(map(_IS_CUDA, tensors))
        if (
            groups is None
            or groups.layout is not flat.layout
            or groups.owned != flat.owned
            or groups.cuda != cuda
        ):
            groups = self._groups = _Groups(flat, cuda, self._async_mask(flat))
        return groups

    def stage(
        self,
        flat: FlatState,
        dst: torch.Tensor,
        channel: Channel,
        announce: Announce,
        on_abandon: Callable[[], None],
    ) -> None:
        """Copy ``flat`` into ``dst`` (partly now, partly in the background) and then send ``announce``.

        The caller must not start another stage before the previous one is fenced (the optimizer pre-hook does it
        every step; :meth:`fence` does it explicitly). If the fence times out, the copy is abandoned: no announce
        is sent and ``on_abandon`` runs, so a torn snapshot never leaves the process.
        """
        self.fence()
        groups = self._plan(flat)
        views = groups.views(flat, dst)
        t0 = time.perf_counter()
        copy_tensors(*groups.sources(flat, "sync", views))
        sync_seconds = time.perf_counter() - t0
        event = started = side = None
        if groups.cuda_mutable or groups.cuda_safe:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream()
            side = self._side_stream
            training = torch.cuda.current_stream()
            side.wait_stream(training)  # what the side stream copies from here on is the state as of now
            started = torch.cuda.Event(enable_timing=True)
            if groups.cuda_mutable:  # copied now: the training stream waits for these, not for the rest
                started.record(side)
                with torch.cuda.stream(side):
                    copy_tensors(*groups.sources(flat, "cuda_mutable", views), non_blocking=True)
                training.wait_event(side.record_event())  # a GPU-side wait: this thread goes on at once
            event = torch.cuda.Event(enable_timing=True)
        cuda_safe = groups.sources(flat, "cuda_safe", views) if groups.cuda_safe else None
        cpu_async = groups.sources(flat, "cpu_async", views) if groups.cpu_async else None
        job = _Copy(event, started)
        self._inflight = job
        self._last = job if event is not None else None

        def background() -> None:  # the one writer of stats.copy_seconds: the channel's thread
            seconds = sync_seconds
            failed = False
            try:
                if side is not None:  # queued behind the wait above: it copies the state as of capture()
                    assert started is not None and event is not None
                    with torch.cuda.device(side.device), torch.cuda.stream(side):
                        if not groups.cuda_mutable:
                            started.record(side)
                        if cuda_safe is not None:
                            copy_tensors(*cuda_safe, non_blocking=True)
                        event.record(side)
                t0 = time.perf_counter()
                if cpu_async is not None:
                    copy_tensors(*cpu_async)
                seconds += time.perf_counter() - t0
            except Exception:  # a copy that failed is never announced
                log.exception("snapshot copy failed; that snapshot is dropped")
                failed = True
            finally:
                job.cpu_done.set()
            if side is not None:
                if failed:  # copies queued before the failure may still write into the slot
                    side.synchronize()
                else:
                    job.cuda_event.synchronize()
                    seconds += job.cuda_started.elapsed_time(job.cuda_event) / 1e3
            self.stats.copy_seconds += seconds
            if job.abandoned or failed:
                on_abandon()
            else:
                channel.send_now(announce)

        channel.submit(background)

    def fence(self, timeout: float | None = 60.0, *, host: bool = False) -> None:
        """Wait for the copy in flight: its CPU part (and the queueing of its CUDA part) on this thread, its CUDA
        part as a GPU-side wait (kernels queued on the training stream from now on run after it). With ``host``,
        this thread also waits for the CUDA part of the last copy, fenced before or not: needed before the arena
        it writes into is unmapped, unregistered or handed back."""
        job = self._inflight
        if job is not None:
            self._inflight = None
            t0 = time.perf_counter()
            if not job.cpu_done.wait(timeout):
                job.abandoned = True
                log.warning("snapshot copy did not finish within %s s; abandoning that snapshot", timeout)
            elif job.cuda_event is not None:  # recorded by now: the channel thread queued the copy
                torch.cuda.current_stream().wait_event(job.cuda_event)
            self.stats.fence_seconds += time.perf_counter() - t0
        last = self._last
        if host and last is not None:
            self._last = None
            if last.cpu_done.wait(timeout):  # its CUDA part is queued (or never will be)
                last.cuda_event.synchronize()
            else:
                log.warning("the last snapshot copy was not queued within %s s", timeout)

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.fence()

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for ptr in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._pinned = []
