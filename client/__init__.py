"""The training-side hook: ``Snapshotter`` and ``RNGState``.

::

    from snapshotd.client import RNGState, Snapshotter
"""

from __future__ import annotations

from .channel import SidecarUnavailable
from .rng import RNGState
from .snapshotter import NotRecoverable, SnapshotStats, Snapshotter

__all__ = ["NotRecoverable", "RNGState", "SidecarUnavailable", "SnapshotStats", "Snapshotter"]
