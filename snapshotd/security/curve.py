"""CURVE mode: every TCP socket of a job encrypted and authenticated with keys derived from ``SNAPSHOTD_SECRET``.

The server and client key pairs are derived from the secret (:func:`curve_keys`), and a ZAP handler
(:func:`start_authenticator`) admits only clients whose long-term key is the one derived from the same secret.
Without a secret, daemons bind loopback only (with a warning) unless told ``--insecure`` (:func:`check_bind`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import os
from urllib.parse import urlsplit

import zmq
import zmq.auth.asyncio
from zmq.utils import z85

__all__ = [
    "CurveKeys",
    "check_bind",
    "curve_keys",
    "secret_from_env",
    "secure_client",
    "secure_server",
    "start_authenticator",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded CurveZMQ key pairs derived from a job secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def secret_from_env() -> str | None:
    """``$SNAPSHOTD_SECRET``, or None when unset or empty."""
    return os.environ.get("SNAPSHOTD_SECRET") or None


def curve_keys(secret: str) -> CurveKeys:
    """The job's key pairs: ``zmq.curve_public`` of a SHA-256 of the secret, one pair per role."""

    def pair(role: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(b"snapshotd/" + role + b"\0" + secret.encode()).digest())
        return zmq.curve_public(sk), sk

    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def secure_server(sock: zmq.Socket, secret: str | None) -> None:
    """Make a bound socket a CURVE server (before ``bind``). No-op without a secret."""
    if secret is None:
        return
    keys = curve_keys(secret)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, secret: str | None) -> None:
    """Make a connecting socket a CURVE client of the job's servers (before ``connect``). No-op without one."""
    if secret is None:
        return
    keys = curve_keys(secret)
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


class _JobMembers:
    """ZAP credentials provider: admit exactly the client key derived from the job secret."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.client_public
        if not ok:
            log.warning("refused a CURVE client whose key is not the job's (wrong SNAPSHOTD_SECRET?)")
        return ok


def start_authenticator(ctx: zmq.Context, secret: str | None) -> zmq.auth.asyncio.AsyncioAuthenticator | None:
    """Start the context's ZAP handler (on the running loop) that checks CURVE clients. None without a secret.

    The caller stops it with ``.stop()`` at shutdown.
    """
    if secret is None:
        return None
    auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx, log=logging.getLogger("snapshotd.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_JobMembers(curve_keys(secret).client_public))
    return auth


def check_bind(endpoint: str, secret: str | None, insecure: bool) -> None:
    """Refuse a routable TCP bind without a secret unless ``insecure``; warn on loopback without one.

    Raises:
        ValueError: a routable bind with no secret and no ``--insecure``.
    """
    if secret is not None or not endpoint.startswith("tcp://"):
        return
    host = urlsplit(endpoint).hostname or ""
    loopback = host in ("localhost",) or _is_loopback(host)
    if loopback:
        log.warning("no SNAPSHOTD_SECRET: %s is unauthenticated (loopback only)", endpoint)
        return
    if not insecure:
        raise ValueError(
            f"refusing to bind {endpoint} without SNAPSHOTD_SECRET: anyone who can reach it could read or "
            "overwrite model state. Set SNAPSHOTD_SECRET on every member of the job, or pass --insecure."
        )
    log.warning("--insecure: %s accepts anyone who can reach it", endpoint)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
