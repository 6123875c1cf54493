"""Who may talk to a snapshotd process.

Snapshots are the model itself, so every TCP socket of a job whose members share ``SNAPSHOTD_SECRET`` runs
CurveZMQ: the server and client key pairs are derived from the secret, and a ZAP handler admits only clients
whose long-term key is the one derived from the same secret. Without a secret, daemons bind loopback only
(with a warning) unless told ``--insecure``. ipc endpoints and shared-memory files are owner-only in every mode.
That is :mod:`.curve`.

A sidecar's data plane may instead run in ``members`` mode (``--data-security members``): plaintext, for
private training fabrics where CURVE's one core per connection would cap the stream rate, behind
:class:`MembersGate`, which admits a connection only from the host of a live member's data address, as the
coordinator (over CURVE) says. It keeps out anyone on another host; it does not encrypt, and it does not tell
apart two processes on a member's host. That is :mod:`.members`.

In either mode a refused handshake is named rather than left to time out: :class:`HandshakeWatch`
(:mod:`.handshakes`).
"""

from __future__ import annotations

from .curve import (
    CurveKeys,
    check_bind,
    curve_keys,
    secret_from_env,
    secure_client,
    secure_server,
    start_authenticator,
)
from .handshakes import HandshakeWatch
from .members import DATA_DOMAIN, MembersGate, data_host, members_source

__all__ = [
    "DATA_DOMAIN",
    "DATA_SECURITY_MODES",
    "CurveKeys",
    "HandshakeWatch",
    "MembersGate",
    "check_bind",
    "curve_keys",
    "data_host",
    "members_source",
    "secret_from_env",
    "secure_client",
    "secure_server",
    "start_authenticator",
]

DATA_SECURITY_MODES = ("curve", "members")
"""A sidecar's data-plane modes (``--data-security``); ``curve`` is the default whenever a secret is set."""
