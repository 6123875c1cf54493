"""The training-side hook: ``Snapshotter`` and ``RNGState``.

::

    from snapshotd.client import RNGState, Snapshotter

Live mode (survivors of a node's loss keep their processes) is :mod:`snapshotd.client.live`.
"""

from __future__ import annotations

from .errors import (
    ConfigMismatch,
    IntegrityError,
    NotRecoverable,
    PeerLost,
    RecoveryFailed,
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
    "PeerLost",
    "RNGState",
    "RecoveryFailed",
    "ReplicaGroupError",
    "RestoreFailed",
    "SidecarRefused",
    "SidecarUnavailable",
    "SnapshotStats",
    "SnapshotdError",
    "Snapshotter",
]
