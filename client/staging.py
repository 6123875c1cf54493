"""Staging: getting a rank's tensors into a shared-memory slot without stalling the training step.

The fence contract: tensors that only ``optimizer.step()`` changes (parameters and optimizer state of the
optimizers found in the state) are copied asynchronously, overlapping the next forward and backward; a step
pre-hook on each such optimizer waits for that copy before the optimizer may change them. Every other tensor
(module buffers such as running statistics, plain tensors the user passed) may change at any time, so it is
copied synchronously inside ``capture()``. With no optimizer in the state there is no fence, so everything is
copied synchronously.

- CPU tensors: the copy runs on the client's one background thread (:class:`~.channel.Channel`).
- CUDA tensors: ``non_blocking`` copies on a side stream into the arena, which is page-locked with
  ``cudaHostRegister``; the side stream first waits for the training stream. CUDA tensors that may change at any
  time are copied first, and the training stream waits for that copy at once; the fence makes it wait for the
  rest. Both are GPU-side waits: the CPU does not block in ``capture()``. The announce to the sidecar is sent once
  the whole copy has completed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from snapshotd.proto import Announce
from snapshotd.shm import Arena

from .channel import Channel
from .state import FlatState, copy_into

__all__ = ["Stager"]

log = logging.getLogger(__name__)


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "to_local", None)
    if callable(local):  # DTensor: its local shard
        t = local()
    return t.untyped_storage().data_ptr()


class _Copy:
    """One staging copy in flight: done when the CPU part finished and the CUDA event (if any) completed; the
    CUDA part's time runs from ``cuda_started`` to ``cuda_event`` on the side stream."""

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
        self._side_stream: Any = None
        self._last_event: Any = None  # the CUDA part of the last copy, until the host has waited for it
        self._pinned: list[int] = []

    def pin(self, arena: Arena) -> None:
        """Page-lock the arena for CUDA copies (no-op without CUDA)."""
        if not torch.cuda.is_available() or arena.slot_bytes == 0:
            return
        ptr = torch.frombuffer(arena.slot(0), dtype=torch.uint8).data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, arena.slot_bytes * arena.slots, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of the arena failed (%s): CUDA copies will be slower", err)
            return
        self._pinned.append(ptr)

    def _async_mask(self, flat: FlatState) -> list[bool]:
        """Which tensors only optimizer.step() changes (cached per layout)."""
        if flat.layout is self._safe_layout or flat.layout == self._safe_layout:
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
        self._safe_layout = flat.layout
        return self._safe

    def stage(
        self, flat: FlatState, dst: torch.Tensor, channel: Channel, announce: Announce, on_abandon: Callable[[], None]
    ) -> None:
        """Copy ``flat`` into ``dst`` (partly now, partly in the background) and then send ``announce``.

        The caller must not start another stage before the previous one is fenced (the optimizer pre-hook does it
        every step; :meth:`fence` does it explicitly). If the fence times out, the copy is abandoned: no announce
        is sent and ``on_abandon`` runs, so a torn snapshot never leaves the process.
        """
        self.fence()
        mask = self._async_mask(flat)
        on_cuda = [t.is_cuda for t in flat.tensors]
        sync_idx = [i for i, (safe, cuda) in enumerate(zip(mask, on_cuda, strict=True)) if not safe and not cuda]
        cpu_async = [i for i, (safe, cuda) in enumerate(zip(mask, on_cuda, strict=True)) if safe and not cuda]
        cuda_idx = [i for i, cuda in enumerate(on_cuda) if cuda]
        t0 = time.perf_counter()
        if sync_idx:
            copy_into(flat, dst, only=sync_idx)
        sync_seconds = time.perf_counter() - t0
        event = started = None
        if cuda_idx:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream()
            training = torch.cuda.current_stream()
            self._side_stream.wait_stream(training)
            mutable = [i for i in cuda_idx if not mask[i]]
            with torch.cuda.stream(self._side_stream):
                started = torch.cuda.Event(enable_timing=True)
                started.record(self._side_stream)
                if mutable:  # copied first: the training stream waits for these (below), not for the rest
                    copy_into(flat, dst, only=mutable, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(self._side_stream)
                copy_into(flat, dst, only=[i for i in cuda_idx if mask[i]], non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)
                event.record(self._side_stream)
            if mutable:  # nothing queued on the training stream from now on may change them before they are copied
                training.wait_event(copied)  # a GPU-side wait: this thread goes on at once
        job = _Copy(event, started)
        self._inflight = job
        self._last_event = event

        def background() -> None:  # the one writer of stats.copy_seconds: the channel's thread
            seconds = sync_seconds
            try:
                t0 = time.perf_counter()
                if cpu_async:
                    copy_into(flat, dst, only=cpu_async)
                seconds += time.perf_counter() - t0
            finally:
                job.cpu_done.set()
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
                seconds += job.cuda_started.elapsed_time(job.cuda_event) / 1e3
            self.stats.copy_seconds += seconds
            if job.abandoned:
                on_abandon()
            else:
                channel.send_now(announce)

        channel.submit(background)

    def fence(self, timeout: float | None = 60.0, *, host: bool = False) -> None:
        """Wait for the copy in flight: its CPU part on this thread, its CUDA part as a GPU-side wait (kernels
        queued on the training stream from now on run after it). With ``host``, this thread also waits for the
        CUDA part of the last copy, fenced before or not: needed before the arena it writes into is unmapped,
        unregistered or handed back."""
        job = self._inflight
        if job is not None:
            self._inflight = None
            t0 = time.perf_counter()
            if job.cuda_event is not None:
                torch.cuda.current_stream().wait_event(job.cuda_event)
            if not job.cpu_done.wait(timeout):
                job.abandoned = True
                log.warning("snapshot copy did not finish within %s s; abandoning that snapshot", timeout)
            self.stats.fence_seconds += time.perf_counter() - t0
        if host and self._last_event is not None:
            self._last_event.synchronize()
            self._last_event = None

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.fence()

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for ptr in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._pinned = []
