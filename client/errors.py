"""What snapshotd raises into a training process.

Every error a :class:`~snapshotd.client.Snapshotter` raises about snapshots, sidecars or recovery is one of these,
so a training script can catch them without parsing messages or knowing the transport (no ZeroMQ type ever
reaches it)::

    Exception
     +-- SnapshotdError                    anything snapshotd raises about snapshots and recovery
          +-- SidecarUnavailable           the node's sidecar, or through it the coordinator, did not answer in
          |                                time (also a TimeoutError)
          +-- NotRecoverable               no step of the job is complete for every rank on a live node: restore
          |                                from a disk checkpoint
          +-- RestoreFailed                the job's recoverable step could not be brought to this rank (every
          |    |                           holder failed); every rank calls restore() again
          |    +-- IntegrityError          every copy of some chunk of it failed its end-to-end checksum (the
          |                                message names rank, step and chunk); no good copy is left
          +-- ConfigMismatch               the snapshot does not fit this state: other keys, shapes, dtypes,
          |                                replicated= keys or group size, or DDP wrapping (also a ValueError)
          +-- ReplicaGroupError            with replicated=: another rank of the replica group failed its part
          |                                (also a RuntimeError)
          +-- SidecarRefused               the sidecar refused a request of this client (its code says why)
          +-- PeerLost                     live mode: a collective failed because a peer died or hung; call
          |                                recover()
          +-- RecoveryFailed               live mode: recover() could not form the job's new group (the
                                           replacement never came, or members kept dying while it formed)

Arguments that make no sense (``every=0``, a rank outside the world size) and state values that cannot be
snapshotted are the ``ValueError`` and ``TypeError`` that Python code expects, raised at once.

A sidecar's refusal comes over the ipc socket as an :class:`~snapshotd.proto.Error` whose
:class:`~snapshotd.proto.ErrorCode` :func:`from_reply` maps onto this tree.
"""

from __future__ import annotations

from snapshotd.proto import Error, ErrorCode

__all__ = [
    "ConfigMismatch",
    "IntegrityError",
    "NotRecoverable",
    "PeerLost",
    "RecoveryFailed",
    "ReplicaGroupError",
    "RestoreFailed",
    "SidecarRefused",
    "SidecarUnavailable",
    "SnapshotdError",
    "from_reply",
]


class SnapshotdError(Exception):
    """Base of every error snapshotd raises into a training process about snapshots and recovery."""

    code: ErrorCode | None = None
    """The sidecar's error code, for errors that came from one."""


class SidecarUnavailable(SnapshotdError, TimeoutError):
    """The node's sidecar did not answer within the deadline (is ``snapshotd serve`` running, with this ``--ipc``
    path?), or it got no recovery plan from the coordinator in time."""


class NotRecoverable(SnapshotdError):
    """No step of this job is complete for every rank on a live node: fall back to your disk checkpoint."""


class RestoreFailed(SnapshotdError):
    """The recoverable step could not be brought to this rank (no holder delivered it whole, or it could not be
    loaded); every rank of the job calls ``restore()`` again."""


class IntegrityError(RestoreFailed):
    """Every copy of some chunk of the recoverable step failed its end-to-end checksum (bytes changed at rest, in
    flight or in shared memory since the rank announced them); each failing copy was dropped. Restore from a disk
    checkpoint if asking again fails the same way."""


class ConfigMismatch(SnapshotdError, ValueError):
    """The snapshot does not fit the live state: different keys, shapes or dtypes, ``replicated=`` keys or group
    size, or a model wrapped in DDP when the snapshot was taken but not now."""


class ReplicaGroupError(SnapshotdError, RuntimeError):
    """With ``replicated=``: another rank of the replica group could not restore its part, so no rank can load the
    replicated state whole (that rank raises its own error)."""


class PeerLost(SnapshotdError):
    """Live mode: a collective of the training step failed because a peer is gone (its connection closed) or hung
    (the group's timeout passed); :meth:`Snapshotter.recover` brings the job back. The original error is the
    ``__cause__``."""


class RecoveryFailed(SnapshotdError):
    """Live mode: the job's new process group did not form (no replacement within the join timeout, or members
    died while it formed, every attempt); end the process and let its launcher restart it."""


class SidecarRefused(SnapshotdError):
    """The sidecar refused a request of this client; :attr:`code` says why (a message it could not read, a
    request out of order, or its own failure)."""


_BY_CODE: dict[ErrorCode, type[SnapshotdError]] = {
    ErrorCode.PLAN_TIMEOUT: SidecarUnavailable,
    ErrorCode.NOT_RECOVERABLE: NotRecoverable,
    ErrorCode.PULL_FAILED: RestoreFailed,
    ErrorCode.CORRUPT: IntegrityError,
}


def from_reply(reply: Error, request: str) -> SnapshotdError:
    """The exception for the sidecar's ``reply`` to the client's ``request`` (a message type)."""
    cls = _BY_CODE.get(reply.code, SidecarRefused)
    exc = cls(f"sidecar answered {request} with {reply.code}: {reply.message}")
    exc.code = reply.code
    return exc
