"""The coordinator (``snapshotd coordinator``, one per job): membership, buddy placement, failure detection,
the recoverable and durable steps, recovery plans and re-replication.

It holds only soft state: after a restart it rebuilds everything from the sidecars' next reports, and no snapshot
data ever passes through it. :class:`CoordinatorState` is the pure logic (made of the parts :mod:`.state`
names), :func:`run_coordinator` the process.
"""

from __future__ import annotations

from .config import CoordinatorConfig
from .server import run_coordinator
from .state import CoordinatorState

__all__ = ["CoordinatorConfig", "CoordinatorState", "run_coordinator"]
