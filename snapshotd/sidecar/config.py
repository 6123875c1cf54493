"""The sidecar's configuration; the CLI only maps flags onto it."""

from __future__ import annotations

import dataclasses
import socket

from snapshotd.proto.limits import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from snapshotd.security import DATA_SECURITY_MODES
from snapshotd.shm import default_ipc_path
from snapshotd.units import parse_host_port

__all__ = ["SidecarConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class SidecarConfig:
    coordinator: str
    """Control-plane endpoint of the job's coordinator, e.g. ``tcp://10.0.0.1:7070``."""

    node: str = dataclasses.field(default_factory=socket.gethostname)
    """This node's name: its identity at the coordinator and its failure domain."""

    rack: str = ""
    """Failure-domain label above the node; buddies are never placed in the same rack. Empty: the node alone."""

    ipc: str = dataclasses.field(default_factory=default_ipc_path)
    """Path of the ipc socket local training ranks connect to (owner-only)."""

    data_bind: str = "tcp://127.0.0.1:0"
    """Where buddies reach this sidecar's data plane. Port 0 picks a free one."""

    advertise: str | None = None
    """Host name or address peers use to reach ``data_bind`` (default: the bind host, or the host name)."""

    memory_limit: int = 64 << 30
    """Bytes of host memory for buddy copies; past it new streams are refused (senders skip steps)."""

    max_rate: float | None = None
    """Outgoing bytes/s for snapshot streams; None is ``auto`` (spread over the steps and held to
    ``step_budget``, see :mod:`snapshotd.sidecar.pacer`)."""

    step_budget: float = 0.01
    """With ``auto``: the slowdown of the local ranks' steps that snapshots may cost, the staging copy and the
    streams (0.01 = 1%)."""

    chunk_bytes: int = 4 << 20
    """Bytes per data-plane chunk: the unit of streams, pulls and end-to-end checksums (docs/benchmarks.md compares
    chunk sizes)."""

    window: int = 16
    """Unacknowledged chunks in flight per stream (credit-based flow control)."""

    codec: str = "auto"
    """``auto`` (delta-lz4 when measured to pay at the current rate), ``raw``, or ``delta-lz4`` (always)."""

    heartbeat_interval: float = 0.5
    """Seconds between heartbeats to the coordinator (the coordinator's value wins once registered)."""

    request_timeout: float = 10.0
    """Seconds to wait for any single peer reply (accept, ack, pull data) before giving up on that peer."""

    drain_timeout: float = 20.0
    """On SIGTERM, at most this many seconds serving on while the coordinator places elsewhere every snapshot this
    node holds that no node that stays holds (see :class:`~snapshotd.proto.Drain`); a second SIGTERM or SIGINT
    stops at once. 0 stops at once."""

    nice: int = 10
    """CPU priority increment for the sidecar process: snapshots use CPU that training leaves idle. On a machine
    whose cores training keeps busy, the sidecar then streams less often (the client skips steps) instead of
    slowing steps down. 0 keeps the priority of the shell."""

    secret: str | None = None
    """The job's ``SNAPSHOTD_SECRET``: CURVE on every TCP socket when set (but see ``data_security``)."""

    data_security: str = "curve"
    """With a secret: ``curve`` encrypts the data plane too; ``members`` leaves it plaintext and admits only
    connections from the hosts of live members' data addresses, as the coordinator says (the control plane stays
    on CURVE; see :mod:`snapshotd.security`). Needs ``advertise`` (or the bind host) to be an IP address."""

    insecure: bool = False
    """Allow a routable ``data_bind`` without a secret."""

    bulk_port: int | None = 0
    """The TCP port, on ``data_bind``'s host, where restoring ranks fetch copies held here themselves
    (:mod:`snapshotd.proto.bulk`; 0 picks a free one); None: none, restores pull through the sidecars. Served only
    on a plaintext data plane (no secret, or ``members``): with ``curve`` it would expose what CURVE encrypts."""

    push_connections: int = 4
    """Connections that carry one stream to one buddy when it pushes over the buddy's bulk port (a plaintext data
    plane with bulk ports at both ends, chunks going raw; :mod:`snapshotd.sidecar.push`); 0: streams go over the
    data plane's messages. More connections spread the kernel's copies over more cores at each end."""

    @property
    def pushes(self) -> bool:
        """Whether this sidecar's streams offer to push over their buddies' bulk ports (see ``push_connections``)."""
        return self.push_connections > 0 and self.serves_bulk

    @property
    def serves_bulk(self) -> bool:
        """Whether this sidecar opens a bulk port (see ``bulk_port``)."""
        return self.bulk_port is not None and (self.secret is None or self.data_security == "members")

    metrics_bind: str | None = None
    """``HOST:PORT`` to serve Prometheus metrics at ``/metrics`` (:mod:`snapshotd.metrics`); None: none."""

    def __post_init__(self) -> None:
        if not self.coordinator:
            raise ValueError("--coordinator is required (e.g. tcp://HOST:7070)")
        if not self.node or len(self.node) > 256:
            raise ValueError(f"--node must be 1-256 characters, got {self.node!r}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk size must be between 4 KiB and 64 MiB, got {self.chunk_bytes}")
        if self.memory_limit <= 0:
            raise ValueError(f"--memory-limit must be positive, got {self.memory_limit}")
        if self.max_rate is not None and self.max_rate <= 0:
            raise ValueError(f"--max-rate must be positive or auto, got {self.max_rate}")
        if not 0 < self.step_budget <= 1:
            raise ValueError(f"--step-budget must be above 0% and at most 100%, got {self.step_budget:.4%}")
        if not 1 <= self.window <= 1024:
            raise ValueError(f"window must be 1-1024 chunks, got {self.window}")
        if self.codec not in ("auto", "raw", "delta-lz4"):
            raise ValueError(f"codec must be auto, raw or delta-lz4, got {self.codec!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"--nice must be 0-19, got {self.nice}")
        if self.data_security not in DATA_SECURITY_MODES:
            raise ValueError(
                f"--data-security must be one of {', '.join(DATA_SECURITY_MODES)}, got {self.data_security!r}"
            )
        if self.data_security == "members" and self.secret is None:
            raise ValueError(
                "--data-security members needs SNAPSHOTD_SECRET: the coordinator, which says who is "
                "a member, is reached over CURVE"
            )
        if self.metrics_bind is not None:
            parse_host_port(self.metrics_bind, "--metrics-bind")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"--bulk-port must be 0-65535 or off, got {self.bulk_port}")
        if not 0 <= self.push_connections <= 16:
            raise ValueError(f"--push-connections must be 0-16, got {self.push_connections}")
        if not 0 <= self.drain_timeout <= 3600:
            raise ValueError(f"--drain-timeout must be 0-3600 s, got {self.drain_timeout}")
        if self.heartbeat_interval <= 0 or self.request_timeout <= 0:
            raise ValueError("heartbeat interval and request timeout must be positive")
