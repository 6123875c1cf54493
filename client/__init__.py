"""The training-side hook: ``Snapshotter`` and ``RNGState``.

::

    from snapshotd.client import RNGState, Snapshotter
"""

from __future__ import annotations

from .errors import (
    ConfigMismatch,
    IntegrityError,
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
    "IntegrityError",
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
