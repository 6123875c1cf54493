"""Who may talk to a snapshotd process.

Snapshots are the model itself, so every TCP socket of a job whose members share ``SNAPSHOTD_SECRET`` runs
CurveZMQ: the server and client key pairs are derived from the secret, and a ZAP handler admits only clients
whose long-term key is the one derived from the same secret. Without a secret, daemons bind loopback only
(with a warning) unless told ``--insecure``. ipc endpoints and shared-memory files are owner-only in every mode.

A sidecar's data plane may instead run in ``members`` mode (``--data-security members``): plaintext, for
private training fabrics where CURVE's one core per connection would cap the stream rate, behind
:class:`MembersGate`, which admits a connection only from the host of a live member's data address, as the
coordinator (over CURVE) says. It keeps out anyone on another host; it does not encrypt, and it does not tell
apart two processes on a member's host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import logging
import os
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
import zmq.auth.asyncio
from zmq.utils import z85

__all__ = [
    "DATA_SECURITY_MODES",
    "CurveKeys",
    "MembersGate",
    "check_bind",
    "curve_keys",
    "ip_host",
    "secret_from_env",
    "secure_client",
    "secure_server",
    "start_authenticator",
]

log = logging.getLogger(__name__)

DATA_SECURITY_MODES = ("curve", "members")
"""A sidecar's data-plane modes (``--data-security``); ``curve`` is the default whenever a secret is set."""
DATA_DOMAIN = b"snapshotd-data"
"""The ZAP domain of a ``members`` mode data plane (a NULL-mechanism socket asks ZAP only when it has one)."""
MEMBER_TTL_S = 60.0
"""How long a host the coordinator called a member is admitted without asking again."""
REFUSED_TTL_S = 5.0
"""How long a refused host is refused without asking again (a host that keeps knocking costs one query per this)."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


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


def ip_host(addr: str) -> str:
    """The host of ``tcp://HOST:PORT`` when it is an IP address (what ZAP reports a peer by), lower-cased.

    Raises:
        ValueError: the host is a name (``members`` mode compares addresses, never resolves names).
    """
    host = (urlsplit(addr).hostname or "").lower()
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--data-security members needs an IP address to advertise, got {host!r} in {addr}: "
                         "pass --advertise with this node's address on the training network") from None
    return host


class MembersGate:
    """The ZAP handler of a ``members`` mode sidecar: admit a data-plane connection only from a member's host.

    Each handshake on a socket with :data:`DATA_DOMAIN` is answered from a cache of the coordinator's answers
    (``is_member(host)``; a member is remembered for :data:`MEMBER_TTL_S`, a refusal for :data:`REFUSED_TTL_S`),
    else after asking it; handshakes are answered concurrently, so a slow answer delays only its own
    connection. A question that fails (the coordinator unreachable) refuses the connection and is not
    remembered. Anything but a NULL handshake in that domain is refused. Connections already admitted stay up.

    Args:
        ctx: the context whose sockets this gate serves (at most one ZAP handler per context).
        is_member: asks the coordinator; raises on failure.
    """

    def __init__(self, ctx: zmq.asyncio.Context, is_member: Callable[[str], Awaitable[bool]]) -> None:
        self.ctx = ctx
        self.is_member = is_member
        self.sock: zmq.asyncio.Socket | None = None
        self._known: dict[str, tuple[bool, float]] = {}  # host -> (member, until)
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()

    def start(self) -> None:
        """Bind the ZAP endpoint and serve it on the running loop until :meth:`stop`."""
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(_ZAP_ENDPOINT)
        self._spawn(self._serve())

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            try:
                split = frames.index(b"")
            except ValueError:
                continue  # not a ZAP request
            envelope, request = frames[: split + 1], frames[split + 1 :]
            if len(request) < 6:
                continue
            self._spawn(self._answer(envelope, request))

    async def _answer(self, envelope: list[bytes], request: list[bytes]) -> None:
        _version, request_id, domain, address, _identity, mechanism = request[:6]
        host = address.decode("ascii", "replace").lower()
        if domain != DATA_DOMAIN or mechanism != b"NULL":
            ok, why = False, f"unexpected {mechanism.decode('ascii', 'replace')} handshake in domain {domain!r}"
        else:
            ok, why = await self.admits(host)
        if not ok and host not in self._warned:
            if len(self._warned) < 1024:
                self._warned.add(host)
            log.warning("refused a data-plane connection from %s: %s", host, why)
        status = [b"200", b"OK"] if ok else [b"400", why.encode()[:255]]
        if self.sock is not None:
            await self.sock.send_multipart([*envelope, b"1.0", request_id, *status, b"", b""])

    async def admits(self, host: str) -> tuple[bool, str]:
        """Whether to admit a connection from ``host``, and why not (empty when admitted)."""
        now = time.monotonic()
        known = self._known.get(host)
        if known is None or known[1] <= now:
            try:
                member = await self.is_member(host)
            except Exception as exc:
                return False, f"cannot ask the coordinator whether it is a member: {exc}"
            if len(self._known) > 100_000:
                self._known = {h: k for h, k in self._known.items() if k[1] > now}
            known = self._known[host] = (member, now + (MEMBER_TTL_S if member else REFUSED_TTL_S))
        return (True, "") if known[0] else (False, "not the host of any live member of this job")
