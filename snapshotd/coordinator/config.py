"""The coordinator's configuration: one validated dataclass that the CLI fills from its flags."""

from __future__ import annotations

import dataclasses
import math

from snapshotd.units import parse_host_port

__all__ = ["CoordinatorConfig"]

_MAX_REPLICAS = 64  # Assignment.buddies carries at most 64 addresses


@dataclasses.dataclass(kw_only=True, slots=True)
class CoordinatorConfig:
    """Settings of one ``snapshotd coordinator`` process.

    Raises:
        ValueError: from ``__post_init__``, naming the offending field, for any value out of range.
    """

    bind: str = "tcp://127.0.0.1:7070"
    """The control plane's endpoint (``tcp://HOST:PORT``, port 0 picks a free one; ``mem://NAME`` in-process)."""

    replicas: int = 1
    """Buddy copies of every rank's snapshot on nodes in other racks (1..64); durability counts these."""

    heartbeat_interval: float = 0.5
    """Seconds between a sidecar's heartbeats; told to each sidecar when it registers."""

    heartbeat_timeout: float = 3.0
    """A node silent for this many seconds is dead. Also the length of the rebuild window after a start, during
    which plan requests wait for the sidecars to report their inventories again. Both stretch with the
    heartbeat interval when the fleet outgrows ``target_heartbeats_per_s``."""

    target_heartbeats_per_s: float = 4000.0
    """The heartbeat rate the coordinator keeps its fleet under. While more than ``target_heartbeats_per_s *
    heartbeat_interval`` nodes are live (2,000 by default), the interval given to every sidecar is
    ``live nodes / target_heartbeats_per_s`` (rounded up to a quarter of ``heartbeat_interval``: 2.5 s for
    10,000 nodes), and the death timeout and rebuild window grow by the same factor. The default keeps the
    coordinator's one core short of busy with heartbeats that carry a changed inventory, with room left for plan
    rounds and bursts (``snapshotd-bench scale`` reports what a heartbeat costs: ``cpu_per_hb_us``)."""

    plan_hold: float = 3.0
    """Longest time a plan request that must wait is held unanswered (long-polling); it is answered the moment
    its job's round is decided, else with ``wait`` after this long and the sidecar asks again. 0 answers at once.
    Keep it under the sidecar's per-request timeout (5 s), with room for a busy coordinator's backlog; the
    longer it is, the fewer ranks are between a ``wait`` and their next request when the round is decided."""

    forget_jobs_after: float = 600.0
    """Seconds after which a job that no live node reports (no rank registered, no copy held) is forgotten: it
    leaves the status document and the coordinator's memory. Nothing of it is left to restore by then; a job that
    starts again under the same name starts afresh."""

    secret: str | None = dataclasses.field(default=None, repr=False)
    """The job's ``SNAPSHOTD_SECRET``; when set, the socket is a CURVE server that admits only job members."""

    insecure: bool = False
    """Allow a routable bind without a secret (``--insecure``); loopback binds never need it."""

    metrics_bind: str | None = None
    """``HOST:PORT`` to serve Prometheus metrics at ``/metrics`` (:mod:`snapshotd.metrics`); None: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.bind, str) or not self.bind.startswith(("tcp://", "ipc://", "mem://")):
            raise ValueError(f"bind: {self.bind!r} is not an endpoint (tcp://HOST:PORT)")
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= _MAX_REPLICAS:
            raise ValueError(f"replicas: {self.replicas!r} is not an integer in [1, {_MAX_REPLICAS}]")
        if not _finite(self.heartbeat_interval) or not 0.01 <= self.heartbeat_interval <= 3600.0:
            raise ValueError(f"heartbeat_interval: {self.heartbeat_interval!r} s is not in [0.01, 3600]")
        if not _finite(self.heartbeat_timeout) or self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout: {self.heartbeat_timeout!r} s must be longer than heartbeat_interval "
                f"({self.heartbeat_interval} s)"
            )
        if not _finite(self.target_heartbeats_per_s) or self.target_heartbeats_per_s <= 0:
            raise ValueError(
                f"target_heartbeats_per_s: {self.target_heartbeats_per_s!r} is not a positive number"
            )
        if not _finite(self.plan_hold) or not 0.0 <= self.plan_hold <= 60.0:
            raise ValueError(f"plan_hold: {self.plan_hold!r} s is not in [0, 60]")
        if not _finite(self.forget_jobs_after) or self.forget_jobs_after <= 0:
            raise ValueError(f"forget_jobs_after: {self.forget_jobs_after!r} s is not a positive number")
        if self.metrics_bind is not None:
            parse_host_port(self.metrics_bind, "--metrics-bind")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ValueError("secret: must be a non-empty string, or None for no secret")


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
