"""The training-side hook: ``Snapshotter`` and ``RNGState``.

::

    from snapshotd.client import RNGState, Snapshotter
"""

from __future__ import annotations

from .errors import (
    ConfigMismatch,
    NotRecoverable,
    ReplicaGroupError,
    RestoreFailed,
    SidecarRefused,
    SidecarUnavailable,
    SnapshotdError,
)
from .rng import RNGState
from .snapshotter import Snapshotter
from .stats import SnapshotStats

__all__ = [
    "ConfigMismatch",
    "NotRecoverable",
    "RNGState",
    "ReplicaGroupError",
    "RestoreFailed",
    "SidecarRefused",
    "SidecarUnavailable",
    "SnapshotStats",
    "SnapshotdError",
    "Snapshotter",
]
