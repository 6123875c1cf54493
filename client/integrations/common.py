"""What the frameworks' callbacks share: the Snapshotter a restore makes (:class:`Hold`), and DDP's gradient bucket
layout taken from a snapshot once the framework has wrapped the model (:func:`ddp_layouts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ..ddp import DDPBuckets
from ..snapshotter import Snapshotter

__all__ = ["Hold", "ddp_layouts"]


class Hold:
    """The Snapshotter of a framework's callback: made by the first :meth:`restore` from the callback's
    arguments (``snapshotter``: the Snapshotter's keyword arguments), required by every hook after it."""

    def __init__(self, snapshotter: Mapping[str, Any], how: str) -> None:
        self._kwargs = dict(snapshotter)
        self._how = how
        self.snap: Snapshotter | None = None

    def restore(self, state: Mapping[str, Any], timeout: float) -> int:
        """Make the Snapshotter over ``state`` (the first time) and restore; the step restored (0: a fresh job)."""
        if self.snap is None:
            self.snap = Snapshotter(state, **self._kwargs)
        return self.snap.restore(timeout=timeout)

    def close(self, *, unregister: bool = True) -> None:
        """Close the Snapshotter, if any, and forget it (a later hook requires a new restore)."""
        if self.snap is not None:
            self.snap.close(unregister=unregister)
            self.snap = None

    def required(self) -> Snapshotter:
        """The Snapshotter.

        Raises:
            RuntimeError: no restore made it: the script does not resume from the snapshot (``how`` says how to).
        """
        if self.snap is None:
            raise RuntimeError(
                f"SnapshotdCallback: call {self._how} so that a restarted rank resumes from the snapshot instead "
                "of starting over"
            )
        return self.snap


def ddp_layouts(wrapped: Any, layout: Mapping[str, Any] | None) -> DDPBuckets | None:
    """The gradient bucket layouts of ``wrapped`` (None unless it is a DDP module), which first takes ``layout`` (a
    snapshot's, if any): call it once the framework has wrapped the model and before its first step, so that a
    resumed run sums gradients in the same order as the run that was snapshotted."""
    if not isinstance(wrapped, DistributedDataParallel):
        return None
    buckets = DDPBuckets({"model": wrapped})
    if layout:
        buckets.load_state_dict(layout)
    return buckets
