"""What a Snapshotter counts: :class:`SnapshotStats`, read any time from ``snap.stats``."""

from __future__ import annotations

import collections
import dataclasses
import re
import threading

__all__ = ["ProblemLog", "SnapshotStats"]


@dataclasses.dataclass(slots=True)
class SnapshotStats:
    """Counters of one Snapshotter (read them any time; they are updated from two threads)."""

    started: int = 0
    """Snapshots staged and announced to the sidecar."""
    skipped: int = 0
    """capture() calls that found no free slot (the network is behind) or a sidecar problem."""
    durable: int = 0
    """Snapshots every buddy acknowledged."""
    failed: int = 0
    """Snapshots the sidecar refused or could not stream to every buddy."""
    bytes: int = 0
    """Tensor bytes staged."""
    copy_seconds: float = 0.0
    """Time the staging copies of those bytes took: CPU tensors' copies in wall time on the thread that ran them
    (a background copy shares the cores and memory with the training step it overlaps), CUDA tensors'
    device-to-host copies on the side stream (timed with CUDA events, so without the wait for the training
    stream). ``bytes / copy_seconds`` is the staging rate."""
    last_durable_step: int = -1
    last_step: int = -1
    """The newest step passed to capture()."""
    rpo_steps: int = 0
    """Steps a failure now would cost: ``last_step`` minus the newest durable step (or the step restored)."""
    rpo_seconds: float = 0.0
    """The same in seconds: from the capture() of that durable step to the newest capture()."""
    capture_seconds: float = 0.0
    """Training-thread time spent inside capture()."""
    fence_seconds: float = 0.0
    """Training-thread time the optimizer pre-hook waited for a staging copy."""
    auto_interval: int = 0
    """With ``every="auto"``: the steps between snapshots now chosen (0 otherwise)."""
    stride: int = 0
    """With ``every=N`` and ``when_busy="skip"``: the steps between the snapshots now due, ``N`` times a power of
    two that doubles when a due step finds no free slot and halves as slots free again (0 otherwise). A node
    lost now costs at most ``(slots + 1) * stride - 1`` steps (:func:`~snapshotd.client.schedule.max_steps_lost`):
    up to ``2 * stride - 1`` since the last snapshot started (a step left out for the pacer's clean steps adds a
    stride), and the ``slots - 1`` strides whose snapshots may not have reached its buddies yet."""
    errors: int = 0
    last_error: str = ""


class ProblemLog:
    """Which kinds of snapshot problem were warned about already: each kind is logged once as a warning, and the
    rest only counted (``stats.errors``, ``stats.last_error``).

    A kind is a problem's text with its numbers left out, so that the same failure at step 5 and at step 6 is one
    kind. At most :attr:`KINDS` kinds are remembered, the oldest forgotten first, so that a long job meeting
    problem after problem holds a bounded set. Safe to call from any thread (the training thread and the
    channel's both report problems).
    """

    KINDS = 64

    def __init__(self) -> None:
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def first(self, text: str) -> bool:
        """Whether ``text`` is of a kind not warned about (lately); remembers its kind."""
        kind = re.sub(r"\d+", "#", text)
        with self._lock:
            if kind in self._seen:
                self._seen.move_to_end(kind)
                return False
            self._seen[kind] = None
            if len(self._seen) > self.KINDS:
                self._seen.popitem(last=False)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
